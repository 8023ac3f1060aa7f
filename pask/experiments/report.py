"""Paper-style report of a results directory: markdown tables, a CSV of every cell, PNG plots.

Cells are found as ``<model>/<task>/<split>/<policy>-b<budget>/summary.json`` (the layout of
:mod:`pask.experiments.sweep`); a ``summary.json`` elsewhere counts when its ``run`` record names the model
and policy (runs of ``pask eval``). Tables, one set per (model, task, split):

- Table 1 (BFCL) / Table 12 (SQL): accuracy per category / difficulty for each method at one
  target budget, Full KV as the reference row, measured B column;
- Table 2: overall accuracy (SQL: EX) by target budget, each with its measured B;
- Table 9: target vs measured budget per method;
- Table 17: the PASK ablation (``pask-prefill`` / ``pask-decode`` / ``pask`` cells) when present;
- a paired comparison of PASK (and of PASK (K4V2)) with every other cell at the same budget on the
  cases both ran (discordant counts and the exact sign test: a difference of a few cases is within noise);
- the frontier targets (issue 29): per budget, PASK against Full KV and the best baseline, paired,
  and the baselines it is significantly below;
- SQL: Table 2b, EX without the cases whose gold query returns no rows;
- the code version and machine of each cell, and a warning when a setting mixes them.

Plots (matplotlib, Agg): accuracy vs measured B per method with Full KV as a dashed reference
line (Figure 3; coincident points dodged sideways, a lone budget drawn as labelled points),
per-category bars at B ~ 0.33, and for a calibration table file the sensitivity vs distortion
scatter of its buckets (Figure 9). The same results give byte-identical markdown and
CSV (no timestamps, fixed order).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from pask.errors import PaskError
from pask.evaluation.case_rows import read_done
from pask.experiments.sweep import policy_id, split_policy
from pask.tasks import TASKS
from pask.tasks.bfcl_checker import CATEGORIES
from pask.tasks.spider_hardness import LEVELS

METHODS = {
    "full": "Full KV",
    "pask": "PASK",
    "pask-3a": "PASK (3 actions)",
    "pask-k4v2": "PASK (K4V2)",
    "pask-prefill": "PASK (prefill only)",
    "pask-decode": "PASK (decode only)",
    "h2o": "H2O",
    "snapkv": "SnapKV",
    "mikv": "MiKV",
    "rocketkv": "RocketKV",
    "criticalkv": "CriticalKV",
    "lazyeviction": "LazyEviction",
    "kivi-4": "KIVI-4",
    "kivi-2": "KIVI-2",
    "kivi-mix": "KIVI-4/2 mix",
    "kivi": "KIVI-4",
    "static_mix": "Static mix",
}
GROUP_ORDER = (*CATEGORIES, *LEVELS)  # BFCL categories, then Spider difficulty levels
COLORS = {
    "full": "0.35",
    "pask": "tab:red",
    "pask-3a": "salmon",
    "pask-k4v2": "magenta",
    "pask-prefill": "lightcoral",
    "pask-decode": "darkred",
    "h2o": "tab:blue",
    "snapkv": "tab:orange",
    "mikv": "tab:green",
    "rocketkv": "tab:purple",
    "criticalkv": "tab:brown",
    "lazyeviction": "tab:pink",
    "kivi-4": "tab:olive",
    "kivi-2": "goldenrod",
    "kivi-mix": "darkkhaki",
    "kivi": "tab:olive",
    "static_mix": "tab:cyan",
}
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "h", "<", ">")
ABLATION_ROWS = (("full", "Full KV"), ("pask-prefill", "Prefill only"), ("pask-decode", "Decode only"))
_CELL_DIR = re.compile(r"^(?P<policy>.+)-b(?P<budget>\d+(?:\.\d+)?)$")


@dataclass
class CellResult:
    """One evaluated cell: its coordinates and scores (accuracy in %, SQL: EX)."""

    model: str
    task: str
    split: str
    policy: str
    budget: float | None  # target; None for Full KV
    measured_b: float
    n: int
    accuracy: float | None
    groups: dict[str, float | None] = field(default_factory=dict)  # category / difficulty -> accuracy
    group_n: dict[str, int] = field(default_factory=dict)
    status: str = "done"  # done | running (unfinished sweep cell)
    n_expected: int | None = None
    path: str = ""
    b_prompt: float | None = None  # measured B of the prompt tokens / of the generated tokens
    b_decode: float | None = None
    # case id -> 1.0 / 0.0 correct, or the case's score for a task with partial credit (RULER's recall)
    outcomes: dict[str, float] = field(default_factory=dict, repr=False)
    accuracy_nonempty: float | None = None  # SQL: EX on the cases whose gold query returns rows
    version: str = ""  # the code version that made the cell (commit, "-dirty"), from its cell.json
    machine: str = ""  # the CPU it ran on (ISA of the native kernels), from its cell.json
    gold_empty: int | None = None  # SQL: how many gold queries return no rows
    channel: dict = field(default_factory=dict, repr=False)  # KVFetch counters summed over the cases

    @property
    def method(self) -> str:
        return method_name(self.policy)

    @property
    def label(self) -> str:
        return self.method + (" *" if self.status != "done" else "")


def _color(policy: str) -> str | None:
    return COLORS.get(split_policy(policy)[0])


def method_name(policy: str) -> str:
    """The display name of a policy; ``fetch-<inner>`` (KVFetch around ``inner``) reads "<Inner> +
    KVFetch", a variant ``<policy>~<variant>`` "<Policy> [<variant>]"."""
    policy, variant = split_policy(policy)
    if variant:
        return f"{method_name(policy)} [{variant}]"
    if policy.startswith("fetch-"):
        return f"{method_name(policy.removeprefix('fetch-'))} + KVFetch"
    return METHODS.get(policy, policy)


def method_key(policy: str) -> tuple:
    """Table order: METHODS' order, each ``fetch-<inner>`` right after its inner policy, a variant
    right after its policy."""
    policy, variant = split_policy(policy)
    if variant:
        return (*method_key(policy), variant)
    order = list(METHODS)
    if policy.startswith("fetch-") and (inner := policy.removeprefix("fetch-")) in METHODS:
        return (order.index(inner), "~fetch")
    return (order.index(policy), "") if policy in METHODS else (len(order), policy)


def group_key(name: str) -> tuple:
    return (GROUP_ORDER.index(name), "") if name in GROUP_ORDER else (len(GROUP_ORDER), name)


def _cell_key(c: CellResult) -> tuple:
    return (c.model, c.task, c.split, method_key(c.policy), -(c.budget or 1.0), c.path)


# -- reading ---------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PaskError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise PaskError(f"{path} does not hold a JSON object")
    return data


def _scores(summary: dict, path: Path, task: str = "") -> tuple[float | None, int, dict, dict]:
    """(score, n, score per group, n per group): the task's own score (``Task.score_key``: BFCL
    accuracy, SQL EX, RULER's recall score), per category / difficulty / sub-task."""
    overall = summary.get("overall")
    if not isinstance(overall, dict) or "n" not in overall:
        raise PaskError(f"{path}: summary without an 'overall' record")
    key = TASKS[task].score_key if task in TASKS else "accuracy"
    acc = overall.get(key, overall.get("accuracy", overall.get("ex")))
    per = summary.get("categories") or summary.get("difficulties") or summary.get("tasks") or {}
    groups = {g: v.get(key, v.get("accuracy", v.get("ex"))) for g, v in per.items() if isinstance(v, dict)}
    return acc, int(overall["n"]), groups, {g: int(v.get("n", 0)) for g, v in per.items()}


def read_cell(summary_path: Path, root: Path) -> CellResult | None:
    """The cell of one ``summary.json`` (None when it is neither in the sweep layout nor self-describing)."""
    summary = _read_json(summary_path)
    cell_dir = summary_path.parent
    rel = cell_dir.relative_to(root).parts
    m = _CELL_DIR.match(cell_dir.name)
    manifest = _read_json(cell_dir / "cell.json") if (cell_dir / "cell.json").exists() else None
    if manifest and isinstance(manifest.get("cell"), dict):
        c = manifest["cell"]
        model, task, split, policy, budget = (c.get(k) for k in ("model", "task", "split", "policy", "budget"))
        policy = policy_id(str(policy), c.get("variant"))
    elif len(rel) >= 4 and m:
        model, task, split = rel[-4], rel[-3], rel[-2]
        policy, budget = m["policy"], float(m["budget"])
    else:
        run = summary.get("run") or {}
        if not (run.get("model") and run.get("policy")):
            return None
        model, policy, budget, split = run["model"], run["policy"], run.get("budget"), run.get("split", "?")
        policy = policy_id(str(policy), run.get("variant"))
        task = run.get("task") or ("sql" if "difficulties" in summary else "bfcl")
    if policy == "full":
        budget = None
    acc, n, groups, group_n = _scores(summary, summary_path, str(task))
    status, expected, version, machine = "done", None, "", ""
    if manifest:
        status = "done" if manifest.get("status") == "done" else "running"
        expected = manifest.get("n_cases")
        version, machine = _version(manifest)
    return CellResult(
        model=str(model),
        task=str(task),
        split=str(split),
        policy=str(policy),
        budget=None if budget is None else float(budget),
        measured_b=float(summary.get("measured_b", 1.0)),
        n=n,
        accuracy=acc,
        groups=groups,
        group_n=group_n,
        status=status,
        n_expected=expected,
        path=str(cell_dir.relative_to(root)),
        b_prompt=summary.get("measured_b_prompt"),
        b_decode=summary.get("measured_b_decode"),
        outcomes=_outcomes(cell_dir / "cases.jsonl", str(task)),
        channel=_channel(cell_dir / "cases.jsonl", _counts_attended(manifest)) if policy.startswith("fetch-") else {},
        accuracy_nonempty=summary["overall"].get("ex_nonempty_gold"),
        gold_empty=summary["overall"].get("gold_empty"),
        version=version,
        machine=machine,
    )


def _version(manifest: dict) -> tuple[str, str]:
    """(code version, machine) of a cell's manifest: the commit (``-dirty`` when it was) and the
    native kernels' ISA of its last run."""
    code = manifest.get("code_version") or {}
    version = str(code.get("commit", ""))[:7] + ("-dirty" if code.get("dirty") else "")
    runs = manifest.get("runs") or [{}]
    m = runs[-1].get("machine") or {}
    machine = m.get("native_attention_isa") or m.get("torch_cpu_capability") or ""
    return version, str(machine)


def _outcomes(jsonl: Path, task: str = "") -> dict[str, float]:
    """Case id -> 1.0 if correct else 0.0, from a cell's per-case rows (empty when there are none); for
    a task scored with partial credit per case (``score_key`` "score": RULER's recall) the case's
    score, so that paired comparisons count the cases each side scores higher on."""
    rows = read_done(jsonl, key=lambda r: r.get("id") if isinstance(r, dict) else None)
    partial = task in TASKS and TASKS[task].score_key == "score"
    out = {}
    for i, r in rows.items():
        if i is None:
            continue
        if partial and isinstance(r.get("score"), int | float):
            out[str(i)] = float(r["score"])
        elif "correct" in r:
            out[str(i)] = float(bool(r["correct"]))
    return out


def _counts_attended(manifest: dict | None) -> bool:
    """Whether a sweep cell ran with ``count_attended`` (its spec's policy configuration): sweep cells
    made before the counter was optional recorded ``attended: 0`` without counting. A cell without
    a sweep manifest (``pask eval``) records the counter only when it counted."""
    if manifest is None:
        return True
    config = (manifest.get("spec") or {}).get("policy_config") or {}
    return bool(config.get("count_attended"))


def _channel(jsonl: Path, attended: bool = True) -> dict:
    """KVFetch's counters (``budget.policy.kvfetch`` of each row) summed over a cell's cases, with
    ``cases`` (rows that have them) and ``fired_cases`` (rows whose pointer fired); ``attended``
    only where the cell counted it."""
    out: dict = {}
    for row in read_done(jsonl, key=lambda r: r.get("id") if isinstance(r, dict) else None).values():
        counts = ((row.get("budget") or {}).get("policy") or {}).get("kvfetch")
        if not isinstance(counts, dict):
            continue
        out["cases"] = out.get("cases", 0) + 1
        out["fired_cases"] = out.get("fired_cases", 0) + int(counts.get("fires", 0) > 0)
        for k, v in counts.items():
            if k != "attended" or attended:
                out[k] = out.get(k, 0) + int(v)
    return out


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def table_fetch(cells: list[CellResult]) -> list[str]:
    """Each ``fetch-<inner>`` cell against its inner policy at the same budget (paired), and how its
    channel worked: cases where the pointer fired, fires, fetched and attended tokens per case,
    share of steps with the pointer set."""
    rows = []
    for c in sorted((c for c in cells if c.policy.startswith("fetch-")), key=lambda c: (c.budget or 1, c.policy)):
        inner = _at(cells, split_policy(c.policy)[0].removeprefix("fetch-"), c.budget)
        ch, n = c.channel, max(c.channel.get("cases", 0), 1)
        base = "–" if inner is None else f"{_fmt(inner.accuracy)} ({inner.measured_b:.3f})"
        delta = (
            "–"
            if inner is None or inner.accuracy is None or c.accuracy is None
            else f"{c.accuracy - inner.accuracy:+.2f}"
        )
        paired = "–" if inner is None else _pair_text(c, inner)
        active = ch.get("active_steps", 0) / max(ch.get("steps", 0), 1)
        attended = f"{ch['attended'] / n:.1f}" if "attended" in ch else "–"
        rows.append(
            f"| {c.budget:g} | {c.method} | {base} | {_fmt(c.accuracy)} ({c.measured_b:.3f}) | {delta} | {paired} "
            f"| {ch.get('fired_cases', 0)} / {ch.get('cases', 0)} | {ch.get('fires', 0) / n:.1f} "
            f"| {ch.get('fetched', 0) / n:.1f} | {attended} | {100 * active:.1f} % |"
        )
    if not rows:
        return []
    head = cells[0]
    return [
        f"### KVFetch: each eviction policy with and without the recall channel "
        f"({head.model}, {_task(head.task)}, {head.split} split)",
        "",
        "| B | method | without | with | Δ | paired (with ahead : without ahead) | cases fired | fires / case "
        "| fetched / case | attended / case | steps with the pointer set |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "Scores with measured B in brackets. Paired: cases where one side scores higher (correct against "
        "wrong; RULER: a higher recall score), exact sign test. Attended: fetched tokens that drew more than a "
        "held token's mean attention (only with `count_attended`, else –).",
    ]


def collect(results_dir: Path | str) -> list[CellResult]:
    """Every cell under ``results_dir``, in report order."""
    root = Path(results_dir)
    if not root.is_dir():
        raise PaskError(f"results directory {root} does not exist")
    cells = []
    for path in sorted(root.rglob("summary.json")):
        if "shards" in path.relative_to(root).parts:
            continue
        cell = read_cell(path, root)
        if cell is not None:
            cells.append(cell)
    if not cells:
        raise PaskError(
            f"no result cells under {root} (expected <model>/<task>/<split>/<policy>-b<budget>/summary.json, "
            "as written by `pask sweep`)"
        )
    return sorted(cells, key=_cell_key)


# -- tables ----------------------------------------------------------------------------------------
def _f(x: float | None, digits: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _head(cells: list[str], right_from: int = 1) -> list[str]:
    return [_row(cells), "|" + "|".join("---" if i < right_from else "---:" for i in range(len(cells))) + "|"]


TASK_NAMES = {"bfcl": "BFCL", "sql": "Text-to-SQL", "ruler": "RULER-style long context"}


def _metric(task: str) -> str:
    return {"sql": "EX (%)", "ruler": "score (%, RULER's string-match recall)"}.get(task, "accuracy (%)")


def _task(task: str) -> str:
    return TASK_NAMES.get(task, task)


def _groups_of(cells: list[CellResult]) -> list[str]:
    return sorted({g for c in cells for g in c.groups}, key=group_key)


def _budgets(cells: list[CellResult]) -> list[float]:
    return sorted({c.budget for c in cells if c.budget is not None}, reverse=True)


def _at(cells: list[CellResult], policy: str, budget: float | None) -> CellResult | None:
    for c in cells:
        if c.policy != policy:
            continue
        if c.budget == budget or (budget is not None and c.budget is not None and abs(c.budget - budget) < 1e-9):
            return c
    return None


def _full(cells: list[CellResult]) -> CellResult | None:
    return next((c for c in cells if c.policy == "full"), None)


def _methods(cells: list[CellResult]) -> list[str]:
    """The compared methods (not Full KV, not the PASK ablation variants) in paper order."""
    skip = {"full", "pask-prefill", "pask-decode"}
    return sorted({c.policy for c in cells if c.policy not in skip}, key=method_key)


def table_per_group(cells: list[CellResult], budget: float | None) -> list[str]:
    """Table 1 (BFCL categories) / Table 12 (SQL difficulties) at one target budget (None: Full KV only)."""
    c0 = cells[0]
    groups = _groups_of(cells)
    number, what = ("12", "EX (%) by difficulty") if c0.task == "sql" else ("1", "accuracy (%) by category")
    at = "Full KV" if budget is None else f"B = {budget:g}"
    title = f"Table {number} — {_task(c0.task)} {what}, {at} ({c0.model}, {c0.split} split)"
    head = ["Method", "B", *[g.replace("_", " ").capitalize() for g in groups], "Overall", "n"]
    lines = [f"### {title}", "", *_head(head)]
    rows = [_full(cells)] + ([_at(cells, p, budget) for p in _methods(cells)] if budget is not None else [])
    for c in [r for r in rows if r is not None]:
        accs = [_f(c.groups.get(g)) for g in groups]
        lines.append(_row([c.label, _f(c.measured_b, 3), *accs, _f(c.accuracy), str(c.n)]))
    return lines


def table_by_budget(cells: list[CellResult], nonempty: bool = False) -> list[str]:
    """Table 2: overall accuracy (SQL: EX) per method and target budget, measured B in parentheses.

    ``nonempty``: SQL EX on the cases whose gold query returns rows (an empty prediction scores
    correct on the others), from each cell's ``ex_nonempty_gold``.
    """
    c0 = cells[0]
    budgets = _budgets(cells)
    score = (lambda c: c.accuracy_nonempty) if nonempty else (lambda c: c.accuracy)
    what = f"{_metric(c0.task)} by budget"
    if nonempty:
        empty = next((c.gold_empty for c in cells if c.gold_empty is not None), None)
        what += f", without the {empty} cases whose gold returns no rows"
    title = f"Table 2{'b' if nonempty else ''} — {_task(c0.task)} {what} ({c0.model}, {c0.split} split)"
    lines = [f"### {title}", ""]
    if full := _full(cells):
        n = full.n - (full.gold_empty or 0) if nonempty else full.n
        lines += [f"Full KV: {_f(score(full))} (B = {_f(full.measured_b, 3)}, n = {n}).", ""]
    lines += _head(["Method", *[f"B = {b:g}" for b in budgets]])
    for p in _methods(cells):
        row = [method_name(p)]
        for b in budgets:
            c = _at(cells, p, b)
            mark = " *" if c is not None and c.status != "done" else ""
            row.append("–" if c is None else f"{_f(score(c))} ({_f(c.measured_b, 3)}){mark}")
        lines.append(_row(row))
    lines += ["", f"Cells: {_metric(c0.task).split(' ')[0]} (measured B)."]
    return lines


def table_budgets(cells: list[CellResult]) -> list[str]:
    """Table 9: target vs measured budget per method."""
    c0 = cells[0]
    budgets = _budgets(cells)
    lines = [f"### Table 9 — target vs measured budget B ({c0.model}, {_task(c0.task)}, {c0.split} split)", ""]
    lines += _head(["Method", *[f"target {b:g}" for b in budgets], "max abs. deviation"])
    for p in _methods(cells):
        row, devs = [method_name(p)], []
        for b in budgets:
            c = _at(cells, p, b)
            row.append("–" if c is None else _f(c.measured_b, 3))
            if c is not None:
                devs.append(abs(c.measured_b - b))
        row.append(_f(max(devs), 3) if devs else "–")
        lines.append(_row(row))
    return lines


def table_ablation(cells: list[CellResult], budget: float) -> list[str]:
    """Table 17: PASK on the prompt only / on generated tokens only / on both, at one budget."""
    c0 = cells[0]
    groups = _groups_of(cells)
    lines = [f"### Table 17 — PASK ablation at B = {budget:g} ({c0.model}, {_task(c0.task)}, {c0.split} split)", ""]
    lines += _head(["Variant", "B_P", "B_D", "B", *[g.replace("_", " ").capitalize() for g in groups], "Overall"])
    for policy, name in (*ABLATION_ROWS, ("pask", "Prefill + decode (PASK)")):
        c = _full(cells) if policy == "full" else _at(cells, policy, budget)
        if c is not None:
            accs = [_f(c.groups.get(g)) for g in groups]
            mark = " *" if c.status != "done" else ""
            bs = [_f(c.b_prompt, 3), _f(c.b_decode, 3), _f(c.measured_b, 3)]
            lines.append(_row([name + mark, *bs, *accs, _f(c.accuracy)]))
    return lines


def _p(p: float) -> str:
    """A sign test's p for a table: three decimals, ``< 0.001`` below that."""
    return "–" if math.isnan(p) else ("< 0.001" if p < 0.001 else f"{p:.3f}")


def sign_test_p(only_a: int, only_b: int) -> float:
    """Two-sided exact sign test (McNemar's exact test) on the discordant pairs of a paired comparison."""
    n, k = only_a + only_b, min(only_a, only_b)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


PAIRED_REFS = ("pask", "pask-k4v2")  # the PASK variants every other cell is compared with, case by case


def table_paired(cells: list[CellResult], budget: float, ref: str = "pask") -> list[str]:
    """PASK (``ref``) against every other cell at one budget (and Full KV) on the cases both ran, case by case."""
    base = _at(cells, ref, budget)
    if base is None or not base.outcomes:
        return []
    c0 = cells[0]
    who = METHODS.get(ref, ref)
    title = f"### Paired comparison with {who} at B = {budget:g} ({c0.model}, {_task(c0.task)}, {c0.split} split)"
    lines = [title, ""]
    lines += _head(["Method", "n", f"{who} only right", "method only right", "both right", "both wrong", "sign test p"])
    others = [_full(cells), *[_at(cells, m, budget) for m in _methods(cells) if m != ref]]
    others += [_at(cells, p, budget) for p in ("pask-prefill", "pask-decode")]
    for c in others:
        if c is None or not c.outcomes:
            continue
        ids = set(base.outcomes) & set(c.outcomes)
        a, b, p = _paired(base, c)
        both = sum(base.outcomes[i] >= 1.0 and c.outcomes[i] >= 1.0 for i in ids)
        name = f"{c.method} (B = {_f(c.measured_b, 3)})"
        lines.append(_row([name, str(len(ids)), str(a), str(b), str(both), str(len(ids) - a - b - both), _p(p)]))
    return lines


def _paired(base: CellResult, other: CellResult) -> tuple[int, int, float]:
    """(base only right, other only right, sign test p) on the cases both ran; with partial credit
    (RULER) the cases each side scores higher on."""
    ids = set(base.outcomes) & set(other.outcomes)
    a = sum(base.outcomes[i] > other.outcomes[i] for i in ids)
    b = sum(other.outcomes[i] > base.outcomes[i] for i in ids)
    return a, b, sign_test_p(a, b)


BASELINE_SKIP = {"full", "pask", "pask-3a", "pask-k4v2", "pask-prefill", "pask-decode", "fetch-pask"}


SAME_B = 0.01  # a baseline whose measured B exceeds the budget by more is not at the same budget


def table_frontier(cells: list[CellResult], ref: str) -> list[str]:
    """Issue 29's targets at each budget: PASK (``ref``) against Full KV and against the best
    baseline at that budget (the highest score among the non-PASK cells whose measured B is within
    :data:`SAME_B` of the budget, or below it), paired, and every such baseline PASK is
    significantly below (sign test p < 0.05). Baselines that cannot come down to the budget (KIVI's
    INT2 floor, 0.21) are listed apart, with their measured B."""
    full, budgets = _full(cells), [b for b in _budgets(cells) if _at(cells, ref, b) is not None]
    if not budgets:
        return []
    c0, who = cells[0], METHODS.get(ref, ref)
    lines = [f"### Frontier targets: {who} against Full KV and the best baseline ({c0.model}, {_task(c0.task)})", ""]
    head = ["B", who, "vs Full KV", "paired vs Full", "best baseline", "vs best", "paired vs best"]
    lines += _head([*head, "significantly below", "over the budget"])
    for b in budgets:
        p = _at(cells, ref, b)
        row = [f"{b:g}", f"{_f(p.accuracy)} ({_f(p.measured_b, 3)})"]
        if full is not None and full.accuracy is not None and p.accuracy is not None:
            row += [f"{p.accuracy - full.accuracy:+.2f}", _pair_text(p, full)]
        else:
            row += ["–", "–"]
        at_b = [c for c in cells if c.policy not in BASELINE_SKIP and c.accuracy is not None]
        at_b = [c for c in at_b if _at([c], c.policy, b) is c]
        others = [c for c in at_b if c.measured_b <= b + SAME_B]
        over = [c for c in at_b if c.measured_b > b + SAME_B]
        if others and p.accuracy is not None:
            best = max(others, key=lambda c: (c.accuracy, -c.measured_b))
            row += [
                f"{best.method} {_f(best.accuracy)} ({_f(best.measured_b, 3)})",
                f"{p.accuracy - best.accuracy:+.2f}",
                _pair_text(p, best),
                ", ".join(o.method for o in others if _below(p, o)) or "none",
            ]
        else:
            row += ["–", "–", "–", "–"]
        row.append(", ".join(f"{o.method} {_f(o.accuracy)} ({_f(o.measured_b, 3)})" for o in over) or "–")
        lines.append(_row(row))
    lines += [
        "",
        f"Paired: {who} only right : the other only right, exact sign test on the cases both ran. A baseline "
        f"counts at a budget when its measured B is at most {SAME_B:g} above it.",
    ]
    return lines


def _pair_text(base: CellResult, other: CellResult) -> str:
    """``base only right : other only right, p ...`` (``–`` without per-case rows on either side)."""
    if not (base.outcomes and other.outcomes):
        return "–"
    a, b, p = _paired(base, other)
    return f"{a} : {b}, p " + (_p(p) if p < 0.001 else f"= {_p(p)}")


def _below(base: CellResult, other: CellResult) -> bool:
    """Whether ``base`` is significantly below ``other`` (sign test p < 0.05, ``other`` ahead)."""
    if not (base.outcomes and other.outcomes):
        return False
    a, b, p = _paired(base, other)
    return b > a and p < 0.05


def versions_note(cells: list[CellResult]) -> list[str]:
    """Which code version and machine made each cell; says so when they differ."""
    by: dict[tuple[str, str], list[str]] = {}
    for c in cells:
        name = c.method + ("" if c.budget is None else f" {c.budget:g}")
        by.setdefault((c.version or "?", c.machine or "?"), []).append(name)
    if len(by) == 1:
        (version, machine), _ = next(iter(by.items()))
        return [f"Every cell: code version {version}, native kernels {machine}."]
    lines = ["**This setting mixes code versions or machines** (each cell's `cell.json` has its own):", ""]
    for (version, machine), names in sorted(by.items()):
        lines.append(f"- {version} ({machine}): {', '.join(names)}")
    return lines


def by_setting(cells: list[CellResult]) -> dict[tuple[str, str, str], list[CellResult]]:
    out: dict[tuple[str, str, str], list[CellResult]] = {}
    for c in cells:
        out.setdefault((c.model, c.task, c.split), []).append(c)
    return out


def markdown(cells: list[CellResult], plots: dict[str, str] | None = None) -> str:
    """The whole report as markdown (``plots``: setting title -> relative PNG path, linked below it)."""
    lines = ["# pask results", ""]
    for (model, task, split), group in by_setting(cells).items():
        lines += [f"## {model} · {_task(task)} · {split} split", ""]
        budgets = _budgets(group)
        for b in budgets:
            lines += [*table_per_group(group, b), ""]
        if not budgets:
            lines += [*table_per_group(group, None), ""]
        else:
            lines += [*table_by_budget(group), ""]
            if any(c.accuracy_nonempty is not None for c in group):
                lines += [*table_by_budget(group, nonempty=True), ""]
            lines += [*table_budgets(group), ""]
        for b in budgets:
            if any(_at(group, p, b) for p in ("pask-prefill", "pask-decode")):
                lines += [*table_ablation(group, b), ""]
        for ref in PAIRED_REFS:
            if frontier := table_frontier(group, ref):
                lines += [*frontier, ""]
        for b in budgets:
            for ref in PAIRED_REFS:
                if paired := table_paired(group, b, ref):
                    lines += [*paired, ""]
        if fetch := table_fetch(group):
            lines += [*fetch, ""]
        lines += [*versions_note(group), ""]
        for name, rel in sorted((plots or {}).items()):
            if name.startswith(f"{model}/{task}/{split}/"):
                lines += [f"![{name.rsplit('/', 1)[1][2:].replace('-', ' ')}]({rel})", ""]
        if unfinished := [c for c in group if c.status != "done"]:
            lines += ["\\* unfinished cell: " + ", ".join(f"{c.path} ({c.n}/{c.n_expected})" for c in unfinished), ""]
    return "\n".join(lines).rstrip() + "\n"


def csv_text(cells: list[CellResult]) -> str:
    """One row per cell (accuracy columns per category / difficulty: ``acc:<name>``)."""
    groups = _groups_of(cells)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(
        ["model", "task", "split", "policy", "target_budget", "measured_b", "n", "accuracy", "status", "path"]
        + [f"acc:{g}" for g in groups]
    )
    for c in cells:
        target = "1" if c.budget is None else f"{c.budget:g}"
        accs = ["" if c.groups.get(g) is None else f"{c.groups[g]:.2f}" for g in groups]
        acc = "" if c.accuracy is None else f"{c.accuracy:.2f}"
        coords = [c.model, c.task, c.split, c.policy, target]
        w.writerow([*coords, f"{c.measured_b:.4f}", c.n, acc, c.status, c.path, *accs])
    return buf.getvalue()


# -- plots -----------------------------------------------------------------------------------------
@dataclass
class Plot:
    """A written PNG and the names of the series drawn in it (legend order)."""

    path: Path
    series: list[str]


def _figure(width: float = 6.4, height: float = 4.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=120)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})


def clusters(points: list[tuple[float, float]], x_tol: float, y_tol: float) -> list[list[int]]:
    """Groups of points that would draw on top of each other (chained within ``x_tol`` and ``y_tol``).

    Each group lists point indices in input order; groups come in the order of their first point.
    """
    root = list(range(len(points)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    for i, (xi, yi) in enumerate(points):
        for j in range(i + 1, len(points)):
            xj, yj = points[j]
            if abs(xi - xj) <= x_tol and abs(yi - yj) <= y_tol:
                root[find(j)] = find(i)
    groups: dict[int, list[int]] = {}
    for i in range(len(points)):
        groups.setdefault(find(i), []).append(i)
    return list(groups.values())


def dodge(points: list[tuple[float, float]], x_tol: float, y_tol: float, step: float) -> list[float]:
    """x offsets that spread coincident points side by side: ``step`` apart, centred on the group.

    A point with no neighbour keeps offset 0; a group of k gets ``(i - (k - 1) / 2) * step`` in input order.
    """
    offsets = [0.0] * len(points)
    for group in clusters(points, x_tol, y_tol):
        for rank, i in enumerate(group):
            offsets[i] = (rank - (len(group) - 1) / 2) * step
    return offsets


def y_headroom(top_value: float) -> float:
    """The y-axis top for a plot whose highest value is ``top_value`` (%): room above the Full KV line."""
    top = top_value + max(4.0, 0.15 * top_value)
    if top_value <= 100 < top:
        top = max(top_value + 4.0, 104.0)
    return top


def plot_accuracy_vs_budget(cells: list[CellResult], path: Path) -> Plot:
    """Figure 3: overall accuracy vs measured B, one curve per method; Full KV as a dashed reference line.

    Methods with several budgets draw curves, a method with one budget draws a labelled point.
    Points that would hide each other are dodged sideways by a little B (``dodge``) and every
    method has its own marker; the y axis leaves room above the reference line.
    """
    c0 = cells[0]
    fig = _figure(7.4, 4.4)
    ax = fig.add_subplot()
    series, tops = [], [0.0]
    if (full := _full(cells)) is not None and full.accuracy is not None:
        ax.axhline(
            full.accuracy, color="0.15", linestyle=(0, (6, 3)), linewidth=1.6, zorder=1,
            label=f"Full KV ({full.accuracy:.1f})",
        )  # fmt: skip
        series.append("Full KV")
        tops.append(full.accuracy)
    curves = []
    for i, p in enumerate(_methods(cells)):
        pts = sorted((c.measured_b, c.accuracy) for c in cells if c.policy == p and c.accuracy is not None)
        if pts:
            curves.append((p, MARKERS[i % len(MARKERS)], pts))
    if not curves and not series:
        raise PaskError(f"nothing to plot for {c0.model} / {c0.task} / {c0.split}")
    flat = [(p, k, xy) for p, _, pts in curves for k, xy in enumerate(pts)]
    points = [xy for _, _, xy in flat]
    top = y_headroom(max([*tops, *(y for _, y in points)]))
    x_tol, y_tol = 0.012, 0.012 * top
    shift = dict(zip([(p, k) for p, k, _ in flat], dodge(points, x_tol, y_tol, step=0.02), strict=True))
    for p, marker, pts in curves:
        name = method_name(p)
        xs = [x + shift[(p, k)] for k, (x, _) in enumerate(pts)]
        ys = [y for _, y in pts]
        style = {"marker": marker, "markersize": 7, "markeredgewidth": 1.4, "color": _color(p), "label": name}
        if len(pts) > 1:
            ax.plot(xs, ys, linewidth=2.2 if p == "pask" else 1.3, fillstyle="none", **style)
        else:
            ax.plot(xs, ys, linestyle="none", fillstyle="none", **style)
        series.append(name)
    lone = {p for p, _, pts in curves if len(pts) == 1}
    for group in clusters(points, x_tol, y_tol):  # label the lone points beside their group, stacked
        labelled = [i for i in group if flat[i][0] in lone]
        if not labelled:
            continue
        xs = [points[i][0] + shift[flat[i][:2]] for i in group]
        y_mid = sum(points[i][1] for i in group) / len(group)
        right = max(xs) < 0.75
        for rank, i in enumerate(sorted(labelled, key=lambda i: -points[i][1])):
            p, _, (_, y) = flat[i]
            ax.annotate(
                f"{method_name(p)} {y:.1f}",
                (max(xs) if right else min(xs), y_mid),
                xytext=(10 if right else -10, 5.5 * (len(labelled) - 1) - 11 * rank),
                textcoords="offset points", ha="left" if right else "right", va="center", fontsize=7.5,
                color=_color(p) or "black", bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none"},
            )  # fmt: skip
    ax.set_xlim(0, 1.05)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured KV budget B")
    ax.set_ylabel(_metric(c0.task))
    ax.set_title(f"{c0.model} · {_task(c0.task)} · {c0.split}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    _save(fig, path)
    return Plot(path, series)


def plot_category_bars(cells: list[CellResult], path: Path, budget: float = 0.33, tol: float = 0.05) -> Plot | None:
    """Per-category accuracy at the target budget nearest ``budget`` (within ``tol``), one bar per method.

    Returns None when no method has a cell near ``budget``.
    """
    near = [b for b in _budgets(cells) if abs(b - budget) <= tol + 1e-12]
    if not near:
        return None
    b = min(near, key=lambda x: (abs(x - budget), -x))
    rows = [c for c in [_full(cells)] + [_at(cells, p, b) for p in _methods(cells)] if c is not None]
    groups = _groups_of(rows)
    if not groups:
        return None
    fig = _figure(max(6.4, 1.2 * len(groups) + 2), 4.2)
    ax = fig.add_subplot()
    width = 0.8 / len(rows)
    for i, c in enumerate(rows):
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(groups))]
        ys = [c.groups.get(g) or 0.0 for g in groups]
        ax.bar(xs, ys, width=width, label=c.method, color=_color(c.policy))
    ax.set_xticks(range(len(groups)), [g.replace("_", " ") for g in groups])
    ax.set_ylabel(_metric(rows[0].task))
    ax.set_title(f"{rows[0].model} · {_task(rows[0].task)} · {rows[0].split} · B ≈ {b:g}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)
    return Plot(path, [c.method for c in rows])


def plot_sensitivity_vs_distortion(table_path: Path | str, path: Path) -> Plot:
    """Figure 9: per calibrated bucket and action, task-error sensitivity V vs attention distortion D."""
    table_path = Path(table_path)
    if not table_path.is_file():
        raise PaskError(f"table file {table_path} does not exist")
    data = _read_json(table_path)
    buckets = (data.get("calibration") or {}).get("buckets")
    if not isinstance(buckets, list):
        raise PaskError(f"{table_path}: no calibration.buckets (a table written by `pask calibrate`)")
    fig = _figure()
    ax = fig.add_subplot()
    series = []
    for action, name, color in (
        ("L", "L (INT4)", "tab:blue"),
        ("L2", "L2 (INT2)", "tab:orange"),
        ("R", "R (release)", "tab:red"),
    ):
        pts = []
        for b in buckets:
            v, d = (b.get("V") or {}).get(action), (b.get("D") or {}).get(action)
            if isinstance(v, int | float) and isinstance(d, int | float) and math.isfinite(v) and math.isfinite(d):
                pts.append((d, v))
        if pts:
            ax.scatter([d for d, _ in pts], [v for _, v in pts], s=18, alpha=0.75, color=color, label=name)
            series.append(name)
    if not series:
        raise PaskError(f"{table_path}: no bucket has finite V and D values for L, L2 or R")
    ax.set_xlabel("attention-output distortion D (relative L2)")
    ax.set_ylabel("task-error sensitivity V (accuracy drop)")
    ax.set_title(f"calibration: {data.get('model', {}).get('name', '?')} · {data.get('task', '?')}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)
    return Plot(path, series)


# -- the report ------------------------------------------------------------------------------------
@dataclass
class Report:
    """What :func:`write_report` wrote."""

    markdown: Path
    csv: Path
    plots: list[Plot]
    cells: list[CellResult]


def _slug(*parts: str) -> str:
    return "-".join(re.sub(r"[^A-Za-z0-9.]+", "_", p) for p in parts)


def write_report(
    results_dir: Path | str,
    out: Path | str | None = None,
    tables: list[Path] | None = None,
    bars_budget: float = 0.33,
) -> Report:
    """Write ``report.md``, ``cells.csv`` and the plots to ``out`` (default ``results_dir/report``)."""
    if not 0 < bars_budget <= 1:
        raise PaskError(f"--bars-budget must be in (0, 1], got {bars_budget}")
    cells = collect(results_dir)
    out = Path(out) if out is not None else Path(results_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots: list[Plot] = []
    links: dict[str, str] = {}
    for (model, task, split), group in by_setting(cells).items():
        key = f"{model}/{task}/{split}/"
        plot = plot_accuracy_vs_budget(group, out / f"fig3-{_slug(model, task, split)}.png")
        plots.append(plot)
        links[key + "1-accuracy-vs-budget"] = plot.path.name
        if bars := plot_category_bars(group, out / f"bars-{_slug(model, task, split)}.png", bars_budget):
            plots.append(bars)
            links[key + "2-categories"] = bars.path.name
    text = markdown(cells, links)
    for i, table in enumerate(tables or []):
        plot = plot_sensitivity_vs_distortion(table, out / f"fig9-{i}-{_slug(Path(table).stem)}.png")
        plots.append(plot)
        text += f"\n## Calibration: {Path(table).name}\n\n![sensitivity vs distortion]({plot.path.name})\n"
    (out / "report.md").write_text(text)
    (out / "cells.csv").write_text(csv_text(cells))
    return Report(out / "report.md", out / "cells.csv", plots, cells)
