"""KVFetch: a temporal recall channel for any score-based eviction policy.

Content-scored eviction keeps the head of a span the model must copy verbatim and drops its
continuation ("sequential forgetting"). :class:`FetchPolicy` wraps an eviction policy (``inner``:
SnapKV, H2O, CriticalKV, PASK, ...) and adds the channel the KVFetch abstract describes
(``../shared/reference/related-systems.txt``), on pask's tiers and budget accounting:

1. **Cold tier.** Tokens the inner policy releases are demoted instead (:class:`~pask.kv.actions.ColdOp`
   ``DEMOTE``): their K/V go to the cache's cold tier as ``cold_bits`` codes (INT2 by default, the
   L2 tier's layout) that attention never reads. The cold tier's bytes count in the measured B.
2. **Read pointer.** Active copying is detected by token match: a context position ``p`` is a
   candidate when the prompt token at ``p`` equals the last generated token; a candidate whose
   successor then matches the next generated token advances by one. The pointer fires at the
   candidate with the longest run once that run reaches ``min_run`` consecutive tokens (ties: the
   latest position). When no candidate continues, the window is held for ``grace`` steps, and a
   candidate just ahead of the pointer (inside the window, any run) re-syncs it: the copy goes on
   across a separator the output writes differently from the prompt (JSON quotes and commas
   around an item that the prompt lists one per line). After that the pointer is lost.
3. **Prefetch.** While the pointer is at ``p``, the cold tokens among ``p + 1 .. p + slots`` are
   fetched into the H tier (``FETCH``: dequantised to the model dtype), at most ``slots`` per
   layer group; fetched tokens outside that window go back out (``UNFETCH``, their cold copy stays).
   As the pointer advances by one, the window slides by one.

Choices the abstract leaves open (documented in docs/kvfetch.md):

* **Iso-budget.** The target B is split: ``cold_share`` of it pays for the cold tier, so the cold
  tier holds at most ``floor(cold_share · B · n / c)`` tokens per group (``c``: the cold width's
  cost per token relative to BF16, ``SeqContext.int2_cost`` / ``int4_cost``). The inner policy runs
  at ``B · (1 - cold_share)``, or at ``(B - c) / (1 - c)`` where that is higher (then the cold tier
  can take every release within its share). While the pointer is set, the fetch slots come out of
  its own keep count: it runs ``slots / (1 - c) / n`` lower (a token it gives up may still cost
  ``c`` in the cold tier), i.e. it demotes that many more when the pointer fires. A release is
  final, so its hot set does not grow back when the pointer is lost. Measured B therefore stays at
  B (below it by the unused slots while active), and attention reads no more tokens than the inner
  policy would at B. An inner policy without a budget of its own (PASK's frozen tables) keeps its
  table: give it one fitted to the lower budget. ``iso="hot"`` is the other accounting: the inner
  policy keeps B (less the fetch slots while the pointer is set), every release goes cold, and the
  cold tier's bytes come on top of B (measured B about ``B + (1 - B) c``): an offload tier's
  accounting, under which the dormant channel leaves the hot set exactly as the inner policy has it.
* **Which evicted tokens go cold.** When the cold tier cannot take every released token, the
  released tokens nearest *after* a kept token go first (``admit="successor"``, the default: the
  continuation of a kept head is what a copy needs next); ``admit="score"`` takes the inner policy's
  next best by its own ranking instead (SnapKV's window votes; a policy without a ranking falls back
  to successor). Ties: earlier position. The rest are released. The cold tier never drops a token
  once admitted (its capacity only grows with ``n``). On a teacher-forced dev copy (RULER list,
  1024 tokens, SnapKV at B 0.2) successor admission let the model take 60.5 % of the copied tokens
  against 40.4 % for score admission and 26.4 % for SnapKV alone
  (``benchmarks/kvfetch_copy_probe.py``).
* **Detection.** Token match only (no attention statistics: the dormant channel costs a dictionary
  lookup and a few small tensor operations per step). Only prompt positions are candidates.
* **Grammar trigger** (``trigger="grammar"``): under a grammar the parser knows when the model writes
  a value (``TagClass.FREE_GENERATION``: argument values, SQL literals). Then the pointer may fire
  only while the last generated token is such a value token, and needs ``min(min_run, 2)`` matches
  instead of ``min_run``.

The wrapper keeps per-row counters (:meth:`stats`): steps, steps with the pointer set, fires,
tokens fetched, and (``count_attended``, which asks for the step attention) fetched tokens that
then drew more than a held token's mean attention.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from pask.errors import PaskError
from pask.kv.actions import Action, ColdOp
from pask.kv.budget import check_budget
from pask.policies.base import ActionSpec, Policy, PolicyBase, SeqContext
from pask.structure.tags import TagClass

R = int(Action.R)
TRIGGERS = ("match", "grammar")
#: the wrapper's own configuration keys (the rest of a configuration goes to the inner policy)
FETCH_KEYS = ("slots", "cold_share", "cold_bits", "min_run", "grace", "trigger", "admit", "iso", "count_attended")
ADMITS = ("score", "successor")
#: what the wrapper holds equal to the inner policy alone: the total bytes (hot + cold = B), or the
#: hot set (the inner policy keeps B less the fetch slots; the cold tier's bytes come on top)
ISOS = ("total", "hot")


@dataclass
class _Row:
    """One row's channel state."""

    prompt_len: int
    index: dict[int, torch.Tensor]  # prompt token id -> its positions (sorted)
    prompt: torch.Tensor  # prompt token ids
    cold: list[set[int]]  # per group: positions with a cold copy
    fetched: list[set[int]]  # per group: positions now in a fetch slot
    cands: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    runs: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    seen: int = 0  # tokens of token_ids already fed to the pointer
    pointer: int | None = None
    hold: int = 0  # steps the window is still held after the pointer stopped matching
    counts: dict[str, int] = field(
        default_factory=lambda: {"steps": 0, "active_steps": 0, "fires": 0, "fetched": 0, "demoted": 0}
    )


def prompt_index(prompt: torch.Tensor) -> dict[int, torch.Tensor]:
    """Token id -> sorted positions of that token in ``prompt``."""
    if prompt.numel() == 0:
        return {}
    order = torch.argsort(prompt, stable=True)
    ids, counts = torch.unique_consecutive(prompt[order], return_counts=True)
    return {int(t): pos for t, pos in zip(ids.tolist(), torch.split(order, counts.tolist()), strict=True)}


def advance(
    prompt: torch.Tensor, index: dict[int, torch.Tensor], cands: torch.Tensor, runs: torch.Tensor, token: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The read-pointer candidates after ``token`` was generated: the candidates whose successor is
    ``token`` move on (run + 1), every other prompt position holding ``token`` starts a run of 1."""
    nxt = cands + 1
    ok = nxt < prompt.numel()
    nxt, runs = nxt[ok], runs[ok]
    keep = prompt[nxt] == token
    nxt, runs = nxt[keep], runs[keep] + 1
    fresh = index.get(int(token))
    if fresh is None:
        return nxt, runs
    fresh = fresh[~torch.isin(fresh, nxt)]
    return torch.cat([nxt, fresh]), torch.cat([runs, torch.ones_like(fresh)])


def best_candidate(cands: torch.Tensor, runs: torch.Tensor) -> tuple[int, int] | None:
    """(position, run) of the longest run (ties: the latest position), None without candidates."""
    if cands.numel() == 0:
        return None
    top = int(runs.max())
    return int(cands[runs == top].max()), top


def successor_first(cands: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """``cands`` ordered by the distance to the nearest held position before each (nearest first;
    ties: earlier position). ``held``: bool over positions, after the inner policy's releases."""
    pos = torch.arange(held.numel())
    last = torch.where(held, pos, torch.full_like(pos, -1)).cummax(0).values
    before = last[cands]
    gap = torch.where(before >= 0, cands - before, torch.full_like(cands, held.numel() + 1))
    order = torch.argsort(gap * (held.numel() + 2) + cands)
    return cands[order]


def check_config(
    slots: int = 32,
    cold_share: float = 0.5,
    cold_bits: int = 2,
    min_run: int = 3,
    trigger: str = "match",
    grace: int = 4,
    admit: str = "successor",
    iso: str = "total",
    **_: Any,
) -> None:
    """PaskError for a bad KVFetch option (see :class:`FetchPolicy`)."""
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise PaskError(f"kvfetch: slots must be an integer >= 1, got {slots!r}")
    if isinstance(cold_share, bool) or not isinstance(cold_share, int | float) or not 0.0 <= cold_share < 1.0:
        raise PaskError(f"kvfetch: cold_share must be in [0, 1), got {cold_share!r}")
    if cold_bits not in (2, 4) or isinstance(cold_bits, bool):
        raise PaskError(f"kvfetch: cold_bits must be 2 or 4, got {cold_bits!r}")
    if isinstance(min_run, bool) or not isinstance(min_run, int) or min_run < 1:
        raise PaskError(f"kvfetch: min_run must be an integer >= 1, got {min_run!r}")
    if trigger not in TRIGGERS:
        raise PaskError(f"kvfetch: trigger must be one of {', '.join(TRIGGERS)}, got {trigger!r}")
    if isinstance(grace, bool) or not isinstance(grace, int) or grace < 0:
        raise PaskError(f"kvfetch: grace must be an integer >= 0, got {grace!r}")
    if admit not in ADMITS:
        raise PaskError(f"kvfetch: admit must be one of {', '.join(ADMITS)}, got {admit!r}")
    if iso not in ISOS:
        raise PaskError(f"kvfetch: iso must be one of {', '.join(ISOS)}, got {iso!r}")


@dataclass
class FetchPolicy(PolicyBase):
    """KVFetch around ``inner`` (see the module docstring).

    Parameters
    ----------
    inner : Policy
        The eviction policy whose releases feed the cold tier.
    budget : float, optional
        Target measured B (default: the inner policy's budget). The inner policy's own budget is
        set from it at every decision (see the module docstring, "Iso-budget").
    slots : int, default=32
        Fetch slots W per layer group: the positional successors prefetched once the pointer fires.
    cold_share : float, default=0.5
        Share of the budget's bytes the cold tier may hold, in [0, 1).
    cold_bits : {2, 4}, default=2
        Code width of the cold tier.
    min_run : int, default=3
        Consecutive matched tokens before the pointer fires.
    grace : int, default=4
        Steps the fetch window is held after the pointer stops matching; meanwhile a match just
        ahead of it (inside the window, any run) re-syncs the pointer without a new fire.
    admit : {"successor", "score"}, default="successor"
        Which released tokens the cold tier takes when it cannot take all: those nearest after a
        kept token, or the inner policy's next best by its own ranking
        (:meth:`~pask.policies.base.Policy.ranking`; a policy without one falls back to successor).
    iso : {"total", "hot"}, default="total"
        ``total``: hot and cold bytes together stay at ``budget`` (the cold tier's share comes out of
        the hot set). ``hot``: the inner policy keeps ``budget`` less the fetch slots, every release
        goes cold and the cold tier's bytes come on top, so the measured B is higher (about
        ``B + (1 - B) c``) and ``cold_share`` is not used: the accounting of an offload tier, where
        only the hot set is the budget.
    trigger : {"match", "grammar"}, default="match"
        ``grammar``: fire only inside a value the parser marks as free generation, after
        ``min(min_run, 2)`` matches (needs tags).
    count_attended : bool, default=False
        Ask for the step attention and count fetched tokens that draw attention (:meth:`stats`).
    """

    inner: Policy
    budget: float | None = None
    slots: int = 32
    cold_share: float = 0.5
    cold_bits: int = 2
    min_run: int = 3
    grace: int = 4
    trigger: str = "match"
    admit: str = "successor"
    iso: str = "total"
    count_attended: bool = False

    _rows: dict = field(default_factory=dict, init=False, repr=False)
    _done: dict = field(default_factory=dict, init=False, repr=False)  # seq -> counts of its last finished row
    totals: dict = field(default_factory=dict, init=False, repr=False)  # counts summed over finished rows

    def __post_init__(self) -> None:
        if not isinstance(self.inner, Policy):
            raise PaskError(f"kvfetch: inner must be a policy, got {type(self.inner).__name__}")
        if self.budget is None:
            self.budget = self.inner.budget
        if self.budget is not None:
            self.budget = check_budget(self.budget, "kvfetch: budget")
        check_config(
            self.slots, self.cold_share, self.cold_bits, self.min_run, self.trigger, self.grace, self.admit, self.iso
        )

    # -- what the session computes for the wrapper: the inner policy's needs, plus tags / attention
    @property
    def name(self) -> str:
        return f"fetch-{self.inner.name}"

    @property
    def needs_tags(self) -> bool:
        return self.inner.needs_tags or self.trigger == "grammar"

    @property
    def prefill_window(self) -> int:
        return self.inner.prefill_window

    @property
    def prefill_value_norm(self) -> bool:
        return self.inner.prefill_value_norm

    @property
    def step_attention(self) -> bool:
        return self.inner.step_attention or self.count_attended

    @property
    def step_scorer(self):
        return self.inner.step_scorer

    @property
    def l2_key_bits(self) -> int | None:
        return self.inner.l2_key_bits

    # -- per-row state ---------------------------------------------------------------------------
    def reset(self, seq: int) -> None:
        """Forget row ``seq`` (the channel's state and the inner policy's); its counters are kept
        (:meth:`stats`) and added to :attr:`totals`."""
        row = self._rows.pop(seq, None)
        if row is not None:
            self._done[seq] = row.counts
            for k, v in row.counts.items():
                self.totals[k] = self.totals.get(k, 0) + v
        self.inner.reset(seq)

    def report(self, seq: int) -> dict:
        """The channel's counters of row ``seq`` (:meth:`stats`), recorded with the request's budget."""
        return {"kvfetch": self.stats(seq)} if seq in self._rows or seq in self._done else {}

    def stats(self, seq: int = 0) -> dict[str, int]:
        """The channel's counters of row ``seq`` (live, else its last finished request): steps,
        active_steps (pointer set), fires, fetched (tokens brought into fetch slots), attended
        (``count_attended``) and demoted (tokens sent to the cold tier)."""
        row = self._rows.get(seq)
        return dict(row.counts) if row is not None else dict(self._done.get(seq, {}))

    # -- decisions -------------------------------------------------------------------------------
    def prefill_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        prompt = torch.as_tensor(ctx.token_ids[: ctx.prompt_len], dtype=torch.long)
        groups = ctx.num_groups
        self._rows[ctx.seq] = _Row(
            ctx.prompt_len,
            prompt_index(prompt),
            prompt,
            [set() for _ in range(groups)],
            [set() for _ in range(groups)],
            seen=ctx.prompt_len,
        )
        if self.count_attended:  # only counted on request (absent, not 0, otherwise)
            self._rows[ctx.seq].counts["attended"] = 0
        return self._decide(ctx, self.inner.prefill_actions)

    def step_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        row = self._rows[ctx.seq]
        row.counts["steps"] += 1
        if self.count_attended and ctx.step_attention is not None:
            self._count_attended(ctx, row)
        self._move_pointer(ctx, row)
        out = self._decide(ctx, self.inner.step_actions, self.slots if row.pointer is not None else 0)
        return out + self._prefetch(ctx, row)

    def _decide(self, ctx: SeqContext, decide, reserve: int = 0) -> list[ActionSpec]:
        """The inner policy's actions, seen without the fetch slots and at the hot budget less
        ``reserve`` tokens (the fetch slots about to be used), with its releases demoted to the cold
        tier as far as the cold capacity allows."""
        row = self._rows[ctx.seq]
        n = ctx.length
        cost = ctx.int2_cost if self.cold_bits == 2 else ctx.int4_cost
        budgeted = getattr(self.inner, "budget", None) is not None and not hasattr(self.inner, "table")  # not PASK
        hot_iso = self.iso == "hot"
        if self.budget is not None and budgeted:
            b = float(self.budget)
            if hot_iso:  # the inner policy keeps B; the fetch slots come out of its keep count
                hot = b - reserve / max(n, 1)
            else:
                # the cold share, unless the cold tier can take every release for less (then hot h
                # and cold (1 - h) c fill B: h = (B - c) / (1 - c))
                # the fetch slots: the ``reserve`` tokens the inner policy gives up may go cold (cost c
                # each), so it gives up reserve / (1 - c) to pay for them
                hot = max(b * (1.0 - self.cold_share), (b - cost) / (1.0 - cost)) - reserve / (1.0 - cost) / max(n, 1)
            self.inner.budget = min(1.0, max(hot, 1.0 / max(n, 1)))
        base = ctx.tier_fn

        def tiers() -> torch.Tensor:
            t = base().clone()
            for g, fetched in enumerate(row.fetched):
                if fetched:
                    t[g, torch.tensor(sorted(fetched))] = R
            return t

        inner_ctx = dataclasses.replace(ctx, tier_fn=tiers if base is not None else None)
        actions = decide(inner_ctx)
        if self.budget is None or (self.cold_share == 0.0 and not hot_iso) or base is None:
            return actions
        capacity = n if hot_iso else math.floor(self.cold_share * float(self.budget) * n / cost)
        now = tiers()
        released = {g: [] for g in range(ctx.num_groups)}
        out: list[ActionSpec] = []
        for g, pos, action in actions:
            if int(action) == R:  # (a ColdOp's values are none of the Action codes)
                released[g].append(torch.as_tensor(pos, dtype=torch.long).reshape(-1))
                now[g, released[g][-1]] = R
            else:
                out.append((g, pos, action))
        rank = self.inner.ranking(inner_ctx) if self.admit == "score" else None
        for g, parts in released.items():
            if not parts:
                continue
            cands = torch.sort(torch.cat(parts)).values
            room = max(0, capacity - len(row.cold[g]))
            if room:
                if rank is not None:  # the inner policy's next best first (ties: earlier position)
                    order = torch.argsort(rank[g, cands], descending=True, stable=True)
                    ranked = cands[order]
                else:
                    ranked = successor_first(cands, now[g, :n] != R)
                admit, rest = torch.sort(ranked[:room]).values, torch.sort(ranked[room:]).values
                out.append((g, admit, ColdOp.DEMOTE))
                row.cold[g].update(admit.tolist())
                row.counts["demoted"] += admit.numel()
            else:
                rest = cands
            if rest.numel():
                out.append((g, rest, Action.R))
        return out

    def _move_pointer(self, ctx: SeqContext, row: _Row) -> None:
        """Feed the newly generated tokens to the pointer; move, re-sync, hold or lose it."""
        for i in range(row.seen, len(ctx.token_ids)):
            row.cands, row.runs = advance(row.prompt, row.index, row.cands, row.runs, int(ctx.token_ids[i]))
        row.seen = len(ctx.token_ids)
        allowed, need = True, self.min_run
        if self.trigger == "grammar":
            allowed = bool(ctx.tags) and ctx.tags[-1].cls == TagClass.FREE_GENERATION
            need = min(self.min_run, 2)
        best = best_candidate(row.cands, row.runs)
        old = row.pointer
        ahead = row.cands[(row.cands > old) & (row.cands <= old + self.slots)] if old is not None else row.cands[:0]
        if allowed and best is not None and best[1] >= need:
            new = best[0]
        elif allowed and ahead.numel():
            new = int(ahead.min())  # re-sync: the read goes on just ahead, inside the fetched window
        elif old is not None and row.hold > 0:
            row.hold -= 1  # hold the window for a few steps (a separator the prompt writes differently)
            return
        else:
            row.pointer = None
            return
        if old is None or not old < new <= old + self.slots:
            row.counts["fires"] += 1
        row.pointer, row.hold = new, self.grace

    def _prefetch(self, ctx: SeqContext, row: _Row) -> list[ActionSpec]:
        """Slide each group's fetch slots to the cold tokens among the pointer's next ``slots``
        successors (all slots freed when the pointer is lost)."""
        if row.pointer is not None:
            row.counts["active_steps"] += 1
            window = range(row.pointer + 1, min(row.pointer + 1 + self.slots, row.prompt_len))
        else:
            window = range(0)
        out: list[ActionSpec] = []
        for g in range(ctx.num_groups):
            want = {p for p in window if p in row.cold[g]}
            drop = row.fetched[g] - want
            add = want - row.fetched[g]
            if drop:
                out.append((g, torch.tensor(sorted(drop)), ColdOp.UNFETCH))
            if add:
                out.append((g, torch.tensor(sorted(add)), ColdOp.FETCH))
                row.counts["fetched"] += len(add)
            row.fetched[g] = want
        return out

    def _count_attended(self, ctx: SeqContext, row: _Row) -> None:
        """Fetched tokens whose attention in this step beat the mean over the held tokens (per group)."""
        att = ctx.step_attention
        for g, layers in enumerate(ctx.groups or []):
            if not row.fetched[g]:
                continue
            a = att[layers.start : layers.stop].float().mean(dim=(0, 1))
            held = int((a > 0).sum())
            if held:
                pos = torch.tensor(sorted(row.fetched[g]))
                row.counts["attended"] += int((a[pos] > a.sum() / held).sum())
