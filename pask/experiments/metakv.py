"""MetaKV from sweep cells: fit the predictors on dev cells, evaluate constrained success on test cells.

``pask meta fit --config DEV.toml`` reads every finished cell of a sweep config on the calibration
or dev split (one cell per candidate), computes each case's request features with the task's own
prompt and labels, and fits :mod:`pask.meta.predictor`. ``pask meta csr`` then evaluates the
selection on the test cells of the same candidates (another sweep config) over a grid of
(latency, memory) limits: constrained success rate (CSR, the share of cases answered correctly
within both limits) of MetaKV, of every static candidate, of the best static candidate per limit
chosen on dev, and of an oracle that knows each case's outcomes.

What "within the limits" means for a case that ran (docs/metakv.md): its KV bytes are the bytes it
held at its end (measured, ``held_bytes``); its latency is the candidate's fitted prefill line plus
its actual number of generated tokens times the fitted step line. The test cells ran with a prefill
store and on other machines, so their own timings are not this machine's latency; the one thing of
latency a configuration changes per case, the output length, is the case's own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pask.errors import PaskError
from pask.experiments.report import sign_test_p
from pask.experiments.sweep import Cell, load_config, read_manifest
from pask.meta.candidates import Candidate, candidate_name
from pask.meta.features import request_features
from pask.meta.predictor import MetaPredictor, Observation, actual_latency, errors, fit
from pask.meta.selection import Constraints, select
from pask.tasks import get_task

FIT_SPLITS = ("calibration", "dev")


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def candidate_of(cell: Cell) -> Candidate:
    return Candidate.of(cell.policy, cell.budget, cell.table, cell.policy_config)


def candidate_of_name(cell: Cell) -> str:
    return candidate_name(cell.policy, cell.budget)


def cell_observations(
    config: Path | str,
    tokenizer,
    feature_cache: dict | None = None,
    splits: Sequence[str] | None = None,
    only: Sequence[Candidate] | None = None,
) -> tuple[list[Candidate], list[Observation], list[tuple[Cell, Path]]]:
    """The candidates, per-case observations and (cell, its directory) of every finished cell of a sweep
    config (``only``: the cells of these candidates, which must all be there, with the same tables and
    configurations)."""
    cfg = load_config(config)
    feats = feature_cache if feature_cache is not None else {}
    cands: list[Candidate] = []
    obs: list[Observation] = []
    cells = []
    wanted = {c.name: c for c in only} if only is not None else None
    for cell in cfg.cells:
        if wanted is not None:
            if candidate_of_name(cell) not in wanted:
                continue
            if candidate_of(cell) != wanted[candidate_of_name(cell)]:
                raise PaskError(f"{config}: cell {cell.name} differs from the predictor's candidate (table or config)")
        if splits is not None and cell.split not in splits:
            raise PaskError(
                f"{config}: cell {cell.name} is on split '{cell.split}'; MetaKV fits on {list(splits)} only"
            )
        jsonl = cfg.results_dir / cell.rel_dir / "cases.jsonl"
        if not jsonl.is_file():
            raise PaskError(f"cell {cell.name} has no results ({jsonl}): run `pask sweep --config {config}` first")
        cand = candidate_of(cell)
        cases = {c.id: c for c in cell.load_cases()}
        rows = [r for r in _rows(jsonl) if r["id"] in cases]
        if len(rows) < len(cases):
            raise PaskError(f"cell {cell.name} is unfinished ({len(rows)} of {len(cases)} cases)")
        task = get_task(cell.task)
        for r in rows:
            key = (cell.task, cell.split, r["id"])
            if key not in feats:
                opts = {k: cell.options[k] for k in task.options if k in cell.options}
                req = task.request(cases[r["id"]], tokenizer, tagging=True, **opts)
                feats[key] = request_features(req.prompt_ids, req.prompt_labels)
            b = r.get("budget") or {}
            obs.append(
                Observation(
                    cand.name, feats[key], bool(r.get("correct")), int(r.get("n_generated") or 0),
                    float(r.get("prefill_ms") or 0.0), float(r.get("tpot_ms") or 0.0),
                    float(b.get("b_prompt", 1.0)), float(b.get("b_decode", 1.0)), int(b.get("held_bytes", 0)),
                    f"{cell.split}/{r['id']}", str(r.get("db_id") or ""),
                )
            )  # fmt: skip
        cands.append(cand)
        cells.append((cell, cfg.results_dir / cell.rel_dir))
    if wanted is not None and (lacking := sorted(set(wanted) - {c.name for c in cands})):
        raise PaskError(f"{config} has no cells for candidates {lacking}")
    return cands, obs, cells


# -- constrained success ----------------------------------------------------------------------------
def success(o: Observation, limits: Constraints, latency: Callable[[Observation], float]) -> bool:
    return o.correct and limits.met(latency(o), o.held_bytes / 1e6)


def _by_case(obs: Sequence[Observation]) -> dict[str, dict[str, Observation]]:
    out: dict[str, dict[str, Observation]] = {}
    for o in obs:
        out.setdefault(o.case_id, {})[o.candidate] = o
    return out


def grid_limits(pred: MetaPredictor, dev: Sequence[Observation], reference: str = "full") -> dict[str, list[float]]:
    """Latency and KV limits from loose to tight, from dev cases only: latency at the 95 / 80 / 60 /
    40 / 20th percentile of the reference candidate's; KV log-spaced from the 90th percentile of the
    reference's down to the 10th percentile of the candidate holding the fewest bytes (so the tight
    end binds the compressed candidates too, not Full KV alone)."""
    lat = actual_latency(pred)
    ref = [o for o in dev if o.candidate == reference]
    if not ref:
        raise PaskError(f"no dev cases of the reference candidate '{reference}'")
    lats = np.array([lat(o) for o in ref])
    kv_of = {n: np.array([o.held_bytes / 1e6 for o in dev if o.candidate == n]) for n in pred.names}
    smallest = min((n for n in kv_of if len(kv_of[n])), key=lambda n: float(np.mean(kv_of[n])))
    hi = float(np.quantile(kv_of[reference], 0.9))
    lo = float(np.quantile(kv_of[smallest], 0.1))
    return {
        "latency_ms": [round(float(np.quantile(lats, q)), 1) for q in (0.95, 0.8, 0.6, 0.4, 0.2)],
        "kv_mb": [round(float(x), 3) for x in np.geomspace(hi, lo, 5)],
    }


def evaluate(
    pred: MetaPredictor, dev: Sequence[Observation], test: Sequence[Observation], limits: dict[str, list[float]]
) -> dict[str, Any]:
    """CSR of every strategy over the grid, per cell of the grid and averaged (module docstring)."""
    lat = actual_latency(pred)
    names = pred.names
    dev_cases, test_cases = _by_case(dev), _by_case(test)
    for where, cases in (("dev", dev_cases), ("test", test_cases)):
        short = {c for c, row in cases.items() if set(names) - set(row)}
        if short:
            raise PaskError(f"{len(short)} {where} cases lack some candidate's result (e.g. {sorted(short)[0]})")
    choices = {}
    for cid, row in test_cases.items():
        preds = pred.predict(next(iter(row.values())).features)
        choices[cid] = preds
    grid = []
    for max_lat in limits["latency_ms"]:
        for max_kv in limits["kv_mb"]:
            lim = Constraints(max_lat, max_kv)
            static_test = {n: float(np.mean([success(r[n], lim, lat) for r in test_cases.values()])) for n in names}
            static_dev = {n: float(np.mean([success(r[n], lim, lat) for r in dev_cases.values()])) for n in names}
            best_dev = max(names, key=lambda n: (static_dev[n], -names.index(n)))
            meta_ok, best_ok, oracle_ok, picked = [], [], [], {}
            for cid, row in test_cases.items():
                choice = select(choices[cid], lim)
                picked[choice.candidate] = picked.get(choice.candidate, 0) + 1
                meta_ok.append(success(row[choice.candidate], lim, lat))
                best_ok.append(success(row[best_dev], lim, lat))
                oracle_ok.append(any(success(row[n], lim, lat) for n in names))
            only_meta = sum(a and not b for a, b in zip(meta_ok, best_ok, strict=True))
            only_best = sum(b and not a for a, b in zip(meta_ok, best_ok, strict=True))
            grid.append(
                {
                    "max_latency_ms": max_lat,
                    "max_kv_mb": max_kv,
                    "meta": round(float(np.mean(meta_ok)), 4),
                    "best_static": best_dev,
                    "best_static_csr": round(static_test[best_dev], 4),
                    "best_static_test_hindsight": max(names, key=lambda n: static_test[n]),
                    "oracle": round(float(np.mean(oracle_ok)), 4),
                    "static": {n: round(v, 4) for n, v in static_test.items()},
                    "picked": picked,
                    "discordant": [only_meta, only_best],
                    "sign_p": round(sign_test_p(only_meta, only_best), 4),
                }
            )
    gains = [g["meta"] - g["best_static_csr"] for g in grid]
    oracle_gains = [g["oracle"] - g["best_static_csr"] for g in grid]
    mean_oracle = float(np.mean(oracle_gains))
    return {
        "limits": limits,
        "grid": grid,
        "mean_gain": round(float(np.mean(gains)), 4),
        "max_gain": round(float(np.max(gains)), 4),
        "mean_oracle_gain": round(mean_oracle, 4),
        "share_of_oracle_gain": round(float(np.mean(gains)) / mean_oracle, 4) if mean_oracle > 0 else math.nan,
        "n_test_cases": len(test_cases),
        "n_dev_cases": len(dev_cases),
        "test_errors": errors(pred, test, actual_latency=lat),
    }


def markdown(task: str, pred: MetaPredictor, result: dict[str, Any]) -> str:
    """The CSR tables of one task."""
    g = result["grid"]
    lats, kvs = result["limits"]["latency_ms"], result["limits"]["kv_mb"]
    cv, te = pred.fit.get("cv", {}), result["test_errors"]
    lines = [
        f"# MetaKV on {task}: constrained success rate (CSR) over (latency, KV) limits",
        "",
        f"{result['n_test_cases']} test cases, {len(pred.names)} candidates ({', '.join(pred.names)}); predictors "
        f"fitted on {pred.fit.get('n_cases', '?')} dev cases (batch {pred.batch_size}).",
        "",
        f"- mean CSR gain of MetaKV over the best static configuration (chosen on dev per limit): "
        f"**{result['mean_gain']:+.4f}**; best point {result['max_gain']:+.4f}",
        f"- oracle's mean gain {result['mean_oracle_gain']:+.4f}; MetaKV's share of it "
        f"**{result['share_of_oracle_gain']:.1%}**",
        f"- predictors, dev {cv.get('folds', '?')}-fold held out: AUC {cv.get('auc_mean', '–')}, MAE output "
        f"{cv.get('mae_n_out', '–')} tokens, KV {cv.get('mae_kv_mb', '–')} MB, latency "
        f"{cv.get('mae_latency_ms', '–')} ms ({latency_basis(pred)})",
        f"- predictors on test: AUC {te.get('auc', '–')}, Brier {te.get('calibration', {}).get('brier', '–')}, MAE "
        f"output {te.get('mae_n_out', '–')} tokens, KV {te.get('mae_kv_mb', '–')} MB, latency "
        f"{te.get('mae_latency_ms', '–')} ms (fitted lines at the actual length: output-length error only)",
        "",
        "CSR gain of MetaKV over the best static configuration (rows: latency limit ms; columns: KV limit MB):",
        "",
        "| latency \\ KV | " + " | ".join(f"{m:g}" for m in kvs) + " |",
        "|---|" + "---:|" * len(kvs),
    ]
    for i, lat in enumerate(lats):
        cells = g[i * len(kvs) : (i + 1) * len(kvs)]
        lines.append(f"| {lat:g} | " + " | ".join(f"{c['meta'] - c['best_static_csr']:+.3f}" for c in cells) + " |")
    lines += [
        "",
        "Per limit: CSR of MetaKV, the best static (dev-chosen) and the oracle; discordant cases and sign-test p:",
        "",
        "| latency ms | KV MB | MetaKV | best static | its CSR | oracle | MetaKV only / static only | p | picked |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for c in g:
        picked = ", ".join(f"{k} {v}" for k, v in sorted(c["picked"].items(), key=lambda kv: -kv[1])[:4])
        lines.append(
            f"| {c['max_latency_ms']:g} | {c['max_kv_mb']:g} | {c['meta']:.4f} | {c['best_static']} | "
            f"{c['best_static_csr']:.4f} | {c['oracle']:.4f} | {c['discordant'][0]} / {c['discordant'][1]} | "
            f"{c['sign_p']:.3f} | {picked} |"
        )
    rel = te.get("calibration", {}).get("reliability", [])
    if rel:
        lines += ["", "P(correct) on test, reliability (mean predicted vs observed rate per bin):", "",
                  "| bin | cases | predicted | observed |", "|---|---:|---:|---:|"]  # fmt: skip
        lines += [f"| {r['bin']} | {r['n']} | {r['predicted']:.3f} | {r['observed']:.3f} |" for r in rel]
    lines += ["", "Every static configuration's CSR per limit:", ""]
    lines.append("| latency ms | KV MB | " + " | ".join(pred.names) + " |")
    lines.append("|---:|---:|" + "---:|" * len(pred.names))
    for c in g:
        vals = " | ".join(f"{c['static'][n]:.3f}" for n in pred.names)
        lines.append(f"| {c['max_latency_ms']:g} | {c['max_kv_mb']:g} | {vals} |")
    return "\n".join(lines) + "\n"


def latency_basis(pred: MetaPredictor) -> str:
    """What the latency error is measured against."""
    res = pred.fit.get("timing_residuals")
    if res is None:
        return "against the cells' measured timings"
    return (
        f"the timing profile's lines at the actual output length, i.e. the output-length part; the lines' own "
        f"residuals on the profile: prefill {res['prefill_mae_ms']} ms, step {res['step_mae_ms']} ms"
    )


def heatmap(task: str, result: dict[str, Any], path: Path) -> None:
    """A heat map of MetaKV's CSR gain over the best static configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lats, kvs = result["limits"]["latency_ms"], result["limits"]["kv_mb"]
    gain = np.array([c["meta"] - c["best_static_csr"] for c in result["grid"]]).reshape(len(lats), len(kvs))
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    lim = max(0.05, float(np.abs(gain).max()))
    im = ax.imshow(gain, cmap="RdBu", vmin=-lim, vmax=lim)
    ax.set_xticks(range(len(kvs)), [f"{m:g}" for m in kvs])
    ax.set_yticks(range(len(lats)), [f"{v:g}" for v in lats])
    ax.set_xlabel("KV limit (MB)")
    ax.set_ylabel("latency limit (ms)")
    for i in range(len(lats)):
        for j in range(len(kvs)):
            ax.text(j, i, f"{gain[i, j]:+.3f}", ha="center", va="center", fontsize=8)
    ax.set_title(f"MetaKV CSR gain over best static ({task})")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fit_from_configs(
    configs: Sequence[Path | str], lm, folds: int = 5, meta: dict | None = None, timing: dict | None = None
) -> MetaPredictor:
    """Fit MetaKV's predictors on the (calibration / dev) cells of sweep configs, one task."""
    from pask.runtime.capacity import kv_bytes_per_token

    cands: list[Candidate] = []
    obs: list[Observation] = []
    cells: list[tuple[Cell, Path]] = []
    feats: dict = {}
    for config in configs:
        c, o, ce = cell_observations(config, lm.tokenizer, feats, FIT_SPLITS)
        cands += c
        obs += o
        cells += ce
    if not cells:
        raise PaskError("no cells in the given configs")
    for what in ("task", "model", "dtype"):
        values = {getattr(c, what) for c, _ in cells}
        if len(values) > 1:
            raise PaskError(f"MetaKV fits one {what} at a time; the cells have {sorted(values)}")
    seen: dict[str, Candidate] = {}
    for c in cands:  # the same candidate on two splits: one candidate, its observations pooled
        if seen.setdefault(c.name, c) != c:
            raise PaskError(f"candidate {c.name} appears with two configurations")
    batch = {int(c.options.get("batch_size") or 0) for c, _ in cells}
    max_new = {int(c.options.get("max_new_tokens") or 0) for c, _ in cells}
    if len(batch) > 1 or len(max_new) > 1:
        raise PaskError(f"the cells ran at different batch sizes {sorted(batch)} or allowances {sorted(max_new)}")
    made = []
    for cell, cell_dir in cells:  # where and with what the cells were made
        man = read_manifest(cell_dir) or {}
        run = (man.get("runs") or [{}])[-1]
        made.append({
            "cell": cell.name,
            "commit": (man.get("code_version") or {}).get("commit"),
            "machine": (run.get("machine") or {}).get("cpu_model"),
            "threads": cell.threads,
        })  # fmt: skip
    dtype = next(lm.model.parameters()).dtype
    return fit(
        obs,
        list(seen.values()),
        model_name=lm.name,
        fingerprint=lm.fingerprint,
        task=cells[0][0].task,
        bytes_per_token=kv_bytes_per_token(lm.model.config, dtype),
        batch_size=batch.pop(),
        max_new_tokens=max_new.pop(),
        folds=folds,
        meta={**(meta or {}), "configs": [str(c) for c in configs], "cells": made,
              "timing": {k: v for k, v in (timing or {}).items() if k != "samples"} or None},
        timing=timing["samples"] if timing is not None else None,
    )  # fmt: skip


# -- the timing profile ----------------------------------------------------------------------------
def timing_prompts(cases: Sequence, lengths: Sequence[int], group: int) -> dict[str, list[int]]:
    """Indices of the ``group`` shortest cases from the 20th length percentile up ("short") and the
    ``group`` longest ("long")."""
    order = sorted(range(len(cases)), key=lambda i: lengths[i])
    start = min(int(0.2 * len(order)), max(len(order) - group, 0))
    return {"short": order[start : start + group], "long": order[-group:]}


def measure_timing(
    lm,
    config: Path | str,
    batch_sizes: Sequence[int] = (1, 16),
    steps: int = 12,
    group: int = 4,
    progress: Callable[[str], None] | None = None,
) -> list[dict]:
    """Every candidate of a sweep config timed in turn on the same dev prompts, on this machine.

    Per candidate: each of ``group`` short and ``group`` long prompts alone (batch 1): its prefill
    (computed, no store) is a ``prefill`` sample and its mean decode step a batch-1 ``step`` sample;
    then per larger batch size ``b`` and length class, ``b`` requests (the class's prompts repeated)
    admitted together and decoded ``steps`` tokens under their grammar: their mean decode step is a
    ``step`` sample at the batch's mean context. The batched runs load their prompts' prefills from a
    private prefill store (the prefill was timed at batch 1; a prompt's first load computes it), so
    their cost is the decode. ``$PASK_PREFILL_STORE`` must be unset."""
    import os
    import tempfile

    from pask.evaluation.runner import prepare
    from pask.runtime.engine import run_jobs
    from pask.runtime.prefill_store import ENV, PrefillStore
    from pask.runtime.scheduler import Job

    if os.environ.get(ENV):
        raise PaskError(f"unset ${ENV}: a timing profile must prefill every prompt")
    if steps < 2 or group < 1 or not batch_sizes or min(batch_sizes) < 1:
        raise PaskError("steps >= 2, group >= 1 and batch sizes >= 1 are needed")
    cfg = load_config(config)
    if not cfg.cells:
        raise PaskError(f"{config} has no cells")
    cell0 = cfg.cells[0]
    task = get_task(cell0.task)
    cases = cell0.load_cases()
    opts = {k: cell0.options[k] for k in task.options if k in cell0.options}
    lengths = [len(task.request(c, lm.tokenizer, **opts).prompt_ids) for c in cases]
    picks = timing_prompts(cases, lengths, group)
    samples: list[dict] = []

    def jobs_of(indices: list[int], tagging: bool) -> list:
        out = []
        for i in indices:
            req, err = prepare(task, lm, cases[i], steps, tagging, **opts)
            if err is not None:
                raise PaskError(f"timing prompt {cases[i].id} cannot run: {err}")
            out.append(Job(str(len(out)), req))
        return out

    with tempfile.TemporaryDirectory(prefix="pask-timing-") as tmp:
        store = PrefillStore(tmp, lm.model)
        for cell in cfg.cells:
            cand = candidate_of(cell)
            policy = cand.build(cell.task, lm.fingerprint)
            tagging = policy is not None and policy.needs_tags
            for kind, idx in picks.items():
                if progress:
                    progress(f"{cand.name} batch 1 {kind}")
                for i in idx:
                    (j,) = run_jobs(lm, jobs_of([i], tagging), policy, max_batch=1)
                    n = len(j.request.prompt_ids)
                    samples.append({"candidate": cand.name, "kind": "prefill", "batch": 1, "context": n,
                                    "ms": round(j.prefill_ms, 3)})  # fmt: skip
                    if j.decode_steps and 1 in batch_sizes:
                        samples.append({"candidate": cand.name, "kind": "step", "batch": 1,
                                        "context": n + j.decode_steps / 2, "ms": round(j.step_ms, 3), "group": kind})  # fmt: skip  # noqa: E501
            for b in (b for b in batch_sizes if b > 1):
                for kind, idx in picks.items():
                    if progress:
                        progress(f"{cand.name} batch {b} {kind}")
                    jobs = run_jobs(lm, jobs_of([idx[k % len(idx)] for k in range(b)], tagging), policy,
                                    max_batch=b, store=store)  # fmt: skip
                    ctx = float(np.mean([len(j.request.prompt_ids) + j.decode_steps / 2 for j in jobs]))
                    ms = [j.step_ms for j in jobs if j.decode_steps]
                    samples.append({"candidate": cand.name, "kind": "step", "batch": b, "context": ctx,
                                    "ms": round(float(np.mean(ms)), 3), "group": kind})  # fmt: skip
    return samples


def timing_markdown(data: dict) -> str:
    """Per candidate: mean prefill ms per 100 prompt tokens and mean step ms per batch size / class."""
    samples = data["samples"]
    names = list(dict.fromkeys(x["candidate"] for x in samples))
    sizes = data["batch_sizes"]
    head = ["candidate", "prefill ms / 100 tok", *(f"step ms b{b} {g}" for b in sizes for g in ("short", "long"))]
    lines = [
        "# MetaKV timing profile",
        "",
        f"Every candidate of `{data['config']}` in turn, {data['steps']} decode steps per run, {data['group']} "
        f"distinct prompts per length class; wall {data['wall_s']} s.",
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
    ]
    for n in names:
        pre = [x for x in samples if x["candidate"] == n and x["kind"] == "prefill"]
        row = [n, f"{100 * sum(x['ms'] for x in pre) / sum(x['context'] for x in pre):.1f}"]
        for b in sizes:
            for g in ("short", "long"):
                st = [x["ms"] for x in samples if x["candidate"] == n and x["kind"] == "step" and x["batch"] == b
                      and x.get("group") == g]  # fmt: skip
                row.append(f"{np.mean(st):.1f}" if st else "–")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"
