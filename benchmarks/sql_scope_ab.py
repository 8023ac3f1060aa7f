"""Scope check off against on: paired text-to-SQL cells (same cases, same policy).

    .venv/bin/python benchmarks/sql_scope_ab.py --off DIR --on DIR [--name NAME]
    .venv/bin/python benchmarks/sql_scope_ab.py --pair LABEL OFF_DIR ON_DIR [--pair ...] [--name NAME]

``DIR``: the ``--out`` folders of two ``pask eval sql`` runs that differ only in ``--sql-scope``
(their ``settings.json`` are compared: nothing else may differ). Reported per pair: EX of each over
the shared case ids, the discordant pairs and the exact two-sided sign test, execution errors by
kind (no such column / no such table / ambiguous column / other) with the change of ``no such
column``, how many outputs the scope analysis still flags, the mean TPOT of each (a ratio within
one run pair) and the code version that made each side (from its ``summary.json``; a table whose
sides come from different versions says so). Results: ``benchmarks/results/sql-scope/<name>.json``
and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from collections import Counter
from pathlib import Path

from pask.evaluation.case_rows import read_done
from pask.evaluation.runner import settings_differences
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.experiments.report import sign_test_p
from pask.structure.sql_scope import scope_errors
from pask.tasks.text_to_sql import load_schema

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sql_scope_audit import error_kind

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "sql-scope"


def side(rows: dict[str, dict], ids: list[str], schemas: dict) -> dict:
    """EX, error kinds, flagged outputs and TPOT of one cell over ``ids``."""
    kinds = Counter(error_kind(rows[i]["error"]) for i in ids if rows[i]["error"])
    schema = lambda i: schemas.setdefault(rows[i]["db_id"], load_schema(rows[i]["db_id"]))  # noqa: E731
    flagged = sum(bool(scope_errors(rows[i]["output"], schema(i))) for i in ids)
    tpot = [rows[i]["tpot_ms"] for i in ids if rows[i].get("tpot_ms")]
    correct = sum(bool(rows[i]["correct"]) for i in ids)
    return {
        "correct": correct,
        "ex": round(100 * correct / len(ids), 2),
        "errors": dict(kinds),
        "exec_errors": sum(kinds.values()),
        "flagged": flagged,
        "truncated": sum(rows[i]["stop_reason"] == "length" for i in ids),
        "tpot_ms_mean": round(statistics.fmean(tpot), 2) if tpot else None,
    }


def compare(off_dir: Path, on_dir: Path, schemas: dict) -> dict:
    """One off / on pair (their settings may differ in ``--sql-scope`` only)."""
    s_off, s_on = (json.loads((d / "settings.json").read_text()) for d in (off_dir, on_dir))
    diffs = settings_differences(s_off, s_on)
    if len(diffs) != 1 or not diffs[0].startswith("options.sql_scope:"):
        raise SystemExit(f"error: {off_dir} and {on_dir} differ in more than --sql-scope: {diffs}")
    off, on = read_done(off_dir / "cases.jsonl"), read_done(on_dir / "cases.jsonl")
    ids = sorted(set(off) & set(on))
    a, b = side(off, ids, schemas), side(on, ids, schemas)
    only_off = sum(bool(off[i]["correct"]) and not on[i]["correct"] for i in ids)
    only_on = sum(bool(on[i]["correct"]) and not off[i]["correct"] for i in ids)
    nsc_off, nsc_on = a["errors"].get("no such column", 0), b["errors"].get("no such column", 0)
    return {
        "cases": len(ids),
        "settings": {k: v for k, v in s_on.items() if k != "options"} | {"options": s_on.get("options")},
        "off": a | {"code": _code(off_dir)},
        "on": b | {"code": _code(on_dir)},
        "only_off_correct": only_off,
        "only_on_correct": only_on,
        "sign_test_p": sign_test_p(only_off, only_on),
        "no_such_column_drop": round(1 - nsc_on / nsc_off, 4) if nsc_off else None,
        "tpot_ratio_on_off": round(b["tpot_ms_mean"] / a["tpot_ms_mean"], 4)
        if a["tpot_ms_mean"] and b["tpot_ms_mean"]
        else None,
        "runs": {"off": str(off_dir), "on": str(on_dir)},
    }


def _code(run_dir: Path) -> str:
    """The code version that made a run (``commit[:12]``, ``+dirty`` if so), from its summary.json
    (a sweep cell: its cell.json)."""
    if not (run_dir / "summary.json").is_file():
        raise SystemExit(f"error: {run_dir} has no summary.json (the run has not finished)")
    v = json.loads((run_dir / "summary.json").read_text())["run"].get("code_version")
    if not v and (run_dir / "cell.json").is_file():  # a sweep cell: its manifest records the version
        v = json.loads((run_dir / "cell.json").read_text()).get("code_version")
    v = v or {}
    return (v.get("commit") or "?")[:12] + ("+dirty" if v.get("dirty") else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--off", type=Path)
    ap.add_argument("--on", type=Path)
    ap.add_argument("--pair", nargs=3, action="append", metavar=("LABEL", "OFF", "ON"), default=[])
    ap.add_argument("--name", default="full-test-scope-ab")
    add_allow_dirty(ap)
    args = ap.parse_args()
    pairs = [(label, Path(off), Path(on)) for label, off, on in args.pair]
    if args.off or args.on:
        if not (args.off and args.on):
            ap.error("--off and --on go together")
        pairs.insert(0, ("", args.off, args.on))
    if not pairs:
        ap.error("give --off DIR --on DIR, or one --pair LABEL OFF ON or more")
    check_clean(OUT / args.name, args.allow_dirty)
    schemas: dict = {}
    results = {label: compare(off, on, schemas) for label, off, on in pairs}
    result = results[""] if list(results) == [""] else {"pairs": results}
    command = shlex.join(["python", "benchmarks/sql_scope_ab.py", *sys.argv[1:]])
    md = markdown(result, command) if "pairs" not in result else markdown_pairs(result["pairs"], command)
    js, _ = write_result(OUT / args.name, result, md, command=command, allow_dirty=args.allow_dirty)
    print(md, end="")
    print(f"results: {js}")


def _row(name: str, s: dict) -> str:
    e = s["errors"]
    return (
        f"| {name} | {s['correct']} | {s['ex']:.2f} | {s['exec_errors']} | {e.get('no such column', 0)} "
        f"| {e.get('no such table', 0)} | {e.get('ambiguous column', 0)} | {e.get('other', 0)} | {s['flagged']} "
        f"| {s['truncated']} | {s['tpot_ms_mean']} |"
    )


_HEAD = [
    "| scope | correct | EX | exec errors | no such column | no such table | ambiguous | other "
    "| flagged by the scope analysis | truncated | TPOT ms |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
]


def _verdict(r: dict) -> str:
    drop = "-" if r["no_such_column_drop"] is None else f"{100 * r['no_such_column_drop']:.1f} %"
    return (
        f"Discordant pairs: correct only off {r['only_off_correct']}, only on {r['only_on_correct']}; "
        f"exact two-sided sign test p = {r['sign_test_p']:.4g}. `no such column` drop: {drop}. "
        f"TPOT on / off: {r['tpot_ratio_on_off']}."
    )


def markdown(r: dict, command: str) -> str:
    return "\n".join(
        [
            "# Scope check off vs on (text-to-SQL, paired)",
            "",
            f"Command: `{command}`",
            "",
            f"{r['cases']} shared cases; policy {r['settings'].get('policy')}, model {r['settings'].get('model')}, "
            f"split {r['settings'].get('split')}, dtype {r['settings'].get('dtype')}; off made by {r['off']['code']}, "
            f"on by {r['on']['code']}.",
            "",
            *_HEAD,
            _row("off", r["off"]),
            _row("on", r["on"]),
            "",
            _verdict(r) + " (The two runs shared the machine, one thread each.)",
            "",
        ]
    )


def markdown_pairs(pairs: dict, command: str) -> str:
    """One table for several policies: an off and an on row each, then each pair's verdict."""
    first = next(iter(pairs.values()))["settings"]
    codes = sorted({p[s]["code"] for p in pairs.values() for s in ("off", "on")})
    lines = [
        "# Scope check off vs on, per policy (text-to-SQL, paired)",
        "",
        f"Command: `{command}`",
        "",
        f"Model {first.get('model')}, split {first.get('split')}, dtype {first.get('dtype')}. "
        + (
            f"The cells come from {len(codes)} code versions ({', '.join(codes)}): each side's is in its row."
            if len(codes) > 1
            else f"Code version {codes[0]}."
        ),
        "",
        "| policy | B | " + _HEAD[0][2:].replace("| TPOT ms |", "| TPOT ms | code |"),
        "|---|---:|" + _HEAD[1][1:] + "---|",
    ]
    for label, r in pairs.items():
        budget = r["settings"].get("budget")
        for s in ("off", "on"):
            lines.append(f"| {label} | {budget if budget is not None else 1} " + _row(s, r[s]) + f" {r[s]['code']} |")
    lines.append("")
    for label, r in pairs.items():
        lines.append(f"- **{label}** ({r['cases']} shared cases): " + _verdict(r))
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
