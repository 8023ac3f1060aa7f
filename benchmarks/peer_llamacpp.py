"""pask beside llama.cpp on the same GGUF, the same prompts and the same machine (issue 33, item 6).

    .venv/bin/python benchmarks/peer_llamacpp.py [--lengths 2048,8192,32768] [--concurrency 1,8]
        [--kv f16,q8_0,q4_0] [--policies full,kivi-4,pask@0.25] [--weights int8] [--threads 2]
        [--new-tokens 64] [--bfcl 40] [--skip-speed] [--out NAME]

Needs ``llama-cpp-python==0.3.36`` (and ``diskcache``), the optional ``peer`` extra, kept out of
``make test``: ``pip install llama-cpp-python==0.3.36 diskcache`` builds its sdist here (~15 min on 2
cores, ``-march=native``, so a wheel built on the AMX Intel does not run on the AVX2 AMD). Without it
the script exits 2.

**Speed.** For each input length a tool-calling prompt is built as ``pask bench serve`` builds it
(BFCL test tools and questions after a history of earlier ones, ``tool_choice`` required), and both
engines get the same token ids. Each engine prefills it once (timed: prompt tok/s), copies the
prefilled sequence into ``c`` rows (llama.cpp: ``llama_memory_seq_cp`` into separate streams;
pask: its prefill store) and decodes all rows together under the tool-call grammar, greedy, up to
``--new-tokens`` tokens (decode tok/s = generated tokens / decode wall time). llama.cpp runs with
flash attention on, ``n_seq_max = c`` and ``kv_unified`` off (one KV stream per sequence, so a
copied prefix is held ``c`` times as pask holds it), its KV cache in f16, q8_0 or q4_0; pask with
the weights of ``--weights`` and Full KV, KIVI-4 and PASK. KV bytes: llama.cpp's per cell (its
type's block size: f16 2 bytes, q8_0 34/32, q4_0 18/32 per element) times the cells held; pask's
measured from the tensors it holds at the end of the decode (``budget.held_bytes``).
llama.cpp runs in a child process (two OpenMP runtimes in one process compete), alternating with
pask length by length.

**Accuracy.** The first ``--bfcl`` BFCL ``simple`` test cases, grammar-constrained, greedy, scored by
pask's checker (:class:`pask.tasks.bfcl.BfclTask`): llama.cpp with each KV type under the same
tool-call grammar converted to GBNF (llama.cpp's own JSON-schema converter), and pask's policies
through its evaluation runner.

Whether llama.cpp used its AMX / repacked CPU paths is read off its own load log and system info
and recorded. Writes ``benchmarks/results/<out>.{json,md}`` with provenance.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "results"
LLAMA_KV = {"f16": (1, 2.0), "q8_0": (8, 34 / 32), "q4_0": (2, 18 / 32)}  # ggml type, bytes per element
INSTALL = (
    "pip install llama-cpp-python==0.3.36 diskcache (or the peer extra: pip install -e '.[peer]'); "
    "an sdist: ~15 min to build on 2 cores"
)


# -- llama.cpp side (child process) ----------------------------------------------------------------
def tool_gbnf(tools: list[dict]) -> str:
    """pask's tool-call grammar (:func:`pask.tasks.function_calling.build_grammar`) as GBNF: one call
    block, then more, each later opening marker optional; the JSON body by llama.cpp's converter."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    from pask.tasks.function_calling import call_schema

    schema = {"anyOf": [call_schema(t) for t in tools]} if len(tools) > 1 else call_schema(tools[0])
    body = json_schema_to_gbnf(json.dumps(schema))
    body = re.sub(r"^root ::=", "call-body ::=", body, count=1, flags=re.M)
    if re.search(r"(?<![\w-])root(?![\w-])", body):
        raise RuntimeError("the converted schema refers to its root rule")
    head = (
        'root ::= "<tool_call>\\n" call-body "\\n</tool_call>" '
        '("\\n" "<tool_call>\\n"? call-body "\\n</tool_call>")* "\\n"?\n'
    )
    return head + body


class LlamaEngine:
    """One llama.cpp model and context, driven through the C API (``llama_cpp.llama_cpp``)."""

    def __init__(self, gguf: str, kv: str, threads: int, n_ctx: int, n_seq: int, extra_bufts: bool) -> None:
        import llama_cpp as L

        self.L, self.log = L, []

        @L.llama_log_callback
        def _log(level, text, user_data):
            self.log.append(text.decode(errors="replace"))

        self._log_cb = _log  # kept alive while the library may call it
        L.llama_log_set(_log, ctypes.c_void_p())
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = extra_bufts  # the AMX and repacked weight layouts
        self.model = L.llama_model_load_from_file(gguf.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.vocab = L.llama_model_get_vocab(self.model)
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, 2048, 512, n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cp.type_k = cp.type_v = LLAMA_KV[kv][0]
        cp.kv_unified = False
        cp.no_perf = False
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context (n_ctx {n_ctx}, {n_seq} sequences, kv {kv})")
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(2048, 0, 1)

    def close(self) -> None:
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        b = self.batch
        b.n_tokens = len(items)
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def prefill(self, ids: list[int], seq: int = 0) -> float:
        """Prefill ``ids`` into sequence ``seq``; the wall seconds."""
        t = time.perf_counter()
        for s in range(0, len(ids), 2048):
            chunk = ids[s : s + 2048]
            last = s + len(chunk) == len(ids)
            self._decode([(tok, s + i, seq, last and i == len(chunk) - 1) for i, tok in enumerate(chunk)])
        return time.perf_counter() - t

    def piece(self, tok: int) -> str:
        buf = ctypes.create_string_buffer(256)
        n = self.L.llama_token_to_piece(self.vocab, tok, buf, len(buf), 0, True)
        return buf.raw[: max(n, 0)].decode(errors="replace")

    def generate(
        self, prompt_len: int, rows: int, gbnf: str | None, max_new: int
    ) -> tuple[list[list[int]], float, int]:
        """Greedy decode of ``rows`` sequences (0..rows-1, each holding the prompt), under ``gbnf`` when
        given; returns (tokens per row, decode wall seconds, decode steps). The first token of each row
        comes from the prefill's logits (copied rows share them)."""
        L = self.L
        samplers = []
        for _ in range(rows):
            chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
            if gbnf is not None:
                g = L.llama_sampler_init_grammar(self.vocab, gbnf.encode(), b"root")
                if not g:
                    raise RuntimeError("llama.cpp refused the grammar")
                L.llama_sampler_chain_add(chain, g)
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
            samplers.append(chain)
        out: list[list[int]] = [[] for _ in range(rows)]
        live = list(range(rows))
        idx = {r: -1 for r in range(rows)}  # logits index per row (-1: the last output)
        steps, t = 0, time.perf_counter()
        try:
            while live:
                nxt = []
                for r in live:
                    tok = L.llama_sampler_sample(samplers[r], self.ctx, idx[r])
                    if L.llama_vocab_is_eog(self.vocab, tok):
                        continue
                    out[r].append(tok)
                    if len(out[r]) < max_new:
                        nxt.append((r, tok))
                if not nxt:
                    break
                self._decode([(tok, prompt_len + len(out[r]) - 1, r, True) for r, tok in nxt])
                idx = {r: i for i, (r, _) in enumerate(nxt)}
                live = [r for r, _ in nxt]
                steps += 1
        finally:
            for s in samplers:
                L.llama_sampler_free(s)
        return out, time.perf_counter() - t, steps


def llama_worker(spec: dict) -> dict:
    """Run one engine configuration from ``spec`` (see :func:`run_llama`)."""
    import llama_cpp as L

    n_ctx = spec["rows"] * (spec["ctx"] + 16)
    eng = LlamaEngine(spec["gguf"], spec["kv"], spec["threads"], n_ctx, spec["rows"], spec["extra_bufts"])
    res: dict = {"system_info": L.llama_print_system_info().decode(errors="replace")}
    try:
        if spec["mode"] == "speed":
            ids = spec["ids"]
            res["prefill_s"] = eng.prefill(ids, 0)
            for r in range(1, spec["rows"]):
                L.llama_memory_seq_cp(eng.mem, 0, r, -1, -1)
            gbnf = tool_gbnf(spec["tools"]) if spec.get("grammar", True) else None
            toks, dec_s, steps = eng.generate(len(ids), spec["rows"], gbnf, spec["new_tokens"])
            res.update(decode_s=dec_s, steps=steps, generated=sum(len(t) for t in toks))
            res["text"] = "".join(eng.piece(t) for t in toks[0])
        else:  # accuracy: one case after another, sequence 0
            texts = []
            for case in spec["cases"]:
                L.llama_memory_clear(eng.mem, True)
                eng.prefill(case["ids"], 0)
                toks, _, _ = eng.generate(len(case["ids"]), 1, tool_gbnf(case["tools"]), spec["new_tokens"])
                stop = "length" if len(toks[0]) >= spec["new_tokens"] else "grammar"
                texts.append({"id": case["id"], "text": "".join(eng.piece(t) for t in toks[0]), "stop": stop})
            res["cases"] = texts
    finally:
        eng.close()
    log = "".join(eng.log)
    res["paths"] = sorted({m.group(0) for m in re.finditer(r"(AMX|CPU_REPACK|REPACK)[^\n]{0,60}", log)})
    res["log_tail"] = log[-3000:]
    return res


# What the llama.cpp runs found: "extra_bufts" (whether its extra buffer types ran; absent: not tried
# yet), "crashed" (they crashed and the runs went on without them), "info" (the last run's system
# info, CPU paths and log tail)
_LLAMA: dict[str, Any] = {}


def run_llama(spec: dict, timeout: float) -> dict:
    """:func:`llama_worker` in a child process (its own OpenMP runtime), ``spec`` through a file.

    llama.cpp's extra buffer types (its AMX and repacked weight layouts) are tried first; a build
    whose AMX kernel crashes on this model (SIGSEGV in ``ggml_backend_amx_mul_mat``, seen with the
    Q4_K / Q6_K tensors of qwen2.5-coder-0.5b's GGUF) is rerun without them, and the result says so."""
    tries = [_LLAMA["extra_bufts"]] if "extra_bufts" in _LLAMA else [True, False]
    for extra in tries:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "spec.json"
            path.write_text(json.dumps({**spec, "extra_bufts": extra}))
            out = Path(d) / "out.json"
            cmd = [sys.executable, __file__, "--worker", str(path), "--worker-out", str(out)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            if proc.returncode == 0:
                _LLAMA["extra_bufts"] = extra
                res = json.loads(out.read_text())
                _LLAMA["info"] = {k: res.get(k) for k in ("system_info", "paths", "log_tail")}
                return res
            if proc.returncode != -11 or not extra:
                raise RuntimeError(f"llama.cpp worker failed ({proc.returncode}): {proc.stderr[-2000:]}")
            print("llama.cpp crashed (SIGSEGV) with its AMX / repacked weights; rerunning without them", flush=True)
            _LLAMA["crashed"] = True
    raise AssertionError("unreachable")


# -- pask side ------------------------------------------------------------------------------------
def pask_policy(spec: str, lm):
    """``full`` / ``kivi-4`` / ``pask@B`` (the committed BFCL table of B) as a fresh KV policy."""
    from pask.errors import PaskError
    from pask.policies.factory import policy_from_spec

    try:  # no fingerprint check: the tables were calibrated on bf16 weights, --weights may differ
        return policy_from_spec(spec, lm.name)
    except PaskError as e:
        raise SystemExit(f"peer_llamacpp: {e}") from None


def pask_speed(lm, body: dict, model: str, policy_spec: str, rows: int, new_tokens: int, store) -> dict:
    """Prefill once, computed (timed), then ``rows`` copies decoded together (the first prefill of them
    fills the store, the others load from it)."""
    from pask.runtime.engine import run_jobs
    from pask.runtime.scheduler import Job
    from pask.serving.protocol import attach_tagging, build_chat_request

    def job(i: int) -> Job:  # a fresh request each: a compiled grammar's state is the request's own
        chat = build_chat_request(body, lm.tokenizer, model)
        attach_tagging(chat, lm.tokenizer)
        chat.request.max_new_tokens = new_tokens
        return Job(id=str(i), request=chat.request)

    policy = pask_policy(policy_spec, lm)
    (first,) = run_jobs(lm, [job(0)], policy, store=None)  # the timed prefill, computed
    jobs = run_jobs(lm, [job(i) for i in range(rows)], policy, store=store)  # all admitted, then decoded together
    budget = jobs[0].budget or {}
    return {
        "prefill_s": first.prefill_ms / 1000,
        "decode_s": max(j.decode_ms for j in jobs) / 1000,  # the batched decode steps (Job.decode_ms)
        "steps": max(j.decode_steps for j in jobs),
        "generated": sum(len(j.generated) for j in jobs),
        "measured_b": budget.get("b_total"),
        "held_bytes": budget.get("held_bytes", 0) * rows,
        "text": jobs[0].result.text,
    }


def main() -> None:
    if not {"-h", "--help", "--worker"} & set(sys.argv):
        try:  # before pask (and torch) load: the refusal is immediate
            import llama_cpp  # noqa: F401
        except ImportError:
            print(f"peer_llamacpp: llama-cpp-python is not installed: {INSTALL}", file=sys.stderr)
            raise SystemExit(2) from None
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--lengths", default="2048,8192,32768")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--kv", default="f16,q8_0,q4_0")
    ap.add_argument("--policies", default="full,kivi-4,pask@0.25")
    ap.add_argument("--weights", default="int8", choices=["bf16", "int8", "int4"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--bfcl", type=int, default=40, help="BFCL simple test cases for the accuracy part (0: none)")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument(
        "--llama-unconstrained",
        action="store_true",
        help="also time llama.cpp without the grammar (greedy over the whole vocabulary), per --kv: "
        "separates its grammar sampler from its engine",
    )
    ap.add_argument(
        "--adopt-speed",
        help="JSON lines of speed rows printed by an earlier run (kept with it under benchmarks/results/), "
        "recorded with --adopt-version, instead of running the speed part",
    )
    ap.add_argument("--adopt-version", help="the code version (commit) that produced --adopt-speed's rows")
    ap.add_argument("--out", default="peer_llamacpp")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    from pask.experiments.provenance import add_allow_dirty

    add_allow_dirty(ap)
    args = ap.parse_args()
    if args.worker:
        Path(args.worker_out).write_text(json.dumps(llama_worker(json.loads(Path(args.worker).read_text()))))
        return
    kvs = [k for k in args.kv.split(",") if k]
    if bad := [k for k in kvs if k not in LLAMA_KV]:
        ap.error(f"--kv: unknown {bad} (known: {', '.join(LLAMA_KV)})")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    concs = [int(x) for x in args.concurrency.split(",") if x]
    policies = [p for p in args.policies.split(",") if p]
    if any(n < 64 for n in lengths) or any(c < 1 for c in concs) or args.new_tokens < 1 or args.threads < 1:
        ap.error("lengths >= 64, concurrency >= 1, --new-tokens >= 1, --threads >= 1")
    if args.adopt_speed and not args.adopt_version:
        ap.error("--adopt-speed needs --adopt-version (the commit that produced the rows)")
    if os.environ.get("PASK_PREFILL_STORE", "").strip():  # pask's timed prefill would load from it
        ap.error("unset $PASK_PREFILL_STORE: pask's timed prefill must be computed (the script keeps its own store)")

    from pask.experiments.provenance import check_clean, write_result

    check_clean(OUT / args.out, args.allow_dirty)
    import torch

    from pask.bench.serving import BenchConfig, build_bodies, decode_linears
    from pask.runtime.capacity import kv_bytes_per_token
    from pask.runtime.models import embedded_gguf, load_model
    from pask.runtime.prefill_store import PrefillStore
    from pask.serving.protocol import build_chat_request

    torch.set_num_threads(args.threads)
    gguf = str(embedded_gguf(args.model))
    lm = load_model(args.model, weights=args.weights)
    tok = lm.tokenizer
    per_token = kv_bytes_per_token(lm.model.config, torch.bfloat16)  # bf16 K and V of every layer
    rows: list[dict] = []
    adopted = None
    if args.adopt_speed:
        lines = Path(args.adopt_speed).read_text().splitlines()
        rows = [json.loads(x) for x in lines if x.startswith('{"engine"') and '"prompt_tok_s"' in x]
        rows = [{**r, "code_version": args.adopt_version} for r in rows]
        adopted = {"file": args.adopt_speed, "code_version": args.adopt_version, "rows": len(rows)}
        args.skip_speed = True
    with tempfile.TemporaryDirectory() as store_dir:
        store = PrefillStore(store_dir, lm.model)
        for n in [] if args.skip_speed else lengths:
            (body,) = build_bodies(
                tok, args.model, 1, BenchConfig(concurrency=1, input_len=n, output_len=args.new_tokens)
            )
            chat = build_chat_request(body, tok, args.model)
            ids = list(chat.request.prompt_ids)
            for c in concs:
                for kv in kvs:
                    spec = _spec("speed", gguf, kv, args.threads, c, len(ids) + args.new_tokens, ids=ids)
                    spec.update(tools=chat.tools, new_tokens=args.new_tokens)
                    r = run_llama(spec, timeout=7200)
                    held = c * (len(ids) + r["generated"] // c) * per_token * LLAMA_KV[kv][1] / 2
                    rows.append(_row("llama.cpp", f"kv {kv}", n, len(ids), c, r, held, LLAMA_KV[kv][1] / 2))
                    print(json.dumps(rows[-1]), flush=True)
                    if args.llama_unconstrained:
                        r = run_llama({**spec, "grammar": False}, timeout=7200)
                        held = c * (len(ids) + r["generated"] // c) * per_token * LLAMA_KV[kv][1] / 2
                        setting = f"kv {kv}, no grammar"
                        rows.append(_row("llama.cpp", setting, n, len(ids), c, r, held, LLAMA_KV[kv][1] / 2))
                        print(json.dumps(rows[-1]), flush=True)
                for p in policies:
                    r = pask_speed(lm, body, args.model, p, c, args.new_tokens, store)
                    rows.append(_row("pask", p, n, len(ids), c, r, r["held_bytes"], r["measured_b"]))
                    print(json.dumps(rows[-1]), flush=True)
        accuracy = _accuracy(args, lm, gguf, kvs, policies) if args.bfcl else []
    llama_info = {**_LLAMA.get("info", {}), "extra_bufts": _LLAMA.get("extra_bufts")}
    llama_info["extra_bufts_crashed"] = bool(_LLAMA.get("crashed"))
    data = {
        "model": args.model,
        "weights": args.weights,
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "speed": rows,
        "speed_adopted": adopted,
        "accuracy": accuracy,
        "llama_cpp": llama_info,
        "pask_decode_linears": decode_linears(lm.model),
    }
    command = "python benchmarks/peer_llamacpp.py " + shlex.join(sys.argv[1:])
    write_result(OUT / args.out, data, markdown(data), command=command, allow_dirty=args.allow_dirty)


def _spec(mode: str, gguf: str, kv: str, threads: int, rows: int, ctx: int, **more) -> dict:
    """A llama.cpp worker's job (:func:`llama_worker`): ``ctx`` tokens per row, ``rows`` sequences."""
    return {"mode": mode, "gguf": gguf, "kv": kv, "threads": threads, "rows": rows, "ctx": ctx, **more}


def _row(engine: str, setting: str, n: int, prompt: int, c: int, r: dict, held, b) -> dict:
    return {
        "engine": engine,
        "setting": setting,
        "input": n,
        "prompt_tokens": prompt,
        "concurrency": c,
        "prompt_tok_s": prompt / r["prefill_s"],
        "decode_tok_s": c * r["steps"] / r["decode_s"] if r["decode_s"] and r["steps"] else None,
        "generated": r["generated"],
        "steps": r["steps"],
        "kv_bytes": held,
        "b": b,
        "text": r["text"][:200],
    }


def _accuracy(args, lm, gguf: str, kvs: list[str], policies: list[str]) -> list[dict]:
    """BFCL simple, the first ``args.bfcl`` test cases: llama.cpp per KV type, pask per policy."""
    from pask.evaluation.runner import run_task
    from pask.tasks.base import Output
    from pask.tasks.function_calling import parse_calls
    from pask.tasks.registry import get_task

    task = get_task("bfcl")
    cases = task.cases("test", limit=args.bfcl, categories=["simple"])
    reqs = [(c, task.request(c, lm.tokenizer)) for c in cases]
    payload = [{"id": c.id, "ids": list(r.prompt_ids), "tools": c.tools} for c, r in reqs]
    n_ctx = max(len(p["ids"]) for p in payload) + task.default_max_new_tokens
    out = []
    for kv in kvs:
        spec = _spec("accuracy", gguf, kv, args.threads, 1, n_ctx, cases=payload)
        spec["new_tokens"] = task.default_max_new_tokens
        res = run_llama(spec, timeout=7200)
        ok, ids = 0, []
        for (case, _), row in zip(reqs, res["cases"], strict=True):
            parsed, err = None, None
            try:
                parsed = parse_calls(row["text"], case.name_map)
            except Exception as e:
                err = str(e)
            checked = task.check(case, Output(row["text"], row["stop"], parsed, err))
            ok += bool(checked["correct"])
            ids.append([case.id, bool(checked["correct"])])
        out.append(
            {
                "engine": "llama.cpp",
                "setting": f"kv {kv}",
                "accuracy": 100 * ok / len(cases),
                "b": LLAMA_KV[kv][1] / 2,
                "cases": ids,
            }
        )
        print(json.dumps(out[-1])[:300], flush=True)
    for p in policies:
        with tempfile.TemporaryDirectory() as d:
            summary = run_task(task, lm, cases, Path(d), batch_size=8, policy=pask_policy(p, lm), batching="continuous")
            rows = [json.loads(x) for x in (Path(d) / "cases.jsonl").read_text().splitlines()]
        out.append(
            {
                "engine": "pask",
                "setting": p,
                "accuracy": summary["overall"]["accuracy"],
                "b": summary.get("measured_b"),
                "cases": [[r["id"], bool(r["correct"])] for r in rows],
            }
        )
        print(json.dumps(out[-1])[:300], flush=True)
    return out


def _bufts(info: dict) -> str:
    if info.get("extra_bufts"):
        return "on"
    return "off (they crashed with SIGSEGV on this model)" if info.get("extra_bufts_crashed") else "off"


def markdown(d: dict) -> str:
    lines = [
        f"# pask beside llama.cpp ({d['model']}, pask weights {d['weights']}, {d['threads']} threads)",
        "",
        f"pask's decode linears: {d['pask_decode_linears']}. llama.cpp's CPU paths from its log: "
        f"{', '.join(d['llama_cpp'].get('paths') or ['none named'])}; its extra buffer types (AMX / repacked "
        f"weights): {_bufts(d['llama_cpp'])}.",
        "",
    ]
    if d.get("speed_adopted"):
        a = d["speed_adopted"]
        lines += [f"Speed rows adopted from `{a['file']}` ({a['rows']} rows, made at {a['code_version']}).", ""]
    if d["speed"]:
        lines += [
            "| input | c | engine | KV | B | prompt tok/s | decode tok/s | KV MB | generated |",
            "|---:|---:|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in d["speed"]:
            b = "–" if r["b"] is None else f"{r['b']:.3f}"
            kvmb = "–" if r["kv_bytes"] is None else f"{r['kv_bytes'] / 1e6:.1f}"
            dec = "–" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.2f}"
            lines.append(
                f"| {r['input']} | {r['concurrency']} | {r['engine']} | {r['setting']} | {b} | "
                f"{r['prompt_tok_s']:.1f} | {dec} | {kvmb} | {r['generated']} |"
            )
    if d["accuracy"]:
        lines += [
            "",
            "BFCL simple, first test cases, pask's checker:",
            "",
            "| engine | KV | B | accuracy |",
            "|---|---|---:|---:|",
        ]
        for r in d["accuracy"]:
            b = "–" if r["b"] is None else f"{r['b']:.3f}"
            lines.append(f"| {r['engine']} | {r['setting']} | {b} | {r['accuracy']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
