"""Bucket enumeration: which (tag | prompt label) x layer group buckets calibration measures.

Token accounting follows the cache exactly. A case stores its prompt plus the generated tokens
fed back to the model (every generated token except the last one when the run stopped on the
grammar or on length; all of them when it stopped on EOS, which is never stored). At the end of
the case the last ``recent_window`` stored tokens are still H; every other stored token carries
its bucket's action. The *share* of an item (a decode tag or a prompt label) is the mean over
cases of (its stored tokens outside the final window / all stored tokens of the case), so the
shares, the window share and the share of unlabelled tokens sum to 1 and predict the per-case
``b_total`` that evaluation reports (``measured_b`` is a mean over cases too).

Rare items (documented rule): an item whose share is below ``min_share`` (default 1 % of the
split's stored tokens) is too rare to measure on its own. The rare items of one stage (prompt
``P`` or decode ``D``) are merged into one pseudo-item ``P|rare`` / ``D|rare`` when their shares
sum to at least ``min_share``; the pseudo-item is calibrated like any other and its action is
written into the table for every member. When even the merged share is below ``min_share`` the
rare items are skipped: they are not measured and get the table's default action (H). Tokens
without a label or tag (a task without a labeller) are likewise unmeasured.

A bucket is an item in one layer group; its budget weight is ``share x (layers in the group /
all layers)``, with the cache's contiguous split (:func:`pask.kv.cache.layer_groups`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

from pask.kv.cache import layer_groups

RARE = "rare"
POOLED = "all"  # probe suffix: an item in every layer group at once (pooled calibration)


@dataclass
class ControlRow:
    """What calibration needs of one case of the all-H control run."""

    id: str
    prompt_len: int
    n_generated: int
    stop_reason: str
    tags: list[str] | None
    prompt_labels: list[str] | None
    token_ids: list[int] | None = None
    correct: bool = False

    @property
    def n_fed(self) -> int:
        """Generated tokens stored in the cache (the last one is not fed unless the run ended on EOS)."""
        if self.stop_reason == "eos":
            return self.n_generated
        return max(0, self.n_generated - 1)

    @property
    def stored(self) -> int:
        return self.prompt_len + self.n_fed

    @classmethod
    def from_json(cls, row: dict) -> ControlRow:
        return cls(
            id=row["id"],
            prompt_len=row["prompt_len"],
            n_generated=row["n_generated"],
            stop_reason=row["stop_reason"],
            tags=row.get("tags"),
            prompt_labels=row.get("prompt_labels"),
            token_ids=row.get("token_ids"),
            correct=bool(row.get("correct")),
        )


@dataclass
class Item:
    """A calibration unit before layer groups: one tag / label, or a stage's merged rare items."""

    name: str  # "D|<tag>", "P|<label>", "D|rare", "P|rare"
    stage: str  # "P" | "D"
    members: list[str]  # tag / label strings
    share: float


@dataclass
class BucketPlan:
    """Measured items, their budget weights and what is left unmeasured."""

    items: list[Item]
    group_weights: list[float]
    recent_window: int
    window_share: float  # tokens H at the end of a case because they sit in the recent window
    unmeasured_share: float  # skipped rare items, unselected items and tokens without tags
    skipped: list[dict] = field(default_factory=list)  # {"name", "share", "why"}
    cases: int = 0
    mean_stored: float = 0.0
    selected: list[str] | None = None  # bucket names, when calibration was restricted to them

    @property
    def num_groups(self) -> int:
        return len(self.group_weights)

    def buckets(self) -> list[tuple[str, Item, int, float]]:
        """(bucket name, item, group, weight) of every measured bucket."""
        out = []
        for it in self.items:
            for g, gw in enumerate(self.group_weights):
                name = f"{it.name}|g{g}"
                if self.selected is None or name in self.selected:
                    out.append((name, it, g, it.share * gw))
        return out

    def members(self, bucket: str) -> list[str]:
        """Table keys (``str(Bucket)``) a measured bucket stands for; ``<item>|all``: every group's."""
        head, _, g = bucket.rpartition("|")
        groups = [f"g{i}" for i in range(self.num_groups)] if g == POOLED else [g]
        for it in self.items:
            if it.name == head:
                return [f"{it.stage}|{m}|{gg}" for gg in groups for m in it.members]
        raise KeyError(f"unknown bucket {bucket}")

    def pooled(self) -> list[str]:
        """``<item>|all`` probe names: one per measured item, all layer groups at once."""
        names = {n.rpartition("|")[0] for n, *_ in self.buckets()}
        return [f"{it.name}|{POOLED}" for it in self.items if it.name in names]

    def measured_share(self) -> float:
        return sum(w for *_, w in self.buckets())

    def base_share(self) -> float:
        """Weight outside the measured buckets: window + unmeasured (+ unselected buckets)."""
        return max(0.0, 1.0 - self.measured_share() - self.window_share)

    def to_json(self) -> dict:
        d = asdict(self)
        d["buckets"] = [{"bucket": n, "stage": it.stage, "weight": w} for n, it, _, w in self.buckets()]
        return d


def item_of(row: ControlRow, pos: int) -> str | None:
    """``"P|<label>"`` / ``"D|<tag>"`` of a stored position (None when the run had no label / tag)."""
    if pos < row.prompt_len:
        labels = row.prompt_labels
        return f"P|{labels[pos]}" if labels is not None and pos < len(labels) else None
    i = pos - row.prompt_len
    return f"D|{row.tags[i]}" if row.tags is not None and i < len(row.tags) else None


def plan_buckets(
    rows: list[ControlRow],
    num_layers: int,
    num_groups: int = 4,
    recent_window: int = 8,
    min_share: float = 0.01,
    select: list[str] | None = None,
) -> BucketPlan:
    """Count stored tokens per item over the control rows and apply the rare-item rule."""
    rows = [r for r in rows if r.stored > 0]
    n = len(rows)
    share: dict[str, float] = defaultdict(float)
    window = untagged = 0.0
    for r in rows:
        stored = r.stored
        limit = max(0, stored - recent_window)
        window += (stored - limit) / stored
        counts = Counter(item_of(r, pos) for pos in range(limit))
        untagged += counts.pop(None, 0) / stored
        for it, c in counts.items():
            share[it] += c / stored
    share = {k: v / n for k, v in share.items()} if n else {}
    window, untagged = (window / n, untagged / n) if n else (0.0, 0.0)
    items, skipped = [], []
    for stage in ("P", "D"):
        mine = sorted((k for k in share if k.startswith(stage + "|")), key=lambda k: (-share[k], k))
        rare = [k for k in mine if share[k] < min_share]
        items += [Item(k, stage, [k[2:]], share[k]) for k in mine if k not in rare]
        rare_share = sum(share[k] for k in rare)
        if rare and rare_share >= min_share:
            items.append(Item(f"{stage}|{RARE}", stage, [k[2:] for k in rare], rare_share))
        elif rare:
            skipped += [{"name": k, "share": share[k], "why": "rare, merged share below min_share"} for k in rare]
    if untagged:
        skipped.append({"name": "(no label / tag)", "share": untagged, "why": "untagged tokens"})
    sizes = [len(r) for r in layer_groups(num_layers, num_groups)]
    plan = BucketPlan(
        items=items,
        group_weights=[s / num_layers for s in sizes],
        recent_window=recent_window,
        window_share=window,
        unmeasured_share=untagged + sum(s["share"] for s in skipped if s["name"] != "(no label / tag)"),
        skipped=skipped,
        cases=n,
        mean_stored=sum(r.stored for r in rows) / n if n else 0.0,
        selected=list(select) if select is not None else None,
    )
    if select is not None:
        known = {name for name, *_ in BucketPlan(items, plan.group_weights, recent_window, 0, 0).buckets()}
        unknown = sorted(set(select) - known)
        if unknown:
            from pask.errors import PaskError

            raise PaskError(f"unknown buckets {unknown}; measured buckets are: {sorted(known)}")
    return plan
