"""Text-to-SQL evaluation harness: batched, resumable, per-case JSONL + summary (paper Table 12 layout).

A case's prompt is its database's schema as DDL plus the question, through the chat template
(:mod:`pask.tasks.sql_prompt`); decoding is constrained by that database's SELECT grammar
(:mod:`pask.structure.sql_grammar`); the generated query is scored by execution accuracy on a
read-only connection with a 30 s timeout (:mod:`pask.evaluation.sql_exec`, BIRD's rule).

``out_dir/cases.jsonl`` gets one line per case as its batch finishes; a later call with the same
directory skips the ids already there. ``summary.json`` and ``summary.md`` hold EX per Spider
difficulty (easy / medium / hard / extra) and overall, with the measured budget B (mean of the
per-case ``b_total``; 1.0 for Full KV).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pask.engine import Generation, Request, eos_ids
from pask.errors import PaskError
from pask.evaluation.run_bfcl import measured_budgets, run_resumable, write_summary
from pask.evaluation.sql_exec import DEFAULT_TIMEOUT_S, execution_match
from pask.models import LoadedModel
from pask.structure.constraint import Constraint, SchemaError, ll_tokenizer
from pask.structure.prompt_labels import label_sql_prompt
from pask.structure.sql_grammar import sql_grammar
from pask.structure.sql_tagger import SqlTagger
from pask.tasks.spider_hardness import LEVELS
from pask.tasks.sql_prompt import DdlSpan, build_messages, schema_ddl
from pask.tasks.sql_schema import Schema
from pask.tasks.text_to_sql import DEFAULT_DATA_DIR, SPLITS, Case, db_path, load_cases, load_schema, split_cases

DEFAULT_MAX_NEW_TOKENS = 256


@dataclass
class CaseResult:
    id: str
    db_id: str
    difficulty: str
    prompt_len: int
    output: str  # the generated SQL
    correct: bool
    error: str | None  # why the prediction was not compared (SQLite error, timeout, ...) or scored 0
    stop_reason: str
    n_generated: int
    prefill_ms: float
    tpot_ms: float
    budget: dict | None = None
    tags: list[str] | None = None  # per generated token (--save-tags)
    prompt_labels: list[str] | None = None  # per prompt token (--save-tags)


@dataclass(frozen=True)
class Database:
    """What every case on one database shares: its file, schema, grammar text and DDL spans."""

    path: Path
    schema: Schema
    grammar: str
    ddl: str
    spans: tuple[DdlSpan, ...]

    def tagger_schema(self) -> dict[str, list[str]]:
        return {t.name: [c.name for c in t.columns] for t in self.schema.tables}


@lru_cache(maxsize=64)
def _database(db_id: str, data_dir: Path) -> Database:
    schema = load_schema(db_id, data_dir)
    ddl, spans = schema_ddl(schema)
    return Database(db_path(db_id, data_dir), schema, sql_grammar(schema), ddl, tuple(spans))


def database(db_id: str, data_dir: Path | str | None = None) -> Database:
    """The shared assets of ``db_id`` (built once per database and data directory).

    :class:`PaskError` for an unknown db_id or a missing / non-SQLite database file.
    """
    return _database(db_id, Path(data_dir if data_dir is not None else DEFAULT_DATA_DIR).resolve())


def check_databases(cases: list[Case], data_dir: Path | str | None = None) -> None:
    """Raise :class:`PaskError` (naming a question) unless every db_id is known and its file is SQLite."""
    first: dict[str, str] = {}
    for c in cases:
        first.setdefault(c.db_id, c.id)
    for db_id, case_id in first.items():
        try:
            db_path(db_id, data_dir)
        except PaskError as e:
            raise PaskError(f"question {case_id}: {e}") from None


def select_cases(split: str, limit: int | None = None, data_dir: Path | str | None = None) -> list[Case]:
    """The first ``limit`` cases (file order) of a database-disjoint split, after checking every database."""
    if split not in SPLITS:
        raise PaskError(f"unknown split '{split}'; choose one of {', '.join(SPLITS)}")
    if limit is not None and limit < 1:
        raise PaskError(f"--limit must be >= 1, got {limit}")
    cases = load_cases(data_dir)
    check_databases(cases, data_dir)
    return split_cases(cases)[split][:limit]


def prepare(
    lm: LoadedModel,
    case: Case,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    tagging: bool = False,
    data_dir: Path | str | None = None,
) -> tuple[Request, str | None]:
    """Prompt ids + the database's grammar constraint (+ SqlTagger and prompt labels) for a case.

    A grammar llguidance rejects is reported as the case's error, not raised.
    """
    tok = lm.tokenizer
    db = database(case.db_id, data_dir)
    prompt = tok.apply_chat_template(build_messages(case, db.schema), add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    try:
        constraint = Constraint(ll_tokenizer(tok, eos_ids(tok)), db.grammar)
    except SchemaError as e:
        return Request(ids), f"schema_error: {e}"
    req = Request(ids, constraint, max_new_tokens)
    if tagging:
        req.tagger = SqlTagger(db.tagger_schema())
        at = prompt.index(db.ddl)
        req.prompt_labels = label_sql_prompt(tok, prompt, [(s + at, e + at, k, n) for s, e, k, n in db.spans])
    return req, None


def score(case: Case, gen: Generation, path: Path, req: Request | None = None, save_tags: bool = False) -> CaseResult:
    """Execute the generated query and the gold one on ``path``; EX by BIRD's rule."""
    sql = gen.text.strip()
    if sql:
        res = execution_match(path, sql, case.gold_sql, DEFAULT_TIMEOUT_S)
        correct, error = res.correct, res.error
    else:
        correct, error = False, "empty output"
    return CaseResult(
        id=case.id,
        db_id=case.db_id,
        difficulty=case.difficulty,
        prompt_len=gen.prompt_len,
        output=gen.text,
        correct=correct,
        error=error,
        stop_reason=gen.stop_reason,
        n_generated=len(gen.token_ids),
        prefill_ms=round(gen.prefill_ms, 2),
        tpot_ms=round(gen.tpot_ms, 2),
        budget=gen.extra.get("budget"),
        tags=[str(t) for t in gen.extra.get("tags", [])] if save_tags else None,
        prompt_labels=[str(x) for x in req.prompt_labels or []] if save_tags and req else None,
    )


def run_sql(
    lm: LoadedModel,
    cases: list[Case],
    out_dir: Path,
    batch_size: int = 8,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    policy=None,
    progress: Callable[[int], None] | None = None,
    meta: dict | None = None,
    save_tags: bool = False,
    data_dir: Path | str | None = None,
    batching: str = "static",
) -> dict:
    """Evaluate cases (resuming from ``out_dir/cases.jsonl``) and write the summary; return it.

    ``data_dir`` is the directory the cases were loaded from (default: the bundled Spider dev copy);
    ``batching``: ``"static"`` or ``"continuous"`` (see :func:`pask.evaluation.run_bfcl.run_resumable`).
    """
    if batch_size < 1:
        raise PaskError("--batch-size must be >= 1")
    if max_new_tokens < 1:
        raise PaskError("--max-new-tokens must be >= 1")
    tagging = save_tags or getattr(policy, "needs_tags", False)

    def error_row(c: Case, req: Request, err: str) -> CaseResult:
        return CaseResult(c.id, c.db_id, c.difficulty, len(req.prompt_ids), "", False, err, "schema_error", 0, 0, 0)

    n_run, wall = run_resumable(
        lm,
        cases,
        out_dir,
        batch_size,
        lambda c: prepare(lm, c, max_new_tokens, tagging, data_dir),
        error_row,
        lambda c, g, r: score(c, g, database(c.db_id, data_dir).path, r, save_tags),
        policy,
        progress,
        batching,
    )
    return write_summary(out_dir, cases, n_run, wall, meta, summarize, table_markdown)


def _bucket(rows: list[dict]) -> dict:
    n = len(rows)
    correct = sum(r["correct"] for r in rows)
    return {"n": n, "correct": correct, "ex": round(100 * correct / n, 2) if n else None}


def summarize(rows: list[dict]) -> dict:
    """EX (%) per difficulty and overall, failure counts and the measured budget."""
    levels = {d: _bucket([r for r in rows if r["difficulty"] == d]) for d in LEVELS}
    overall = _bucket(rows)
    overall["exec_errors"] = sum(r["error"] is not None and r["stop_reason"] != "schema_error" for r in rows)
    overall["truncated"] = sum(r["stop_reason"] == "length" for r in rows)
    overall["schema_errors"] = sum(r["stop_reason"] == "schema_error" for r in rows)
    return {"difficulties": levels, "overall": overall, **measured_budgets(rows)}


def table_markdown(summary: dict, meta: dict | None = None) -> str:
    """Markdown in the layout of the paper's Table 12 (EX per difficulty + Overall, measured B)."""
    meta = meta or {}
    levels = summary["difficulties"]
    head = ["Model", "Method", "B", *[f"{d.capitalize()} EX" for d in LEVELS], "Overall EX"]

    def ex(b: dict) -> str:
        return "–" if b["ex"] is None else f"{b['ex']:.2f}"

    cells = [
        meta.get("model", "?"),
        meta.get("policy", "?"),
        f"{summary['measured_b']:.3f}",
        *[ex(levels[d]) for d in LEVELS],
        ex(summary["overall"]),
    ]
    ns = ["", "", "n", *[str(levels[d]["n"]) for d in LEVELS], str(summary["overall"]["n"])]
    lines = []
    if meta.get("command"):
        lines += [f"Command: `{meta['command']}`", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), "| " + " | ".join(cells) + " |"]
    lines += ["| " + " | ".join(ns) + " |", ""]
    o = summary["overall"]
    lines.append(
        f"Correct: {o['correct']}/{o['n']}; execution errors: {o['exec_errors']}; "
        f"truncated at max_new_tokens: {o['truncated']}; schema errors: {o['schema_errors']}."
    )
    return "\n".join(lines) + "\n"
