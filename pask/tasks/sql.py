"""Text-to-SQL (Spider dev) as a :class:`~pask.tasks.base.Task` (``pask eval sql``; paper Table 12 layout).

A case's prompt is its database's schema as DDL plus the question, through the chat template
(:mod:`pask.tasks.sql_prompt`); decoding is constrained by that database's SELECT grammar
(:mod:`pask.structure.sql_grammar`); the generated query is scored by execution accuracy on a
read-only connection with a 30 s timeout (:mod:`pask.tasks.sql_exec`, BIRD's rule). Summaries
give EX per Spider difficulty (easy / medium / hard / extra) and overall, and overall EX over the
cases whose gold query returns rows (``ex_nonempty_gold``): on a case whose gold result is empty,
any prediction that returns no rows scores correct (36 of the 407 test cases).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Any, ClassVar

from pask.errors import PaskError
from pask.structure.prompt_labels import label_sql_prompt
from pask.structure.sql_grammar import sql_grammar
from pask.structure.sql_schema import Schema
from pask.structure.sql_scope import ScopedConstraint
from pask.structure.sql_tagger import SqlTagger
from pask.tasks.base import Output, Task, TaskRequest, measured_budgets, table_lines
from pask.tasks.spider_hardness import LEVELS
from pask.tasks.sql_exec import DEFAULT_TIMEOUT_S, execution_match, gold_is_empty
from pask.tasks.sql_prompt import DdlSpan, build_messages, schema_ddl
from pask.tasks.text_to_sql import (
    DEFAULT_DATA_DIR,
    SPLITS,
    UNRATED,
    Case,
    db_path,
    load_cases,
    load_schema,
    split_cases,
)

DEFAULT_MAX_NEW_TOKENS = 256


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
    """The first ``limit`` cases (file order) of a database-disjoint split, after checking every database.

    ``all``: every question on an original database, in file order (a directory of one's own, too
    small to split by database; never for calibration or tuning)."""
    if split not in (*SPLITS, "all"):
        raise PaskError(f"unknown split '{split}'; choose one of {', '.join((*SPLITS, 'all'))}")
    if limit is not None and limit < 1:
        raise PaskError(f"--limit must be >= 1, got {limit}")
    cases = load_cases(data_dir)
    check_databases(cases, data_dir)
    if split == "all":
        return [c for c in cases if c.original_db][:limit]
    return split_cases(cases)[split][:limit]


def _bucket(rows: list[dict]) -> dict:
    n = len(rows)
    correct = sum(r["correct"] for r in rows)
    return {"n": n, "correct": correct, "ex": round(100 * correct / n, 2) if n else None}


def _levels(rows: list[dict]) -> tuple[str, ...]:
    """Spider's four levels, and ``unrated`` when a question had no parsed query to rate it."""
    return (*LEVELS, UNRATED) if any(r["difficulty"] == UNRATED for r in rows) else LEVELS


def _gold_empty_fields(rows: list[dict]) -> dict:
    """``gold_empty``: how many cases' gold query returns no rows; ``ex_nonempty_gold``: EX (%) over
    the others. Both None when a row lacks a boolean ``gold_empty`` (rows of cells made before it was
    recorded: :func:`with_gold_empty` fills it in by running the gold queries)."""
    if any(not isinstance(r.get("gold_empty"), bool) for r in rows):
        return {"gold_empty": None, "ex_nonempty_gold": None}
    rest = _bucket([r for r in rows if not r["gold_empty"]])
    return {"gold_empty": len(rows) - rest["n"], "ex_nonempty_gold": rest["ex"]}


def summarize(rows: list[dict]) -> dict:
    """EX (%) per difficulty and overall, overall EX over the cases whose gold query returns rows,
    failure counts and the measured budget."""
    levels = {d: _bucket([r for r in rows if r["difficulty"] == d]) for d in _levels(rows)}
    overall = _bucket(rows)
    overall.update(_gold_empty_fields(rows))
    overall["exec_errors"] = sum(r["error"] is not None and r["stop_reason"] != "schema_error" for r in rows)
    overall["truncated"] = sum(r["stop_reason"] == "length" for r in rows)
    overall["schema_errors"] = sum(r["stop_reason"] == "schema_error" for r in rows)
    return {"difficulties": levels, "overall": overall, **measured_budgets(rows)}


def table_markdown(summary: dict, meta: dict | None = None) -> str:
    """Markdown in the layout of the paper's Table 12 (EX per difficulty + Overall, measured B), and
    overall EX over the cases whose gold query returns rows (``–`` when the rows do not say)."""
    meta = meta or {}
    levels = summary["difficulties"]
    o = summary["overall"]
    head = ["Model", "Method", "B", *[f"{d.capitalize()} EX" for d in levels], "Overall EX", "EX (gold ≠ ∅)"]

    def pct(x: float | None) -> str:
        return "–" if x is None else f"{x:.2f}"

    empty = o.get("gold_empty")
    cells = [
        meta.get("model", "?"),
        meta.get("policy", "?"),
        f"{summary['measured_b']:.3f}",
        *[pct(levels[d]["ex"]) for d in levels],
        pct(o["ex"]),
        pct(o.get("ex_nonempty_gold")),
    ]
    n_rest = "–" if empty is None else str(o["n"] - empty)
    ns = ["", "", "n", *[str(levels[d]["n"]) for d in levels], str(o["n"]), n_rest]
    lines = table_lines(head, cells, ns, meta)
    lines.append(
        f"Correct: {o['correct']}/{o['n']}; execution errors: {o['exec_errors']}; "
        f"truncated at max_new_tokens: {o['truncated']}; schema errors: {o['schema_errors']}."
    )
    if empty is not None:
        lines.append(
            f"Gold query returns no rows in {empty}/{o['n']} cases (any empty prediction scores correct there); "
            "EX (gold ≠ ∅) leaves them out."
        )
    return "\n".join(lines) + "\n"


def with_gold_empty(rows: list[dict], data_dir: Path | str | None = None) -> list[dict]:
    """``rows`` (case rows of a ``pask eval sql`` cell), each with ``gold_empty`` filled in where it
    is missing, by running its case's gold query on its database (cached per query; no model runs).

    For cells made before ``gold_empty`` was recorded: ``summarize(with_gold_empty(rows))`` gives EX
    both ways. ``data_dir``: the cell's text-to-SQL data (default: the bundled Spider dev).
    :class:`PaskError` for a row whose id is not a case of ``data_dir``.
    """
    if all(isinstance(r.get("gold_empty"), bool) for r in rows):
        return list(rows)
    gold = {c.id: c for c in load_cases(data_dir)}
    out = []
    for r in rows:
        if not isinstance(r.get("gold_empty"), bool):
            case = gold.get(r["id"])
            if case is None or case.db_id != r["db_id"]:
                raise PaskError(f"case {r['id']} (db {r['db_id']}) is not a question of the text-to-SQL data")
            r = {**r, "gold_empty": gold_is_empty(database(case.db_id, data_dir).path, case.gold_sql)}
        out.append(r)
    return out


def check_scope_option(value: Any) -> bool:
    """``on`` / ``off`` (also true / false) as a bool; PaskError otherwise."""
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("on", "true"):
        return True
    if str(value).lower() in ("off", "false"):
        return False
    raise PaskError(f"sql_scope must be on or off, got {value!r}")


def _scoped(ll_tok: Any, grammar: str, eos: list[int], schema: Schema) -> ScopedConstraint:
    return ScopedConstraint(ll_tok, grammar, schema, eos)


class SqlTask(Task):
    """Spider dev text-to-SQL by execution accuracy.

    Option ``data_dir``: the Spider layout to load (default: the bundled copy); ``limit``: the split's
    first N; ``sql_scope``: ``on`` adds the scope check to the grammar
    (:class:`~pask.structure.sql_scope.ScopedConstraint`: no column its FROM clause lacks; the
    default), ``off`` the grammar alone (how the text-to-SQL cells before issue 28 were made).
    """

    name = "sql"
    splits = (*SPLITS, "all")
    options: ClassVar[dict[str, Any]] = {"data_dir": None, "sql_scope": "on"}
    path_options = ("data_dir",)
    default_max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    score_key = "ex"

    def cases(
        self, split: str, limit: int | None = None, data_dir: Path | str | None = None, sql_scope: str = "on"
    ) -> list[Case]:
        check_scope_option(sql_scope)
        return select_cases(split, limit, data_dir)

    def request(
        self,
        case: Case,
        tokenizer: Any,
        tagging: bool = False,
        data_dir: Path | str | None = None,
        sql_scope: str = "on",
    ) -> TaskRequest:
        db = database(case.db_id, data_dir)
        messages = build_messages(case, db.schema)
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        req = TaskRequest(tokenizer(prompt, add_special_tokens=False)["input_ids"], db.grammar)
        if check_scope_option(sql_scope):
            req.constrain = partial(_scoped, schema=db.schema)
        if tagging:
            req.tagger = SqlTagger(db.tagger_schema())
            at = prompt.index(db.ddl)
            req.prompt_labels = label_sql_prompt(tokenizer, prompt, [(s + at, e + at, k, n) for s, e, k, n in db.spans])
        return req

    def case_fields(self, case: Case) -> dict:
        return {"id": case.id, "db_id": case.db_id, "difficulty": case.difficulty}

    def check(self, case: Case, output: Output, data_dir: Path | str | None = None, sql_scope: str = "on") -> dict:
        """Execute the generated query and the gold one on the case's database; EX by BIRD's rule.

        ``gold_empty``: the gold query returned no rows (from the same run of it; for a case without
        a query to compare, the gold query runs alone)."""
        path = database(case.db_id, data_dir).path
        sql = output.text.strip()
        if output.error is not None or not sql:
            error = output.error if output.error is not None else "empty output"
            empty = gold_is_empty(path, case.gold_sql, DEFAULT_TIMEOUT_S)
            return {"correct": False, "error": error, "gold_empty": empty}
        res = execution_match(path, sql, case.gold_sql, DEFAULT_TIMEOUT_S)
        return {"correct": res.correct, "error": res.error, "gold_empty": res.gold_empty}

    def summarize(self, rows: list[dict]) -> dict:
        return summarize(rows)

    def markdown(self, summary: dict, meta: dict | None = None) -> str:
        return table_markdown(summary, meta)

    def group(self, case: Case) -> str:
        return case.difficulty


__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "Database",
    "SqlTask",
    "database",
    "select_cases",
    "summarize",
    "table_markdown",
    "with_gold_empty",
]
