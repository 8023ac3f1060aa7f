"""BFCL evaluation harness: batched, resumable, per-case JSONL + summary (paper Table 1 layout)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import jsonschema

from pask.engine import Generation, Request, eos_ids, generate
from pask.errors import PaskError
from pask.evaluation.bfcl import check_calls
from pask.evaluation.case_rows import read_done, repair_jsonl
from pask.evaluation.continuous import check_batching, decode_continuous
from pask.models import LoadedModel
from pask.structure.constraint import Constraint, SchemaError, ll_tokenizer
from pask.structure.json_tagger import JsonCallTagger
from pask.structure.prompt_labels import label_prompt
from pask.tasks.function_calling import FunctionCase, build_grammar, build_prompt, parse_calls

TABLE_ORDER = ("simple", "multiple", "parallel", "parallel_multiple")
LIVE_ORDER = ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")


@dataclass
class CaseResult:
    id: str
    category: str
    prompt_len: int
    output: str
    calls: list | None
    correct: bool
    valid: bool  # output parsed and satisfies the offered schemas
    error: str | None
    stop_reason: str
    n_generated: int
    prefill_ms: float
    tpot_ms: float
    budget: dict | None = None
    tags: list[str] | None = None  # per generated token (--save-tags)
    prompt_labels: list[str] | None = None  # per prompt token (--save-tags)


def schema_valid(case: FunctionCase, text: str) -> str | None:
    """Independent check (jsonschema) that every call names an offered tool and fits its schema."""
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in case.tools}
    calls = parse_calls(text)  # legal names
    if not calls:
        return "no tool call"
    for call in calls:
        ((name, args),) = call.items()
        if name not in tools:
            return f"unknown function {name}"
        try:
            jsonschema.validate(args, tools[name])
        except jsonschema.ValidationError as e:
            return f"schema violation in {name}: {e.message}"
    return None


def prepare(
    lm: LoadedModel, case: FunctionCase, max_new_tokens: int, tagging: bool = False
) -> tuple[Request, str | None]:
    """Prompt ids + grammar constraint (+ tagger and prompt labels) for a case.

    A schema the grammar can't take is reported as the case's error, not raised.
    """
    tok = lm.tokenizer
    prompt = build_prompt(tok, case)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    try:
        constraint = Constraint(ll_tokenizer(tok, eos_ids(tok)), build_grammar(case.tools, tok))
    except SchemaError as e:
        return Request(ids), f"schema_error: {e}"
    req = Request(ids, constraint, max_new_tokens, parse=lambda t: parse_calls(t, case.name_map))
    if tagging:
        req.tagger = JsonCallTagger(case.tools)
        req.prompt_labels = label_prompt(tok, prompt, case.tools)
    return req, None


def score(case: FunctionCase, gen: Generation, req: Request | None = None, save_tags: bool = False) -> CaseResult:
    calls = gen.parsed if gen.parse_error is None else None
    error = gen.parse_error
    valid_err = None if gen.stop_reason != "length" else "output truncated at max_new_tokens"
    if valid_err is None and error is None:
        valid_err = schema_valid(case, gen.text)
    correct = False
    if calls is not None and valid_err is None:
        res = check_calls(case.functions, calls, case.possible_answer or [], case.category)
        correct, error = res.correct, res.error
    return CaseResult(
        id=case.id,
        category=case.category,
        prompt_len=gen.prompt_len,
        output=gen.text,
        calls=calls,
        correct=correct,
        valid=valid_err is None and gen.parse_error is None,
        error=error or valid_err,
        stop_reason=gen.stop_reason,
        n_generated=len(gen.token_ids),
        prefill_ms=round(gen.prefill_ms, 2),
        tpot_ms=round(gen.tpot_ms, 2),
        budget=gen.extra.get("budget"),
        tags=[str(t) for t in gen.extra.get("tags", [])] if save_tags else None,
        prompt_labels=[str(x) for x in req.prompt_labels or []] if save_tags and req else None,
    )


def run_resumable(
    lm: LoadedModel,
    cases: list,
    out_dir: Path,
    batch_size: int,
    prepare_fn: Callable,
    error_row: Callable,
    score_fn: Callable,
    policy=None,
    progress: Callable[[int], None] | None = None,
    batching: str = "static",
) -> tuple[int, float]:
    """The resumable batched loop shared by the task runners; returns (cases run, wall seconds).

    Cases already in ``out_dir/cases.jsonl`` are skipped (a torn last line is dropped first);
    ``prepare_fn(case) -> (Request, error or None)``; a case with an error is written as
    ``error_row(case, request, error)`` without running; the others are decoded in order of prompt
    length and written as ``score_fn(case, generation, request)`` (dataclass rows), one line per
    case. ``batching="static"``: batches of ``batch_size`` (:func:`pask.engine.generate`), flushed
    per batch; ``"continuous"``: at most ``batch_size`` running, a finished row taken by the next
    case (:mod:`pask.evaluation.continuous`), flushed per case.
    """
    check_batching(batching)
    out_dir.mkdir(parents=True, exist_ok=True)
    jsonl = out_dir / "cases.jsonl"
    repair_jsonl(jsonl)
    done = read_done(jsonl)
    todo = [c for c in cases if c.id not in done]
    if progress:
        progress(len(cases) - len(todo))
    prepared = [(c, *prepare_fn(c)) for c in todo]
    prepared.sort(key=lambda x: len(x[1].prompt_ids))  # less padding per batch
    t0 = time.perf_counter()
    n_run = 0
    with open(jsonl, "a") as f:
        for c, req, err in [p for p in prepared if p[2] is not None]:
            f.write(json.dumps(asdict(error_row(c, req, err))) + "\n")
            if progress:
                progress(1)
        runnable = [p for p in prepared if p[2] is None]

        def write(c, g: Generation, r: Request) -> None:
            f.write(json.dumps(asdict(score_fn(c, g, r))) + "\n")

        if batching == "continuous":

            def finished(i: int, g: Generation) -> None:
                c, r, _ = runnable[i]
                write(c, g, r)
                f.flush()
                if progress:
                    progress(1)

            decode_continuous(lm, ((i, r) for i, (_, r, _) in enumerate(runnable)), batch_size, policy, finished)
            return len(runnable), time.perf_counter() - t0
        for i in range(0, len(runnable), batch_size):
            chunk = runnable[i : i + batch_size]
            gens = generate(lm, [r for _, r, _ in chunk], policy=policy)
            for (c, r, _), g in zip(chunk, gens, strict=True):
                write(c, g, r)
            f.flush()
            n_run += len(chunk)
            if progress:
                progress(len(chunk))
    return n_run, time.perf_counter() - t0


def run_bfcl(
    lm: LoadedModel,
    cases: list[FunctionCase],
    out_dir: Path,
    batch_size: int = 8,
    max_new_tokens: int = 384,
    policy=None,
    progress: Callable[[int], None] | None = None,
    meta: dict | None = None,
    save_tags: bool = False,
    batching: str = "static",
) -> dict:
    """Evaluate cases (resuming from ``out_dir/cases.jsonl``) and write the summary; return it.

    ``batching``: ``"static"`` or ``"continuous"`` (see :func:`run_resumable`).
    """
    if batch_size < 1:
        raise PaskError("--batch-size must be >= 1")
    tagging = save_tags or getattr(policy, "needs_tags", False)

    def error_row(c, req, err: str) -> CaseResult:
        return CaseResult(c.id, c.category, len(req.prompt_ids), "", None, False, False, err, "schema_error", 0, 0, 0)

    n_run, wall = run_resumable(
        lm,
        cases,
        out_dir,
        batch_size,
        lambda c: prepare(lm, c, max_new_tokens, tagging=tagging),
        error_row,
        lambda c, g, r: score(c, g, r, save_tags),
        policy,
        progress,
        batching,
    )
    return write_summary(out_dir, cases, n_run, wall, meta, summarize, table_markdown)


def write_summary(
    out_dir: Path,
    cases: list,
    n_run: int,
    wall: float,
    meta: dict | None,
    summarize: Callable[[list[dict]], dict],
    markdown: Callable[[dict, dict | None], str],
) -> dict:
    """Summarise the rows of ``cases`` in ``out_dir/cases.jsonl`` with this run's record; write summary.json/.md."""
    wanted = {c.id for c in cases}
    rows = [r for r in read_done(out_dir / "cases.jsonl").values() if r["id"] in wanted]
    summary = summarize(rows)
    summary["run"] = {**(meta or {}), "cases_this_run": n_run, "wall_s_this_run": round(wall, 1)}
    if n_run:
        summary["run"]["cases_per_s"] = round(n_run / wall, 3)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "summary.md").write_text(markdown(summary, meta))
    return summary


def summarize(rows: list[dict]) -> dict:
    """Per-category accuracy (%) + Overall (mean over cases), validity and measured budget."""
    cats: dict[str, list[dict]] = {}
    for r in rows:
        cats.setdefault(r["category"], []).append(r)
    per = {}
    for cat, rs in cats.items():
        per[cat] = {
            "n": len(rs),
            "correct": sum(r["correct"] for r in rs),
            "accuracy": round(100 * sum(r["correct"] for r in rs) / len(rs), 2),
            "valid": sum(r["valid"] for r in rs),
        }
    n = len(rows)
    return {
        "categories": per,
        "overall": {
            "n": n,
            "correct": sum(r["correct"] for r in rows),
            "accuracy": round(100 * sum(r["correct"] for r in rows) / n, 2) if n else 0.0,
            "valid": sum(r["valid"] for r in rows),
            "schema_errors": sum(r["stop_reason"] == "schema_error" for r in rows),
        },
        **measured_budgets(rows),
    }


def measured_budgets(rows: list[dict]) -> dict:
    """Mean measured B over the cases (total, prompt tokens only, generated tokens only); 1.0 for Full KV."""

    def mean(key: str) -> float:
        vals = [r["budget"][key] for r in rows if r.get("budget") and r["budget"].get(key) is not None]
        return round(sum(vals) / len(vals), 4) if vals else 1.0

    return {"measured_b": mean("b_total"), "measured_b_prompt": mean("b_prompt"), "measured_b_decode": mean("b_decode")}


def table_markdown(summary: dict, meta: dict | None = None) -> str:
    """Markdown in the layout of the paper's Table 1 (per category + Overall)."""
    meta = meta or {}
    cats = [c for c in (*TABLE_ORDER, *LIVE_ORDER) if c in summary["categories"]]
    head = ["Model", "Method", "B", *cats, "Overall"]
    cells = [
        meta.get("model", "?"),
        meta.get("policy", "?"),
        f"{summary['measured_b']:.3f}",
        *[f"{summary['categories'][c]['accuracy']:.2f}" for c in cats],
        f"{summary['overall']['accuracy']:.2f}",
    ]
    ns = ["", "", "n", *[str(summary["categories"][c]["n"]) for c in cats], str(summary["overall"]["n"])]
    lines = []
    if meta.get("command"):
        lines += [f"Command: `{meta['command']}`", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), "| " + " | ".join(cells) + " |"]
    lines += ["| " + " | ".join(ns) + " |", ""]
    o = summary["overall"]
    lines.append(f"Valid outputs: {o['valid']}/{o['n']}; schema errors: {o['schema_errors']}.")
    return "\n".join(lines) + "\n"
