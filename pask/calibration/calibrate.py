"""Offline calibration: control run -> buckets -> Runtime-V and Runtime-D per candidate -> solver -> table.

``calibrate(lm, out=Path("tables/qwen-bfcl.json"))`` writes

- ``out``: the :class:`FrozenTable` (JSON);
- ``out`` with suffix ``.report.md``: calibration cost (paper Table 15 layout), sensitivity vs
  distortion (Table 16 layout), the buckets and the solver's decisions;
- ``<out stem>.calibration/``: the resumable work directory (control run, ``buckets.json``,
  ``sensitivity.jsonl`` + one run directory per candidate, ``distortion.jsonl``).

Every step resumes: a rerun with the same arguments recomputes nothing that finished (the
solver and the report are recomputed, they take milliseconds). Candidates = every measured
bucket x the probed actions (``actions``: L, L2 and R by default, L and R for a three-action
table); with G layer groups, I items and A actions that is A G I runs of the calibration split
for V and as many teacher-forced replays for D.
"""

from __future__ import annotations

import json
import math
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from pask.calibration.buckets import POOLED, BucketPlan, plan_buckets
from pask.calibration.control import run_control
from pask.calibration.distortion import run_distortion, spaced
from pask.calibration.screening import screen_all, screen_control_correct
from pask.calibration.sensitivity import probe_policy, read_records, run_sensitivity
from pask.calibration.solver import ENVELOPES, FITS, ORDER, BucketInput, Solution, cost, envelope, floor_action, solve
from pask.calibration.tasks import default_max_new_tokens, get_task
from pask.errors import PaskError
from pask.kv.budget import CostModel, check_budget
from pask.kv.cache import CacheConfig, attention_spec
from pask.policies.pask import PaskPolicy
from pask.policies.table import FrozenTable

Progress = Callable[[str, int, int], None]  # (phase, advance, total)

#: The lossy actions a calibration probes by default: INT4, INT2 and release (four-action tables).
PROBE_ACTIONS = ("L", "L2", "R")


def check_probe_actions(actions) -> tuple[str, ...]:
    """``actions`` in harm order (``L``, ``L2``, ``R``), checked: a non-empty subset holding ``L``."""
    given = tuple(actions)
    bad = [a for a in given if a not in PROBE_ACTIONS]
    if bad or "L" not in given or len(set(given)) != len(given):
        raise PaskError(f"calibration actions must be distinct, among L, L2, R and include L; got {list(given)}")
    return tuple(a for a in PROBE_ACTIONS if a in given)


def work_dir_for(out: Path) -> Path:
    return out.parent / f"{out.stem}.calibration"


def report_path_for(out: Path) -> Path:
    return out.with_suffix(".report.md")


def _cases(task: str, split: str, categories: list[str] | None, limit: int | None) -> tuple[list, list[str]]:
    """The split's cases for ``task`` (calibration never sees the test split or BFCL's live categories)."""
    return get_task(task).load(split, categories, limit)


def calibrate(
    lm,
    task: str = "bfcl",
    split: str = "calibration",
    budget: float = 0.33,
    out: Path | str = Path("pask-table.json"),
    limit: int | None = None,
    batch_size: int = 8,
    progress: Progress | None = None,
    *,
    categories: list[str] | None = None,
    max_new_tokens: int | None = None,
    alpha_d: float = 0.05,
    alpha_p: float = 0.02,
    num_groups: int = 4,
    recent_window: int = 8,
    min_share: float = 0.01,
    buckets: list[str] | None = None,
    distortion: bool = True,
    pool_groups: bool = False,
    distortion_batches: int | None = None,
    probe_cases: int | None = None,
    distortion_scope: str = "all",
    actions: tuple[str, ...] = PROBE_ACTIONS,
    fit: str = "floors",
    envelope_kind: str = "chain",
    b_offset: float = 0.0,
    l2_key_bits: int = 2,
) -> FrozenTable:
    """Calibrate a PASK table for ``lm`` on ``task``/``split`` under total budget ``budget``; see the module doc.

    ``limit``: at most N cases per category. ``buckets``: measure only these bucket names (the
    others get the default action H; for quick checks). ``distortion=False`` skips Runtime-D (every
    D is then unknown = +inf: only upgrades straight to H have a gain, all infinite, taken in bucket
    name order while they fit).

    ``pool_groups``: the shrunk calibration for small machines. Each item is probed once in every
    layer group at the same time (``<item>|all``) instead of once per group: G times fewer runs.
    Every bucket of the item then takes the pooled V (an upper estimate: harming one group's cache
    harms the task at most as much as harming all of them) and the pooled replay's distortion in
    its own group's layers (``d_per_group``, which also carries the upstream groups' change).
    ``distortion_batches``: replay only that many control batches (evenly spaced) for D.

    ``probe_cases``: screened sensitivity (:mod:`pask.calibration.screening`): the probes run only
    that many control-correct cases, spread over the categories, each flip weighted by its share of
    the whole split's accuracy; the V resolution is then the largest single-flip weight.

    ``distortion_scope``: ``"all"`` measures D for every candidate (the report's Table 16 compares
    all of them); ``"allowed"`` only for the actions at or above each bucket's floor, the only D
    values the solver reads (re-solving at other tolerances measures what they add).

    ``actions``: the lossy actions probed, a subset of ``("L", "L2", "R")`` holding ``"L"``;
    ``("L", "R")`` gives the three-action table (BF16 / INT4 / release) of the paper.

    ``fit``: what a target below the floors does (:func:`pask.calibration.solver.solve`):
    ``"floors"`` (the paper) keeps the floors and misses the target; ``"sensitivity"`` relaxes
    floors, least accuracy per byte first, until the target fits (the report names each one). When it
    relaxes, Runtime-D covers every candidate whatever ``distortion_scope`` says: the relaxed
    actions are below the floors, and distortion orders them. ``envelope_kind``: ``"chain"``
    (release >= INT2 >= INT4 in harm, the paper's order) or ``"branch"`` (release and INT2 each >=
    INT4, unordered between themselves); see :mod:`pask.calibration.solver`.

    ``l2_key_bits``: 4 makes the L2 action K4V2 (INT4 keys, INT2 values; cost 0.25 of BF16 at
    head_dim 64), probed and costed as such; the table records it and runs on a K4V2 cache.

    ``b_offset``: the dev check's correction (B measured on the dev split minus the expected B of a
    table solved without it). The solver then aims at ``budget - b_offset``, so that the table lands
    on ``budget`` when evaluated; the table keeps ``target_b = budget`` and records the offset and
    the B it expects on the calibration split (``calibration.solver_target_b``).
    """
    check_budget(budget, "--budget")
    aim = check_b_offset(budget, b_offset)
    if l2_key_bits not in (2, 4):
        raise PaskError(f"l2_key_bits must be 2 or 4, got {l2_key_bits!r}")
    if fit not in FITS:
        raise PaskError(f"fit must be one of {', '.join(FITS)}, got {fit!r}")
    if envelope_kind not in ENVELOPES:
        raise PaskError(f"envelope must be one of {', '.join(ENVELOPES)}, got {envelope_kind!r}")
    actions = check_probe_actions(actions)
    out = Path(out)
    cases, cats = _cases(task, split, categories, limit)
    hooks = get_task(task)
    max_new_tokens = max_new_tokens or default_max_new_tokens(task)
    default_cfg = CacheConfig()
    if (num_groups, recent_window) != (default_cfg.num_groups, default_cfg.recent_window):
        raise PaskError(
            f"evaluation runs the cache with {default_cfg.num_groups} layer groups and recent window "
            f"{default_cfg.recent_window}; a table for {num_groups} / {recent_window} could not be evaluated"
        )
    work = work_dir_for(out)
    work.mkdir(parents=True, exist_ok=True)
    _check_settings(
        work,
        {
            "fingerprint": lm.fingerprint,
            "task": task,
            "split": split,
            "case_ids": [c.id for c in cases],
            "max_new_tokens": max_new_tokens,
            "num_groups": num_groups,
            "recent_window": recent_window,
            "min_share": min_share,
            **({"probe_cases": probe_cases} if probe_cases is not None else {}),
            **({"l2_key_bits": l2_key_bits} if l2_key_bits != 2 else {}),  # (older work dirs: INT2 keys)
        },
    )
    t_start = time.perf_counter()
    cache_config = CacheConfig(num_groups=num_groups, recent_window=recent_window, l2_key_bits=l2_key_bits)

    # rows only: captures are needed (and made again when missing) only for replays still to run
    control = run_control(lm, cases, work, batch_size, max_new_tokens, num_groups, recent_window, progress, hooks, ())
    plan = plan_buckets(control.rows, lm.num_layers, num_groups, recent_window, min_share, buckets)
    (work / "buckets.json").write_text(json.dumps(plan.to_json(), indent=2) + "\n")
    probes = plan.pooled() if pool_groups else [name for name, *_ in plan.buckets()]
    candidates = [(name, a) for name in probes for a in actions]

    n_pool = control.summary["overall"]["n"]
    if probe_cases is None:
        screen = screen_all([r.id for r in control.rows], n_pool)
    else:
        groups = {c.id: hooks.group(c) for c in cases}
        screen = screen_control_correct({r.id: r.correct for r in control.rows}, groups, n_pool, probe_cases)
    v_recs, v_run = run_sensitivity(
        lm, cases, control, plan, candidates, work, batch_size, max_new_tokens, progress, hooks, screen, l2_key_bits
    )
    # Resolution rule: with n calibration cases V moves in steps of 1/n, so a tolerance finer than one
    # case cannot be measured (any single flip, including bf16 noise, would exceed it). The solver
    # uses max(alpha, resolution); the table records both the nominal and the effective tolerances.
    resolution = screen.resolution
    eff_d, eff_p = max(alpha_d, resolution + 1e-9), max(alpha_p, resolution + 1e-9)

    def probe_of(name: str) -> str:
        return f"{name.rpartition('|')[0]}|{POOLED}" if pool_groups else name

    def v_of(name: str) -> dict[str, float]:
        return {a: v_recs[(probe_of(name), a)]["v"] for a in actions if (probe_of(name), a) in v_recs}

    spec = attention_spec(lm.model.config, cache_config.quant_group)
    costs = CostModel(spec.head_dim, cache_config.quant_group, lm.model.dtype, cache_config.l2_key_bits)
    l_cost, l2_cost = costs.l_ratio, costs.l2_ratio  # 0.3125 and 0.1875 in bf16 at head_dim 64
    default = "H"
    base_b = plan.window_share + plan.base_share() * cost(default, l_cost, l2_cost)
    d_candidates = candidates
    if distortion_scope not in ("all", "allowed"):
        raise PaskError(f"distortion scope must be 'all' or 'allowed', got {distortion_scope!r}")
    v_only = [BucketInput(name, it.stage, w, v=v_of(name)) for name, it, _, w in plan.buckets()]
    relaxing = (
        fit == "sensitivity"
        and not solve(v_only, aim, eff_d, eff_p, base_b, l_cost, l2_cost, envelope_kind=envelope_kind).feasible
    )
    if distortion_scope == "allowed" and not relaxing:  # only the D values the solver reads: at or above floors
        allowed = set()
        for name, it, _, _ in plan.buckets():
            floor = floor_action(envelope(v_of(name), envelope_kind), eff_p if it.stage == "P" else eff_d)
            allowed |= {(probe_of(name), a) for a in actions if ORDER.index(a) >= ORDER.index(floor)}
        d_candidates = [c for c in candidates if c in allowed]
    d_recs, d_run = {}, 0
    replayed = read_records(work / "distortion.jsonl") if distortion else {}
    if distortion and any(c not in replayed for c in d_candidates):
        need = spaced(list(range(len(control.batches))), distortion_batches)  # the batches run_distortion replays
        control = run_control(
            lm, cases, work, batch_size, max_new_tokens, num_groups, recent_window, progress, hooks, need
        )
    if distortion:
        d_recs, d_run = run_distortion(
            lm,
            control,
            plan,
            d_candidates,
            work,
            lambda b, a: probe_policy(plan, b, a, lm.fingerprint, recent_window, l2_key_bits),
            cache_config,
            progress,
            distortion_batches,
        )

    def d_of(name: str, g: int, a: str) -> float:
        rec = d_recs[(probe_of(name), a)]
        return rec["d_per_group"][g] if pool_groups else rec["d"]

    inputs = [
        BucketInput(
            name,
            it.stage,
            w,
            v=v_of(name),
            d={a: d_of(name, g, a) for a in actions if (probe_of(name), a) in d_recs},
        )
        for name, it, g, w in plan.buckets()
    ]
    sol = solve(inputs, aim, eff_d, eff_p, base_b, l_cost, l2_cost, fit, envelope_kind)
    table_actions = {key: sol.actions[name] for name, *_ in plan.buckets() for key in plan.members(name)}
    v_wall, d_wall = (sum(r["wall_s"] for r in recs.values()) for recs in (v_recs, d_recs))
    meta = {
        "split": split,
        "categories": cats,
        "limit": limit,
        "cases": len(cases),
        "cases_run": len(control.rows),
        "case_ids": [c.id for c in cases],
        "batch_size": batch_size,
        "max_new_tokens": max_new_tokens,
        "min_share": min_share,
        "pool_groups": pool_groups,
        "distortion_batches": distortion_batches,
        "distortion_scope": distortion_scope,
        "v_resolution": resolution,
        "probe_cases": probe_cases,
        "probe_case_ids": screen.case_ids if screen.screened else None,
        "probe_groups": screen.groups,
        "alpha_d_effective": eff_d,
        "alpha_p_effective": eff_p,
        # a nominal tolerance finer than one flip cannot be measured: the solver used the resolution
        "unmeasurable_tolerances": [k for k, a in (("alpha_d", alpha_d), ("alpha_p", alpha_p)) if a < resolution],
        "l_cost": l_cost,
        "l2_cost": l2_cost,
        "actions": ["H", *actions],
        "control_accuracy": control.accuracy,
        "control_wall_s": round(control.wall_s, 1),
        "sensitivity_wall_s": round(v_wall, 1),
        "distortion_wall_s": round(d_wall, 1),
        "calibration_wall_s": round(control.wall_s + v_wall + d_wall, 1),
        "this_call": {
            "wall_s": round(time.perf_counter() - t_start, 1),
            "control_batches": control.batches_run,
            "sensitivity_candidates": v_run,
            "distortion_candidates": d_run,
        },
        "buckets": [
            {
                "bucket": b.bucket,
                "stage": b.stage,
                "weight": round(b.weight, 6),
                "members": plan.members(b.bucket),
                "V": b.v,
                "D": b.d,
                "V_eff": _finite(sol.v_eff[b.bucket]),
                "floor": sol.floors[b.bucket],
                "action": sol.actions[b.bucket],
            }
            for b in inputs
        ],
        "window_share": plan.window_share,
        "unmeasured_share": plan.base_share(),
        "skipped": plan.skipped,
        "feasible": sol.feasible,
        "needs": sol.needs,
        "fit": fit,
        "envelope": envelope_kind,
        "b_offset": b_offset,
        "solver_target_b": aim,
        "fitted": sol.fitted,
        "relaxed": sol.relaxed,
        "admitted_v": sol.admitted,
        "floor_b": sol.floor_b,
        "upgrades": sol.upgrades,
    }
    table = FrozenTable(
        actions=table_actions,
        fingerprint=lm.fingerprint,
        model_name=lm.name,
        task=task,
        num_groups=num_groups,
        recent_window=recent_window,
        target_b=budget,
        expected_b=round(sol.expected_b, 6),
        alpha_d=alpha_d,
        alpha_p=alpha_p,
        default_action=default,
        calibration=meta,
        l2_key_bits=l2_key_bits,
    )
    table.save(out)
    report_path_for(out).write_text(report_markdown(table, plan, sol, control, v_recs, d_recs))
    return table


def _check_settings(work: Path, settings: dict) -> None:
    """A work directory resumes only the calibration it was started for (same model, cases and settings)."""
    path = work / "settings.json"
    if path.exists():
        old = json.loads(path.read_text())
        diff = sorted(k for k in settings.keys() | old.keys() if old.get(k) != settings.get(k))
        if diff:
            raise PaskError(
                f"{work} holds a calibration with other settings ({', '.join(diff)} differ); "
                "use another --out or delete that directory"
            )
    else:
        path.write_text(json.dumps(settings, indent=2) + "\n")


def _finite(d: dict[str, float]) -> dict[str, float | None]:
    return {k: (v if math.isfinite(v) else None) for k, v in d.items()}


# -- report ---------------------------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def mismatch_stats(v: dict[str, float], d: dict[str, float], top: float = 0.2, bottom: float = 0.5) -> dict:
    """Table 16: of the top-``top`` buckets by effective sensitivity, how many distortion also ranks
    in its top-``top`` (recall) and how many it ranks in its bottom-``bottom`` (mismatch).

    Ranks sort by value, descending, ties by bucket name. ``k = ceil(top x n)`` buckets form the top.
    """
    names = sorted(set(v) & set(d))
    n = len(names)
    if n == 0:
        return {"n": 0, "k": 0, "recall": float("nan"), "mismatch": float("nan"), "top": []}
    k = max(1, math.ceil(top * n))
    by_v = sorted(names, key=lambda x: (-v[x], x))
    by_d = sorted(names, key=lambda x: (-d[x], x))
    top_v, top_d = set(by_v[:k]), set(by_d[:k])
    bottom_d = set(by_d[n - math.floor(bottom * n) :]) if math.floor(bottom * n) else set()
    return {
        "n": n,
        "k": k,
        "recall": len(top_v & top_d) / k,
        "mismatch": len(top_v & bottom_d) / k,
        "top": by_v[:k],
    }


def report_markdown(table: FrozenTable, plan: BucketPlan, sol: Solution, control, v_recs, d_recs) -> str:
    meta = table.calibration
    v_times = [r["wall_s"] for r in v_recs.values()]
    d_times = [r["wall_s"] for r in d_recs.values()]
    n_cand = len(v_recs)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    lines = [
        f"# PASK calibration: {table.model_name} on {table.task} ({meta['split']}, {meta['cases']} cases)",
        "",
        f"Table: {sol.summary()}; L cost {meta['l_cost']:.5f}, L2 cost {meta.get('l2_cost', float('nan')):.5f}; "
        f"actions {', '.join(meta.get('actions', ['H', 'L', 'R']))}."
        + (
            f" Dev check: B offset {meta['b_offset']:+.4f} (dev-measured minus expected), so the solver aimed at "
            f"{meta['solver_target_b']:.4f} for a table that lands on {table.target_b:g}."
            if meta.get("b_offset")
            else ""
        ),
        f"Tolerances alpha_D = {table.alpha_d}, alpha_P = {table.alpha_p} (effective "
        f"{meta.get('alpha_d_effective', table.alpha_d):.4f} / {meta.get('alpha_p_effective', table.alpha_p):.4f}: "
        f"V resolution {meta.get('v_resolution', 0):.4f}: {_resolution_rule(meta)}); {table.num_groups} layer groups; "
        f"recent window {table.recent_window}; default action {table.default_action}."
        + (
            f" Not measurable at this resolution: {', '.join(meta['unmeasurable_tolerances'])} (the solver used "
            "the resolution instead)."
            if meta.get("unmeasurable_tolerances")
            else ""
        ),
        f"Wall time: {_h(meta.get('calibration_wall_s', 0.0))} in all (control, probes and replays, summed over "
        "calls).",
        f"All-H control accuracy: {100 * control.accuracy:.2f} % ({control.summary['overall']['correct']}/"
        f"{control.summary['overall']['n']}).",
        "",
        "## Calibration cost (Table 15 layout)",
        "",
        "The control is one pass serving both V (accuracy, tags) and D (attention captures).",
        "",
        "| | Runtime-V | Runtime-D |",
        "|---|---:|---:|",
        f"| All-high control | {control.wall_s:.1f} s | (shared) |",
        f"| Candidate time, median | {_s(statistics.median(v_times) if v_times else None)} | "
        f"{_s(statistics.median(d_times) if d_times else None)} |",
        f"| Candidate time, p90 | {_s(_pct(v_times, 0.9) if v_times else None)} | "
        f"{_s(_pct(d_times, 0.9) if d_times else None)} |",
        f"| Peak process memory (RSS, this call) | {peak_gib:.2f} GiB | |",
        f"| Full {n_cand}-candidate scan | {_h(sum(v_times))} | {_h(sum(d_times))} |",
    ]
    if meta.get("pool_groups"):
        n_full = (len(meta.get("actions", ["H", "L", "R"])) - 1) * len(meta["buckets"])
        est = [_h(n_full * statistics.median(t)) if t else "-" for t in (v_times, d_times)]
        lines += [
            f"| Unpooled {n_full}-candidate scan (estimated: median x candidates) | {est[0]} | {est[1]} |",
            "",
            f"Pooled calibration: each item probed in all {table.num_groups} layer groups at once "
            f"({n_cand} candidates instead of {n_full}); every bucket takes its item's pooled V and the "
            "pooled replay's distortion in its own group.",
        ]
    lines.append("")
    if meta.get("probe_groups"):
        lines += [
            "## Screened sensitivity",
            "",
            f"The probes ran {len(meta['probe_case_ids'])} of the control's right cases; each flip weighs "
            "its group's share of the split's accuracy (control-wrong cases are not probed: gains are not measured).",
            "",
            "| group | control right | probed | weight of one flip |",
            "|---|---:|---:|---:|",
        ]
        for g, row in meta["probe_groups"].items():
            lines.append(f"| {g} | {row['control_correct']} | {row['probed']} | {row['weight']:.4f} |")
        lines.append("")
    lines += ["## Sensitivity vs distortion (Table 16 layout)", ""]
    lines += ["| Action | Model-side score | Recall @20% | Mismatch 20,50 | buckets |", "|---|---|---:|---:|---:|"]
    for a, label in (("R", "Release $R$"), ("L2", "Retain-INT2 $L_2$"), ("L", "Retain-low $L$")):
        v = {b["bucket"]: sol.v_eff[b["bucket"]][a] for b in meta["buckets"] if a in b["V"]}
        d = {b["bucket"]: sol.d_eff[b["bucket"]][a] for b in meta["buckets"] if a in b["D"]}
        if not v:  # not probed (a three-action calibration has no L2 row)
            continue
        m = mismatch_stats(v, d)
        lines.append(f"| {label} | $D(q,{a})$ | {_p(m['recall'])} | {_p(m['mismatch'])} | {m['n']} |")
    lines += [
        "",
        "Recall @20%: share of the top-20 % buckets by effective sensitivity (monotone envelope) that "
        "distortion also ranks in its top 20 %; Mismatch 20,50: share of them distortion ranks in its bottom 50 %."
        + (
            " Distortion scope `allowed`: D was measured only for actions the floors allow, so these rows "
            "compare fewer buckets than a full scan."
            if meta.get("distortion_scope") == "allowed"
            else ""
        ),
        "",
        "## Buckets",
        "",
        f"Window share {plan.window_share:.4f}; unmeasured share {plan.base_share():.4f} "
        f"(default {table.default_action}); skipped: {', '.join(s['name'] for s in plan.skipped) or 'none'}.",
        "",
        "| bucket | weight | V(L) | V(L2) | V(R) | Veff(R) | D(L) | D(L2) | D(R) | floor | action |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for b in meta["buckets"]:
        name = _md(b["bucket"])
        v, d = b["V"], b["D"]
        lines.append(
            f"| `{name}` | {b['weight']:.4f} | {_f(v.get('L'))} | {_f(v.get('L2'))} | {_f(v.get('R'))} | "
            f"{_f(b['V_eff'].get('R'))} | {_f(d.get('L'))} | {_f(d.get('L2'))} | {_f(d.get('R'))} | "
            f"{b['floor']} | {b['action']} |"
        )
    lines += ["", "## Upgrades (in order)", ""]
    if sol.upgrades:
        lines += [
            "| bucket | from | to | D gain | added B | gain / cost | B after |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        for u in sol.upgrades:
            lines.append(
                f"| `{_md(u['bucket'])}` | {u['from']} | {u['to']} | {_f(u['gain'])} | {u['added_b']:.4f} | "
                f"{_f(u['ratio'])} | {u['b']:.4f} |"
            )
    else:
        lines.append("none")
    return "\n".join(lines) + "\n"


def _resolution_rule(meta: dict) -> str:
    if meta.get("probe_cases"):
        return f"the largest single-flip weight of the {len(meta['probe_case_ids'])} screened probe cases"
    return "1/n"


def _md(name: str) -> str:
    """A bucket name inside a markdown table cell (``|`` escaped)."""
    return name.replace("|", "\\|")


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} s"


def _h(x: float) -> str:
    return f"{x / 3600:.2f} h" if x >= 360 else f"{x:.1f} s"


def _p(x: float) -> str:
    return "-" if x != x else f"{100 * x:.1f}%"


def _f(x) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}"


# -- dev check and CLI entry -----------------------------------------------------------------------
def check_b_offset(budget: float, b_offset: float) -> float:
    """The solver's target ``budget - b_offset``; :class:`PaskError` unless it lies in (0, 1]."""
    aim = budget - b_offset
    if not (math.isfinite(b_offset) and 0 < aim <= 1):
        raise PaskError(f"--b-offset {b_offset:g} leaves the solver a target of {aim:g}, outside (0, 1]")
    return round(aim, 6)


def check_dev(
    lm,
    table: FrozenTable,
    out_dir: Path,
    limit: int | None = None,
    batch_size: int = 8,
    max_new_tokens: int | None = None,
    categories: list[str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Evaluate the table on the dev split; the summary gains ``expected_b`` (the table's prediction)."""
    cases, cats = _cases(table.task, "dev", categories, limit)
    meta = {"model": lm.name, "policy": "pask", "budget": table.target_b, "split": "dev", "categories": cats}
    m = max_new_tokens or default_max_new_tokens(table.task)
    summary = get_task(table.task).run(lm, cases, Path(out_dir), batch_size, m, PaskPolicy(table), progress, meta)
    summary["expected_b"] = table.expected_b
    return summary


def calibrate_command(
    model: str,
    task: str = "bfcl",
    split: str = "calibration",
    budget: float = 0.33,
    out: Path | str = Path("pask-table.json"),
    limit: int | None = None,
    batch_size: int = 8,
    dtype=None,
    progress: Progress | None = None,
    **kwargs,
) -> FrozenTable:
    """``pask calibrate --model M --task bfcl --split calibration --budget 0.33 --out FILE [--limit N]``."""
    import torch

    from pask.runtime.models import load_model

    _cases(task, split, kwargs.get("categories"), limit)  # validate before loading the model
    lm = load_model(model, dtype=dtype or torch.bfloat16)
    return calibrate(lm, task, split, budget, Path(out), limit, batch_size, progress, **kwargs)
