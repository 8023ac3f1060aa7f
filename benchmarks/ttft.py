"""Time to first token: PASK's prompt-side work (prefill statistics, decisions, INT4 / INT2 moves)
against Full KV's, on the same tool-calling prompts.

Per input length, one prompt (built as ``pask bench serve`` builds them) is admitted alone by the
continuous-batching scheduler, once per policy and repeat, interleaved (Full KV, PASK, Full KV,
...). The time measured is the scheduler's ``prefill_ms``: from admission to the row's first logits,
with the prompt's actions applied (the first token's choice, the same for every policy, is not in
it). Two settings:

* ``computed``: the prefill runs (what a new prompt costs: the issue's TTFT);
* ``stored``: the prefill is loaded from a prefill store (what the serving benchmarks' decode runs
  start from), so that PASK's own prompt-side work stands alone.

Medians over ``--repeats``; the overhead is PASK's median over Full KV's, minus 1::

    python benchmarks/ttft.py --lengths 2048,8192 --repeats 5 --threads 2

Writes ``benchmarks/results/ttft.{json,md}`` (``--out``) with provenance.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).parent / "results" / "ttft"


def prompt_body(lm, length: int) -> dict:
    """One chat body of about ``length`` prompt tokens (``pask bench serve``'s builder)."""
    from pask.bench.serving import BenchConfig, build_bodies

    return build_bodies(lm.tokenizer, lm.name, 1, BenchConfig(concurrency=1, input_len=length, output_len=1))[0]


def make_policy(spec: str, lm, allow_transfer: bool):
    """``full``, or ``pask@B`` with the committed BFCL table for B (any other policy name@B)."""
    from pask.errors import PaskError
    from pask.policies.factory import policy_from_spec

    try:
        return policy_from_spec(spec, lm.name, None if allow_transfer else lm.fingerprint, allow_transfer)
    except PaskError as e:
        raise SystemExit(f"ttft: {e}") from None


def prefill_ms(lm, body: dict, policy, store) -> tuple[float, float | None]:
    """One admission of ``body`` under ``policy``: (prefill_ms, measured B after the prompt's actions)."""
    from pask.runtime.engine import run_jobs
    from pask.runtime.scheduler import Job
    from pask.serving.protocol import attach_tagging, build_chat_request

    chat = build_chat_request(body, lm.tokenizer, lm.name)
    attach_tagging(chat, lm.tokenizer)
    chat.request.max_new_tokens = 1
    (job,) = run_jobs(lm, [Job(id="ttft", request=chat.request)], policy, store=store)
    return job.prefill_ms, (job.budget or {}).get("b_total")


def measure(lm, lengths: list[int], specs: list[str], repeats: int, allow_transfer: bool, log) -> list[dict]:
    from pask.runtime.prefill_store import PrefillStore

    rows = []
    policies = {s: make_policy(s, lm, allow_transfer) for s in specs}
    with tempfile.TemporaryDirectory(prefix="pask-ttft-") as tmp:
        store = PrefillStore(Path(tmp), lm.model)
        for n in lengths:
            body = prompt_body(lm, n)
            prefill_ms(lm, body, policies[specs[0]], store)  # fills the store (and warms everything)
            for setting, st in (("computed", None), ("stored", store)):
                times: dict[str, list[float]] = {s: [] for s in specs}
                budget: dict[str, float | None] = {}
                for r in range(repeats):
                    for s in specs:
                        ms, b = prefill_ms(lm, body, policies[s], st)
                        times[s].append(ms)
                        budget[s] = b
                        log(f"{n} {setting} {s} #{r + 1}: {ms:.0f} ms")
                ref = statistics.median(times[specs[0]])
                for s in specs:
                    med = statistics.median(times[s])
                    rows.append(
                        {
                            "input_len": n,
                            "setting": setting,
                            "policy": s,
                            "ms": [round(x, 2) for x in times[s]],
                            "median_ms": round(med, 2),
                            "overhead": round(med / ref - 1, 4),
                            "measured_b": budget[s],
                        }
                    )
    return rows


def markdown(r: dict) -> str:
    lines = [
        "# Time to first token: PASK's prompt-side work against Full KV's",
        "",
        f"Command: `{r['command']}`",
        "",
        f"{r['model']} (weights {r['weights']}), {r['threads']} thread(s), medians of {r['repeats']} interleaved "
        "admissions; the time from admission to the row's first logits with the prompt's actions applied "
        "(`prefill_ms`). `computed`: the prefill runs; `stored`: loaded from a prefill store.",
        "",
        "| input | setting | policy | median ms | overhead vs the first policy | measured B | runs ms |",
        "|---:|---|---|---:|---:|---:|---|",
    ]
    for x in r["rows"]:
        b = f"{x['measured_b']:.3f}" if x["measured_b"] is not None else "-"
        lines.append(
            f"| {x['input_len']} | {x['setting']} | {x['policy']} | {x['median_ms']:.1f} | "
            f"{100 * x['overhead']:+.1f} % | {b} | {', '.join(f'{v:.0f}' for v in x['ms'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--lengths", default="2048,8192", help="comma-separated prompt lengths (tokens)")
    ap.add_argument("--policies", default="full,pask@0.33", help="comma-separated; the first is the reference")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default="bf16", choices=["bf16", "int8", "int4"])
    ap.add_argument("--allow-transfer", action="store_true", help="a table calibrated on other weights")
    ap.add_argument("--out", type=Path, default=OUT)
    from pask.experiments.provenance import add_allow_dirty, check_clean, write_result

    add_allow_dirty(ap)
    a = ap.parse_args(argv)
    try:
        lengths = [int(x) for x in a.lengths.split(",") if x.strip()]
    except ValueError:
        ap.error("--lengths must be comma-separated integers")
    specs = [s.strip() for s in a.policies.split(",") if s.strip()]
    if not lengths or min(lengths) < 64 or not specs or a.repeats < 1 or a.threads < 1:
        ap.error("--lengths >= 64 each, at least one policy, --repeats >= 1 and --threads >= 1")
    if os.environ.get("PASK_PREFILL_STORE", "").strip():  # run_jobs would load the "computed" prefills from it
        ap.error(
            "unset $PASK_PREFILL_STORE: the computed setting must compute its prefills (the script keeps its own store)"
        )
    check_clean(a.out, a.allow_dirty)
    import torch

    from pask.api import load

    torch.set_num_threads(a.threads)
    lm = load(a.model, weights=None if a.weights == "bf16" else a.weights)
    t = time.time()
    rows = measure(lm, lengths, specs, a.repeats, a.allow_transfer, lambda m: print(m, file=sys.stderr, flush=True))
    result = {
        "command": "python benchmarks/ttft.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "model": a.model,
        "weights": a.weights,
        "threads": a.threads,
        "repeats": a.repeats,
        "wall_s": round(time.time() - t, 1),
        "rows": rows,
    }
    write_result(a.out, result, markdown(result), command=result["command"], allow_dirty=a.allow_dirty)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
