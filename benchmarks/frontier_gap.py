"""Where a frontier table's bytes go and what its calibration says they cost, item by item, next to
the measured loss on test (issue 29: a missed target is explained bucket by bucket).

    .venv/bin/python benchmarks/frontier_gap.py --full CELL_DIR TABLE.json=PASK_CELL_DIR [...] \
        --out benchmarks/results/frontier-gap/NAME

For each table: every calibration item (its buckets pooled over layer groups) with its share of
the stored bytes, its action per layer group, the V (share of the control-right probe cases that
flip) its calibration measured for each action taken, and its floor at the table's tolerances;
then the sum of the V admitted below the floors (the harm the table accepts, counted as if the
items' flips did not overlap), that sum times Full KV's test accuracy (the loss it predicts) and
the loss measured on test (Full KV minus PASK, paired). V of a pooled probe puts the item's every
layer group at the action at once, so an item taking it in some groups only is charged the whole V.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from pask.evaluation.case_rows import read_done
from pask.experiments.provenance import add_allow_dirty, check_clean, default_command, write_result
from pask.experiments.report import sign_test_p

ORDER = {"H": 0, "L": 1, "L2": 2, "R": 3}  # harm order of the actions (release last)
COST = {"H": 1.0, "L": 0.3125, "R": 0.0}  # bytes per BF16 byte; L2 from the table


def _buckets(table: dict) -> list[dict]:
    b = (table.get("calibration") or {}).get("buckets")
    if not b:
        raise SystemExit("the table records no calibration buckets (a table fitted before issue 29?)")
    return b


def _name(item: str) -> str:
    """An item name for a markdown table (its ``|`` would split the cell)."""
    return "`" + item.replace("|", " / ") + "`"


def items(table: dict) -> list[dict]:
    """One row per item: bytes share, actions per group, V of each action taken, floor actions."""
    out: dict[str, dict] = {}
    for b in _buckets(table):
        item, _, group = b["bucket"].rpartition("|")
        row = out.setdefault(item, {"item": item, "weight": 0.0, "actions": {}, "floors": {}, "V": b.get("V") or {}})
        row["weight"] += float(b["weight"])
        row["actions"][group] = b["action"]
        row["floors"][group] = b.get("floor", "H")
    return sorted(out.values(), key=lambda r: -r["weight"])


def admitted(row: dict) -> float:
    """V accepted below the floor: the V of the most harmful action taken in a group below its floor."""
    worst = [a for g, a in row["actions"].items() if ORDER[a] > ORDER[row["floors"].get(g, "H")]]
    if not worst:
        return 0.0
    a = max(worst, key=ORDER.get)
    return float(row["V"].get(a, 0.0))


def best_uniform(rows: list[dict], cost: dict[str, float], budget: float) -> tuple[float, dict[str, str]]:
    """The least admitted V of any table that gives each item one action in every layer group and
    holds at most ``budget`` (exhaustive: 4 ** items tables; floors taken per item, their strictest)."""
    best: tuple[float, dict[str, str]] = (float("inf"), {})
    floors = [min(r["floors"].values(), key=ORDER.get) for r in rows]
    for combo in itertools.product(ORDER, repeat=len(rows)):
        held = sum(r["weight"] * cost[a] for r, a in zip(rows, combo, strict=True))
        if held > budget:
            continue
        v = sum(
            float(r["V"].get(a, 0.0)) if ORDER[a] > ORDER[f] else 0.0
            for r, a, f in zip(rows, combo, floors, strict=True)
        )
        if v < best[0]:
            best = (v, {r["item"]: a for r, a in zip(rows, combo, strict=True)})
    return best


def _acc(cell: Path) -> tuple[float, dict[str, bool], float]:
    s = json.loads((cell / "summary.json").read_text())
    o = s["overall"]
    rows = read_done(cell / "cases.jsonl")
    outcomes = {i: bool(r["correct"]) for i, r in rows.items()}
    return float(o.get("accuracy", o.get("ex"))), outcomes, float(s["measured_b"])


def gap(table_path: Path, cell: Path, full: Path) -> tuple[dict, str]:
    table = json.loads(table_path.read_text())
    l2 = 0.25 if table.get("l2_key_bits") == 4 else 0.1875
    cost = {**COST, "L2": l2}
    rows = items(table)
    f_acc, f_out, _ = _acc(full)
    p_acc, p_out, p_b = _acc(cell)
    ids = set(f_out) & set(p_out)
    only_p = sum(p_out[i] and not f_out[i] for i in ids)
    only_f = sum(f_out[i] and not p_out[i] for i in ids)
    total_v = sum(admitted(r) for r in rows)
    released = sum(r["weight"] * sum(a == "R" for a in r["actions"].values()) / len(r["actions"]) for r in rows)
    groups = sorted({g for r in rows for g in r["actions"]})
    lines = [
        f"### {table_path.name} (target B {table.get('target_b')}, expected {table.get('expected_b')}, "
        f"L2 = {'K4V2' if l2 == 0.25 else 'INT2'})",
        "",
        f"Test: PASK {p_acc:.2f} at B {p_b:.3f} ({cell}); Full KV {f_acc:.2f} ({full}); paired PASK only "
        f"right : Full only right {only_p} : {only_f}, p = {sign_test_p(only_p, only_f):.3g}.",
        "",
        "| item | bytes share | " + " | ".join(groups) + " | floors | V(L) | V(L2) | V(R) | admitted V | bytes held |",
        "|---|---:|" + "---|" * len(groups) + "---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        acts = [r["actions"].get(g, "–") for g in groups]
        held = r["weight"] * sum(cost[a] for a in r["actions"].values()) / len(r["actions"])
        floors = "/".join(sorted(set(r["floors"].values()), key=ORDER.get))
        v = [f"{float(r['V'][a]):.3f}" if a in r["V"] else "–" for a in ("L", "L2", "R")]
        lines.append(
            f"| {_name(r['item'])} | {r['weight']:.3f} | "
            + " | ".join(acts)
            + f" | {floors} | "
            + " | ".join(v)
            + f" | {admitted(r):.3f} | {held:.3f} |"
        )
    predicted = total_v * f_acc
    cal = table.get("calibration") or {}
    room = float(cal.get("solver_target_b", table.get("target_b"))) - float(cal.get("window_share", 0.0))
    bound_v, bound = best_uniform(rows, cost, room) if len(rows) <= 10 else (float("nan"), {})
    lines += [
        "",
        f"Bytes released: {released:.3f} of the stored bytes. Admitted V summed over items: {total_v:.3f}; "
        f"times Full KV's {f_acc:.2f}: a predicted loss of {predicted:.1f} points (flips counted as if "
        f"they did not overlap). Measured on test: {f_acc - p_acc:.1f} points.",
        "",
        f"Lower bound in this action space: of all tables giving each item one action in every layer group "
        f"within the solver's budget ({room:.4f} after the BF16 recent window), the least admitted V is "
        f"{bound_v:.3f} (a predicted loss of {bound_v * f_acc:.1f} points): "
        + ", ".join(f"{_name(k)} {a}" for k, a in bound.items())
        + ".",
    ]
    data = {
        "table": str(table_path),
        "cell": str(cell),
        "full": str(full),
        "pask": p_acc,
        "pask_b": p_b,
        "full_acc": f_acc,
        "paired": [only_p, only_f],
        "admitted_v": total_v,
        "predicted_loss": predicted,
        "measured_loss": f_acc - p_acc,
        "released_share": released,
        "bound_admitted_v": bound_v,
        "bound_actions": bound,
        "items": [{**r, "admitted_v": admitted(r)} for r in rows],
    }
    return data, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pairs", nargs="+", help="TABLE.json=PASK_CELL_DIR")
    ap.add_argument("--full", type=Path, required=True, help="the Full KV cell on the same cases")
    ap.add_argument("--out", type=Path, help="result stem (JSON + markdown via the shared writer)")
    add_allow_dirty(ap)
    args = ap.parse_args(argv)
    if args.out:  # refuse a dirty tree before any work
        check_clean(args.out, args.allow_dirty)
    parts, blocks = [], []
    for pair in args.pairs:
        table, sep, cell = pair.partition("=")
        if not sep or not Path(table).is_file() or not (Path(cell) / "summary.json").is_file():
            ap.error(f"expected TABLE.json=CELL_DIR with both present, got {pair!r}")
        data, md = gap(Path(table), Path(cell), args.full)
        parts.append(data)
        blocks.append(md)
    text = "# Frontier tables: bytes and admitted harm by item\n\n" + "\n\n".join(blocks) + "\n"
    if args.out:
        cmd = None if argv is None else default_command([__file__, *argv])
        write_result(args.out, {"tables": parts}, text, command=cmd, allow_dirty=args.allow_dirty)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
