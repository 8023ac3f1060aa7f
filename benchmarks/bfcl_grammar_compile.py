"""Does every BFCL case's tool-call grammar compile? (No case should fail before generation.)

For every case of the given categories (default: the eight pask loads), builds the request the
eval builds (:meth:`pask.tasks.bfcl.BfclTask.request`: prompt and grammar) and compiles its grammar
into a :class:`pask.structure.constraint.Constraint` over a real tokenizer, the step where
``pask eval bfcl`` records a ``schema_error`` row instead of generating. It also reports the cases
:func:`pask.tasks.function_calling.check_tools` (the stricter pre-model check) refuses, and the
parameters no JSON value can fill (optional ones are left out of the grammar silently, so the
model can never pass them).

    python benchmarks/bfcl_grammar_compile.py [--model smollm2-135m] [--categories live_simple ...]

Prints per-category counts and every failure; exits 1 if any grammar fails to compile.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from transformers import AutoTokenizer

from pask.errors import PaskError
from pask.runtime.models import convert_embedded
from pask.runtime.tokens import eos_ids
from pask.structure.constraint import Constraint, SchemaError, ll_tokenizer
from pask.structure.schema_check import check_json_schema
from pask.tasks.bfcl import BfclTask
from pask.tasks.bfcl_checker import CATEGORIES
from pask.tasks.function_calling import check_tools, load_cases


def dead_params(tools: list[dict]) -> list[str]:
    """``tool.param`` for each top-level parameter whose schema no JSON value satisfies."""
    out = []
    for tool in tools:
        fn = tool["function"]
        for name, sub in (fn["parameters"].get("properties") or {}).items():
            try:
                check_json_schema(sub, f"{fn['name']}.{name}")
            except PaskError:
                out.append(f"{fn['name']}.{name}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="embedded model whose tokenizer compiles the grammars")
    ap.add_argument("--categories", nargs="+", default=list(CATEGORIES), choices=CATEGORIES)
    args = ap.parse_args(argv)

    tok = AutoTokenizer.from_pretrained(convert_embedded(args.model))
    ll_tok = ll_tokenizer(tok, eos_ids(tok))
    task = BfclTask()
    total, failed, refused, dead = Counter(), Counter(), Counter(), Counter()
    problems: list[str] = []
    for cat in args.categories:
        for case in load_cases([cat], split="all"):
            total[cat] += 1
            try:
                Constraint(ll_tok, task.request(case, tok).grammar)
            except (SchemaError, PaskError) as e:
                failed[cat] += 1
                problems.append(f"compile  {case.id}: {e}")
            try:
                check_tools(case.tools)
            except PaskError as e:
                refused[cat] += 1
                problems.append(f"check    {case.id}: {e}")
            params = dead_params(case.tools)
            if params:
                dead[cat] += 1
                problems.append(f"dead     {case.id}: {', '.join(params)}")
    print(f"{'category':<24}{'cases':>7}{'compile':>9}{'check':>7}{'dead':>6}")
    for cat in args.categories:
        print(f"{cat:<24}{total[cat]:>7}{failed[cat]:>9}{refused[cat]:>7}{dead[cat]:>6}")
    print(
        f"{'all':<24}{sum(total.values()):>7}{sum(failed.values()):>9}{sum(refused.values()):>7}{sum(dead.values()):>6}"
    )
    print("(compile: grammar fails to compile = the case fails before generation; check: check_tools refuses;")
    print(" dead: a parameter no value satisfies)")
    for line in problems:
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
