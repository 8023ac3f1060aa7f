"""Coverage of the per-database SQL grammar over the Spider dev gold queries.

Every gold query of dev.json is tokenized with a real tokenizer and fed to an llguidance matcher
for its database's grammar (:func:`pask.structure.sql_grammar.sql_grammar`); a query counts as
covered when all its tokens are accepted and the matcher ends in an accepting state.

    python benchmarks/sql_grammar_coverage.py [--data-dir DIR] [--model qwen2.5-coder-0.5b]

Writes benchmarks/results/sql_grammar_coverage.{json,md}.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import llguidance.hf
from transformers import AutoTokenizer

from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.runtime.models import embedded_cache_dir
from pask.structure.sql_grammar import GrammarCheck, SqlGrammarChecker
from pask.tasks.spider_hardness import LEVELS
from pask.tasks.text_to_sql import DEFAULT_DATA_DIR, Case, load_cases, load_schema

RESULTS = Path(__file__).resolve().parent / "results"


def check_all(cases: list[Case], tokenizer: object, data_dir: Path) -> list[tuple[Case, GrammarCheck]]:
    """Check every case's gold query against its database's grammar (one matcher per database)."""
    ll_tok = llguidance.hf.from_tokenizer(tokenizer)
    checkers: dict[str, SqlGrammarChecker] = {}
    out = []
    for case in cases:
        if case.db_id not in checkers:
            checkers[case.db_id] = SqlGrammarChecker(load_schema(case.db_id, data_dir), tokenizer, ll_tok)
        out.append((case, checkers[case.db_id].check(case.gold_sql)))
    return out


def _tally(results: list[tuple[Case, GrammarCheck]], key: str) -> dict[str, dict[str, int]]:
    total, ok = Counter(), Counter()
    for case, check in results:
        total[getattr(case, key)] += 1
        ok[getattr(case, key)] += check.accepted
    order = {level: i for i, level in enumerate(LEVELS)}
    return {k: {"total": total[k], "accepted": ok[k]} for k in sorted(total, key=lambda k: (order.get(k, -1), k))}


def _display(path: Path) -> str:
    """``path`` relative to the working directory when inside it (stable across checkouts)."""
    path = path.resolve()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def _markdown(report: dict) -> str:
    lines = [
        f"Command: `{report['command']}`",
        "",
        "# SQL grammar coverage of Spider dev gold queries",
        "",
        f"Tokenizer: `{report['tokenizer']}`; data: `{report['data_dir']}`.",
        "",
        f"**{report['accepted']} / {report['total']} accepted ({100 * report['coverage']:.2f} %)** "
        f"in {report['seconds']:.1f} s.",
        "",
        "| database | accepted | total |",
        "|---|---|---|",
    ]
    lines += [f"| {db} | {v['accepted']} | {v['total']} |" for db, v in report["per_db"].items()]
    lines += ["", "| difficulty | accepted | total |", "|---|---|---|"]
    lines += [f"| {d} | {v['accepted']} | {v['total']} |" for d, v in report["per_difficulty"].items()]
    lines += ["", "## Rejected gold queries", ""]
    if not report["rejected"]:
        lines.append("None.")
    for r in report["rejected"]:
        sql = r["gold_sql"]
        lines.append(f"- `{r['id']}` ({r['db_id']}): {r['detail']} at char {r['offset']}: `{sql}`")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="embedded model whose tokenizer is used")
    ap.add_argument("--out", type=Path, default=RESULTS / "sql_grammar_coverage")
    add_allow_dirty(ap)
    args = ap.parse_args()
    check_clean(args.out, args.allow_dirty)

    tok_dir = embedded_cache_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    cases = load_cases(args.data_dir)
    start = time.perf_counter()
    results = check_all(cases, tokenizer, args.data_dir)
    seconds = time.perf_counter() - start

    accepted = sum(check.accepted for _, check in results)
    report = {
        "command": shlex.join(["python", *sys.argv]),
        "tokenizer": args.model,
        "data_dir": _display(args.data_dir),
        "total": len(results),
        "accepted": accepted,
        "coverage": accepted / len(results) if results else 0.0,
        "seconds": seconds,
        "per_db": _tally(results, "db_id"),
        "per_difficulty": _tally(results, "difficulty"),
        "rejected": [
            {"id": c.id, "db_id": c.db_id, "difficulty": c.difficulty, "gold_sql": c.gold_sql, **asdict(check)}
            for c, check in results
            if not check.accepted
        ],
    }
    md = _markdown(report)
    write_result(args.out, report, md, command=report["command"], allow_dirty=args.allow_dirty, indent=1)
    print(f"{accepted}/{len(results)} accepted ({100 * report['coverage']:.2f} %); wrote {args.out}.{{json,md}}")


if __name__ == "__main__":
    main()
