"""The evaluation runner of every task: batched, resumable, per-case JSONL + summary.

:func:`run_task` evaluates a :class:`~pask.tasks.base.Task`'s cases under a KV policy:
``out_dir/cases.jsonl`` gets one row per case as it finishes (a later call with the same
directory skips the ids already there; a torn last line is dropped first), then ``summary.json``
(the task's summary, the measured budgets and this run's record) and ``summary.md`` (the task's
table) are written from the rows of the cases asked for. Decoding goes through
:func:`pask.runtime.engine.generate` (``batching="static"``: batches of ``batch_size`` in order of
prompt length, flushed per batch) or :func:`pask.evaluation.continuous.decode_continuous`
(``"continuous"``: at most ``batch_size`` running, a freed row takes the next case, flushed per case).

Given ``settings`` (what changes a case's row: ``pask eval`` passes task, split, model, policy,
budget, policy configuration, PASK table hash, max_new_tokens, dtype and the task's options),
:func:`run_task` first checks them against ``out_dir/settings.json`` (:func:`check_settings`): rows
made with other settings are never resumed. Without ``settings`` (the sweep, calibration, tuning,
which keep their own identity checks) nothing is checked or written.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pask.errors import PaskError
from pask.evaluation.case_rows import read_done, repair_jsonl
from pask.evaluation.continuous import check_batching, decode_continuous
from pask.runtime.engine import generate
from pask.runtime.models import LoadedModel
from pask.runtime.tokens import Generation, Request, eos_ids
from pask.structure.constraint import Constraint, SchemaError, ll_tokenizer
from pask.tasks.base import Output, Task, measured_budgets


def prepare(
    task: Task, lm: LoadedModel, case: Any, max_new_tokens: int | None = None, tagging: bool = False, **options: Any
) -> tuple[Request, str | None]:
    """The engine request of a case (prompt ids, compiled grammar, parser; tagger and prompt labels
    when ``tagging``) and the reason it cannot run (None when it can).

    A grammar llguidance rejects is the case's error (``schema_error: ...``), not raised.
    """
    tok = lm.tokenizer
    tr = task.request(case, tok, tagging, **options)
    if tr.error is not None:
        return Request(tr.prompt_ids), tr.error
    constraint = None
    if tr.grammar is not None:
        try:
            eos = eos_ids(tok)
            if tr.constrain is not None:
                constraint = tr.constrain(ll_tokenizer(tok, eos), tr.grammar, eos)
            else:
                constraint = Constraint(ll_tokenizer(tok, eos), tr.grammar)
        except SchemaError as e:
            return Request(tr.prompt_ids), f"schema_error: {e}"
    m = task.default_max_new_tokens if max_new_tokens is None else max_new_tokens
    return Request(tr.prompt_ids, constraint, m, parse=tr.parse, tagger=tr.tagger, prompt_labels=tr.prompt_labels), None


def case_row(
    task: Task, case: Any, gen: Generation, req: Request | None = None, save_tags: bool = False, **options: Any
) -> dict:
    """A finished case's row: the task's fields and check, then the generation's record."""
    out = Output(gen.text, gen.stop_reason, gen.parsed, gen.parse_error)
    return {
        **task.case_fields(case),
        "prompt_len": gen.prompt_len,
        "output": gen.text,
        **task.check(case, out, **options),
        "stop_reason": gen.stop_reason,
        "n_generated": len(gen.token_ids),
        "prefill_ms": round(gen.prefill_ms, 2),
        "tpot_ms": round(gen.tpot_ms, 2),
        "budget": gen.extra.get("budget"),
        "tags": [str(t) for t in gen.extra.get("tags", [])] if save_tags else None,
        "prompt_labels": [str(x) for x in req.prompt_labels or []] if save_tags and req else None,
    }


def error_row(task: Task, case: Any, req: Request, error: str, **options: Any) -> dict:
    """The row of a case that could not run (scored wrong, stop reason ``schema_error``)."""
    out = Output("", "schema_error", error=error)
    return {
        **task.case_fields(case),
        "prompt_len": len(req.prompt_ids),
        "output": "",
        **task.check(case, out, **options),
        "stop_reason": "schema_error",
        "n_generated": 0,
        "prefill_ms": 0,
        "tpot_ms": 0,
        "budget": None,
        "tags": None,
        "prompt_labels": None,
    }


def summarize(task: Task, rows: list[dict]) -> dict:
    """The task's summary of ``rows`` followed by the measured budgets."""
    return {**task.summarize(rows), **measured_budgets(rows)}


SETTINGS_FILE = "settings.json"
RESULT_FILES = ("cases.jsonl", "summary.json", "summary.md")  # what --force discards


def _normalised(settings: dict) -> dict:
    """``settings`` as JSON would read them back (tuples as lists, paths as strings)."""
    return json.loads(json.dumps(settings, default=str))


def settings_differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """``"key: folder X, now Y"`` for each setting that differs (nested dicts key by key)."""
    out = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key, "(absent)"), new.get(key, "(absent)")
        if isinstance(a, dict) and isinstance(b, dict):
            out += settings_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: folder {json.dumps(a)}, now {json.dumps(b)}")
    return out


def check_settings(out_dir: Path, settings: dict, force: bool = False) -> None:
    """Make sure the rows in ``out_dir`` were made with ``settings`` before a run resumes there.

    ``out_dir/settings.json`` records the settings of the rows in the folder; it is written before
    the first row. Same settings: nothing to do (the run resumes). No rows yet: the settings are
    (re)written. Rows made with other settings, or rows without a settings record (a folder from
    before pask recorded them): :class:`PaskError` naming the differing settings, unless ``force``,
    which discards the folder's results (``cases.jsonl``, ``summary.json``, ``summary.md``; other
    files stay) so that the run starts over. Calling it again with the same settings is a no-op.
    """
    out_dir = Path(out_dir)
    settings = _normalised(settings)
    path = out_dir / SETTINGS_FILE
    old = None
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            old = None
        if not isinstance(old, dict):
            old = {SETTINGS_FILE: "unreadable"}
        if old == settings:
            return
    if read_done(out_dir / "cases.jsonl") and not force:
        fix = "pass --force to discard its results and start over, or choose another --out"
        if old is None:
            raise PaskError(f"{out_dir} holds results without a record of their settings ({SETTINGS_FILE}); {fix}")
        diffs = "\n  ".join(settings_differences(old, settings))
        raise PaskError(f"{out_dir} holds results made with other settings; {fix}:\n  {diffs}")
    for name in RESULT_FILES:
        (out_dir / name).unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{SETTINGS_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def run_task(
    task: Task,
    lm: LoadedModel | None,
    cases: list,
    out_dir: Path,
    batch_size: int = 8,
    max_new_tokens: int | None = None,
    policy=None,
    progress: Callable[[int], None] | None = None,
    meta: dict | None = None,
    save_tags: bool = False,
    batching: str = "static",
    settings: dict | None = None,
    force: bool = False,
    selector=None,
    **options: Any,
) -> dict:
    """Evaluate ``cases`` of ``task`` into ``out_dir`` (resuming there) and write the summary; return it.

    ``max_new_tokens``: default the task's; ``policy``: a fresh KV policy (None: Full KV);
    ``progress(n)``: called with the cases already done, then as cases finish; ``meta``: the run
    record's fields (model, policy, command, ...); ``save_tags``: store per-token tags and prompt
    labels in the rows; ``batching``: ``"static"`` or ``"continuous"``; ``settings``: what the rows
    depend on, checked against and recorded in ``out_dir/settings.json`` (:func:`check_settings`,
    ``force``: discard rows made with other settings; None: no check); ``options``: the task's
    options (defaults filled in). Given only finished cases, ``lm`` is not touched (may be None).
    ``selector``: a :class:`~pask.meta.selector.MetaSelector` choosing each case's configuration
    (MetaKV; continuous batching, ``policy`` None): the cases are grouped by their choice and each
    group decodes on its own cache; every row records the choice and the predictions (``meta``).
    """
    if batch_size < 1:
        raise PaskError("--batch-size must be >= 1")
    if max_new_tokens is None:
        max_new_tokens = task.default_max_new_tokens
    if max_new_tokens < 1:
        raise PaskError("--max-new-tokens must be >= 1")
    check_batching(batching)
    options = task.resolve_options(options)
    if selector is not None and (policy is not None or batching != "continuous"):
        raise PaskError("--policy meta chooses each case's policy and needs --batching continuous")
    tagging = save_tags or selector is not None or (policy is not None and policy.needs_tags)
    out_dir = Path(out_dir)
    if settings is not None:
        check_settings(out_dir, settings, force)
    out_dir.mkdir(parents=True, exist_ok=True)
    jsonl = out_dir / "cases.jsonl"
    repair_jsonl(jsonl)
    done = read_done(jsonl)
    todo = [c for c in cases if c.id not in done]
    if progress:
        progress(len(cases) - len(todo))
    prepared = [(c, *prepare(task, lm, c, max_new_tokens, tagging, **options)) for c in todo]
    prepared.sort(key=lambda x: len(x[1].prompt_ids))  # less padding per batch
    t0 = time.perf_counter()
    with open(jsonl, "a") as f:
        for c, req, err in [p for p in prepared if p[2] is not None]:
            f.write(json.dumps(error_row(task, c, req, err, **options)) + "\n")
            if progress:
                progress(1)
        runnable = [p for p in prepared if p[2] is None]

        choices: dict[int, Any] = {}  # MetaKV: runnable index -> its Choice

        def write(c, g: Generation, r: Request, i: int | None = None) -> None:
            row = case_row(task, c, g, r, save_tags, **options)
            if i in choices:
                row["meta"] = choices[i].to_json()
            f.write(json.dumps(row) + "\n")

        def finished(i: int, g: Generation) -> None:
            c, r, _ = runnable[i]
            write(c, g, r, i)
            f.flush()
            if progress:
                progress(1)

        if selector is not None:
            groups: dict[str, list[int]] = {}
            for i, (_, r, _) in enumerate(runnable):
                choices[i] = selector.choose(r.prompt_ids, r.prompt_labels)
                groups.setdefault(choices[i].candidate, []).append(i)
            for name in selector.allowed:  # the candidates' order: one cache (and policy) per group
                if name in groups:
                    items = ((i, runnable[i][1]) for i in groups[name])
                    decode_continuous(lm, items, batch_size, selector.policy(name), finished)
        elif batching == "continuous":
            decode_continuous(lm, ((i, r) for i, (_, r, _) in enumerate(runnable)), batch_size, policy, finished)
        else:
            for i in range(0, len(runnable), batch_size):
                chunk = runnable[i : i + batch_size]
                gens = generate(lm, [r for _, r, _ in chunk], policy=policy)
                for (c, r, _), g in zip(chunk, gens, strict=True):
                    write(c, g, r)
                f.flush()
                if progress:
                    progress(len(chunk))
    return write_summary(task, out_dir, cases, len(runnable), time.perf_counter() - t0, meta)


def write_summary(task: Task, out_dir: Path, cases: list, n_run: int, wall: float, meta: dict | None) -> dict:
    """Summarise the rows of ``cases`` in ``out_dir/cases.jsonl`` with this run's record; write summary.json/.md."""
    wanted = {c.id for c in cases}
    rows = [r for r in read_done(out_dir / "cases.jsonl").values() if r["id"] in wanted]
    summary = summarize(task, rows)
    summary["run"] = {**(meta or {}), "cases_this_run": n_run, "wall_s_this_run": round(wall, 1)}
    if n_run:
        summary["run"]["cases_per_s"] = round(n_run / wall, 3)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "summary.md").write_text(task.markdown(summary, meta))
    return summary


__all__ = [
    "RESULT_FILES",
    "SETTINGS_FILE",
    "case_row",
    "check_settings",
    "error_row",
    "prepare",
    "run_task",
    "settings_differences",
    "summarize",
    "write_summary",
]
