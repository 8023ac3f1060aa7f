"""Collect `pask tune` logs into one committed results file (JSON + markdown table).

    .venv/bin/python benchmarks/tuning_table.py runs/tune-snapkv-b0.33 runs/tune-h2o-b0.33 ... \
        [--configs pask/policies/configs.json] [--out benchmarks/results/tuning]

Each argument is a `pask tune --out` directory (its ``tuning.jsonl`` holds one row per finished
configuration, its run dirs the per-case rows). Per policy and budget: every configuration tried,
its dev accuracy, measured B, case count and wall time, and the configuration the configs file
holds (the one `pask eval` and `pask sweep` use). The JSON copies the logs verbatim.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.policies.tuning import budget_key


def _log(d: Path) -> list[dict]:
    f = d / "tuning.jsonl"
    if not f.exists():
        raise SystemExit(f"{d}: no tuning.jsonl (not a `pask tune --out` directory?)")
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def _fmt(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(params.items())) or "(defaults)"


def table(logs: dict[str, list[dict]], chosen: dict) -> str:
    lines = []
    for name, rows in logs.items():
        if not rows:
            continue
        policy, budget = rows[0]["policy"], rows[0]["budget"]
        pick = chosen.get(policy, {}).get(budget_key(budget))
        n = {r.get("n") for r in rows}
        lines += [f"### {policy} at B = {budget:g} ({name}; {'/'.join(map(str, sorted(n)))} dev cases)", ""]
        lines += ["| configuration | dev accuracy | measured B | s | chosen |", "|---|---:|---:|---:|:---:|"]
        for r in rows:
            mark = "**yes**" if pick == r["params"] else ""
            lines.append(
                f"| {_fmt(r['params'])} | {r['score']:.2f} | {r.get('measured_b', float('nan')):.4f} "
                f"| {r.get('seconds', 0):.0f} | {mark} |"
            )
        if pick is None:
            lines.append("")
            lines.append("(no choice recorded in the configs file: the search did not finish)")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--configs", type=Path, default=Path("pask/policies/configs.json"))
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "tuning")
    ap.add_argument("--made-by", action="append", default=[], help="the `pask tune` command of a log (repeat)")
    add_allow_dirty(ap)
    a = ap.parse_args()
    check_clean(a.out, a.allow_dirty)
    logs = {d.name: _log(d) for d in a.dirs}
    chosen = json.loads(a.configs.read_text()) if a.configs.exists() else {}
    cmd = "python " + " ".join(shlex.quote(x) for x in ["benchmarks/tuning_table.py", *sys.argv[1:]])
    record = {"command": cmd, "made_by": a.made_by, "logs": logs, "chosen": chosen}
    made = "".join(f"- `{m}`\n" for m in a.made_by)
    made = f"The logs were made by:\n\n{made}\n" if made else ""
    md = f"# Baseline tuning on the dev split\n\nCommand: `{cmd}`\n\n{made}{table(logs, chosen)}"
    write_result(a.out / "tuning", record, md, command=cmd, allow_dirty=a.allow_dirty, indent=1)
    print(md)


if __name__ == "__main__":
    main()
