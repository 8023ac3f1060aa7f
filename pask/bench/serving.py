"""Loopback serving benchmark: TPOT, throughput and peak KV bytes per policy, relative to Full KV.

For each policy a server (:mod:`pask.serving.server`) runs on a free loopback port in this
process; ``concurrency`` client threads send chat-completion requests in a closed loop
(``requests_per_client`` each, bounded in time too). Inputs are real BFCL tool sets and questions
(test split), preceded by a conversation history of earlier BFCL questions and their reference
tool calls until the prompt reaches ``input_len`` tokens; ``tool_choice`` is ``required`` and
``max_tokens`` is ``output_len``.

Reported per policy (paper Tables 13/14 layout): measured B, TPOT (server-side, per request, as a
user sees it: it includes the stalls while other requests are prefilled), the decode-step time
(mean wall time of the batched decode forwards, with the policy's decisions, that a request took
part in: what the bandwidth model describes; and its median over the steps at the full batch,
``concurrency`` requests, which does not depend on how many steps ran at smaller batches while
requests arrived or left), throughput (generated tokens per second of wall
time), peak KV bytes held, each relative to Full KV in the same run, and the bandwidth-model limit
of the speed-up: the bytes one decode step reads, ``weights + c x context x KV bytes per token x
B``, Full over the policy, at the mean decode context ``input_len + output_len / 2``. With a fixed
``capacity_tokens`` (Table 3 setting) the peak number of concurrent requests shows the admission
effect. Prefills run one at a time in the scheduler's thread, so the wall time splits into summed
prefill time and the rest; the decode throughput (generated tokens per second outside prefills) is
where admitting more requests pays, and it is reported next to the end-to-end throughput.
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jsonschema

from pask.errors import PaskError
from pask.runtime.capacity import kv_bytes_per_token
from pask.runtime.models import LoadedModel
from pask.tasks.function_calling import NON_LIVE, FunctionCase, build_prompt, load_cases

REF_POLICY = "full"
MAX_BODIES = 256


@dataclass
class BenchConfig:
    """Load shape of one benchmark run."""

    concurrency: int = 8
    input_len: int = 8192
    output_len: int = 256
    requests_per_client: int = 2
    capacity_tokens: int | None = None
    max_seconds: float = 3600.0  # per policy: no new request after this
    seed: int = 0
    sample_every: float = 0.0  # seconds between memory samples (0: none); the soak test's flatness check

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.requests_per_client < 1:
            raise PaskError("concurrency and requests per client must be >= 1")
        if self.input_len < 64 or self.output_len < 1:
            raise PaskError("input length must be >= 64 tokens and output length >= 1")
        if self.sample_every < 0 or self.max_seconds <= 0:
            raise PaskError("sample_every must be >= 0 and max_seconds > 0")


@dataclass
class PolicyResult:
    """What one policy's run measured."""

    policy: str
    requests: int = 0
    errors_5xx: int = 0
    errors_other: int = 0
    malformed: int = 0  # tool calls that do not validate against their schemas
    prompt_tokens_mean: float = 0.0
    completion_tokens: int = 0
    wall_s: float = 0.0
    tpot_ms: float = 0.0  # mean per-request TPOT (server side; includes stalls for other requests' prefills)
    step_ms: float = 0.0  # mean per-request decode-step time (batched forward + policy; no prefills)
    step_ms_at_c: float | None = None  # median decode-step time of the steps at batch = concurrency
    steps_at_c: int = 0  # how many steps ran at batch = concurrency
    throughput_tps: float = 0.0  # generated tokens per second of wall time
    prefill_s: float = 0.0  # summed prefill time (prefills run one at a time in the scheduler's thread)
    decode_tps: float = 0.0  # generated tokens per second of wall time outside prefills
    peak_kv_bytes: int = 0
    peak_running: int = 0
    b_final: float | None = None  # held / full bytes of the finished requests at their end
    b_avg: float | None = None  # mean per-request time-averaged B
    memory: dict | None = None  # soak samples and the flatness summary (see :func:`memory_summary`)
    extra: dict = field(default_factory=dict)


# -- memory over time (soak test) ----------------------------------------------------------------
def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc``; 0 where it cannot be read)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class MemorySampler:
    """Background thread recording ``(seconds, RSS bytes, KV bytes held, running requests)``."""

    def __init__(self, scheduler, every: float) -> None:
        self.scheduler, self.every = scheduler, every
        self.samples: list[tuple[float, int, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.perf_counter()

    def _run(self) -> None:
        while not self._stop.is_set():
            sch = self.scheduler
            try:  # read while the scheduler thread steps: a torn read is skipped, not fatal
                held, running = (sch.cache.held_bytes() if sch.running else 0), len(sch.running)
            except Exception:
                held, running = -1, -1
            if held >= 0:
                self.samples.append((time.perf_counter() - self._t0, rss_bytes(), held, running))
            self._stop.wait(self.every)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def memory_summary(samples: list[tuple[float, int, int, int]], warmup: float = 0.2) -> dict:
    """Flatness after warm-up: peak RSS and KV bytes in the first and second half of the post-warm-up samples.

    ``rss_growth`` is the second half's peak RSS over the first half's (1.0 = flat); a leak shows
    as growth that a bounded KV (``kv_peak_*``) does not explain.
    """
    if len(samples) < 4:
        return {"samples": samples, "rss_growth": None}
    t_end = samples[-1][0]
    post = [s for s in samples if s[0] >= warmup * t_end]
    half = len(post) // 2
    first, second = post[:half], post[half:]
    rss1, rss2 = max(s[1] for s in first), max(s[1] for s in second)
    return {
        "samples": samples,
        "warmup_s": warmup * t_end,
        "rss_peak_first_mib": rss1 / 2**20,
        "rss_peak_second_mib": rss2 / 2**20,
        "rss_growth": rss2 / rss1 if rss1 else None,
        "kv_peak_first_mib": max(s[2] for s in first) / 2**20,
        "kv_peak_second_mib": max(s[2] for s in second) / 2**20,
    }


# -- inputs ------------------------------------------------------------------------------------
def _reference_call(case: FunctionCase) -> str | None:
    """A tool-call block from the case's first possible answer (None if it has none)."""
    if not case.possible_answer:
        return None
    blocks = []
    back = {v: k for k, v in case.name_map.items()}
    for call in case.possible_answer:
        ((name, params),) = call.items()
        args = {k: next((x for x in v if x != ""), None) for k, v in params.items()}
        args = {k: v for k, v in args.items() if v is not None}
        blocks.append(f"<tool_call>\n{json.dumps({'name': back.get(name, name), 'arguments': args})}\n</tool_call>")
    return "\n".join(blocks)


def _question(case: FunctionCase) -> str:
    return "\n".join(m["content"] for m in case.messages if m.get("role") == "user")


def build_bodies(tok, model: str, n: int, cfg: BenchConfig) -> list[dict]:
    """``n`` chat-completion bodies of about ``cfg.input_len`` prompt tokens (see the module docstring)."""
    cases = [c for c in load_cases(list(NON_LIVE), split="test") if c.tools]
    rng = random.Random(cfg.seed)
    history_pool = [(c, _reference_call(c)) for c in cases]
    history_pool = [(c, a) for c, a in history_pool if a]
    bodies = []
    for _ in range(n):
        case = cases[rng.randrange(len(cases))]
        last = [{"role": "user", "content": _question(case)}]
        base = len(tok(build_prompt(tok, FunctionCase("b", "b", last, [], tools=case.tools)))["input_ids"])
        history: list[dict] = []
        total = base
        while True:
            past, answer = history_pool[rng.randrange(len(history_pool))]
            turn = [
                {"role": "user", "content": _question(past)},
                {"role": "assistant", "content": answer},
                {"role": "user", "content": 'Tool results: {"status": "ok"}. Thanks.'},
                {"role": "assistant", "content": "Done."},
            ]
            cost = sum(len(tok(m["content"])["input_ids"]) + 5 for m in turn)
            if total + cost > cfg.input_len:
                break
            history += turn
            total += cost
        history += _filler(tok, [_question(c) for c, _ in history_pool[:50]], cfg.input_len - total - 12)
        bodies.append(
            {
                "model": model,
                "messages": history + last,
                "tools": case.tools,
                "tool_choice": "required",
                "max_tokens": cfg.output_len,
            }
        )
    return bodies


def _filler(tok, texts: list[str], tokens: int) -> list[dict]:
    """One more user/assistant exchange of about ``tokens`` tokens (earlier questions, cut to fit)."""
    if tokens < 16:
        return []
    ids = tok(" ".join(texts))["input_ids"]
    while len(ids) < tokens:
        ids = ids + ids
    return [
        {"role": "user", "content": "Earlier questions: " + tok.decode(ids[: tokens - 8])},
        {"role": "assistant", "content": "Noted."},
    ]


def _malformed(body: dict, out: dict) -> bool:
    msg = out["choices"][0]["message"]
    if out["choices"][0]["finish_reason"] == "length" and not msg.get("tool_calls"):
        return False  # cut by the token limit: not a format error of the server
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in body["tools"]}
    for call in msg.get("tool_calls") or []:
        fn = call["function"]
        try:
            jsonschema.validate(json.loads(fn["arguments"]), schemas[fn["name"]])
        except (KeyError, json.JSONDecodeError, jsonschema.ValidationError):
            return True
    return not msg.get("tool_calls")


# -- one policy --------------------------------------------------------------------------------
def run_policy(
    lm: LoadedModel,
    name: str,
    factory: Callable,
    bodies: list[dict],
    cfg: BenchConfig,
    progress: Callable[[], None] | None = None,
) -> PolicyResult:
    """Serve ``lm`` with one policy on a loopback port and drive it with ``cfg.concurrency`` clients.

    ``progress`` is called as each request is sent.
    """
    import httpx2 as httpx

    from pask.cpu import openmp
    from pask.serving.server import Limits, Service, serve_in_thread

    # a load test measures the decode, not the server's guards: no deadline, room for every client
    limits = Limits(request_timeout=None, max_queue=max(64, 2 * cfg.concurrency))
    service = Service.build(lm, factory, cfg.capacity_tokens, default_max_tokens=cfg.output_len, limits=limits)
    openmp.release_pool()  # whatever this thread ran in parallel since: see pask.cpu.openmp
    try:
        with serve_in_thread(service) as base:
            return _drive(service, f"{base}/v1/chat/completions", name, cfg, bodies, progress, httpx)
    except PaskError as e:
        raise PaskError(f"the benchmark server for '{name}': {e}") from None


def _drive(service, url: str, name: str, cfg: BenchConfig, bodies: list[dict], progress, httpx) -> PolicyResult:
    """Drive the served policy at ``url`` with ``cfg.concurrency`` closed-loop clients."""
    res = PolicyResult(name)
    lock = threading.Lock()
    outs: list[dict] = []
    with httpx.Client(timeout=None) as c:  # warm-up (grammar kernels, first allocations)
        c.post(url, json={**bodies[0], "max_tokens": 2, "messages": bodies[0]["messages"][-1:]})
    service.scheduler.peak_held_bytes = service.scheduler.peak_running = 0
    service.scheduler.step_log.clear()
    stop_at = time.time() + cfg.max_seconds

    def client(k: int) -> None:
        with httpx.Client(timeout=None) as c:
            for j in range(cfg.requests_per_client):
                if time.time() > stop_at:
                    return
                body = bodies[(k * cfg.requests_per_client + j) % len(bodies)]
                if progress:
                    progress()
                r = c.post(url, json=body)
                with lock:
                    res.requests += 1
                    if r.status_code >= 500:
                        res.errors_5xx += 1
                    elif r.status_code != 200:
                        res.errors_other += 1
                    else:
                        out = r.json()
                        outs.append(out)
                        res.malformed += _malformed(body, out)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(cfg.concurrency)]
    sampler = MemorySampler(service.scheduler, cfg.sample_every) if cfg.sample_every else None
    with sampler or contextlib.nullcontext():
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    res.wall_s = time.perf_counter() - t0
    if sampler:
        res.memory = memory_summary(sampler.samples)
    sch = service.scheduler
    res.peak_kv_bytes, res.peak_running = sch.peak_held_bytes, sch.peak_running
    res.b_final = sch.snapshot()["b_finished"]
    at_c = list(sch.step_log.get(cfg.concurrency, ()))
    res.steps_at_c = len(at_c)
    res.step_ms_at_c = statistics.median(at_c) if at_c else None
    if outs:
        res.completion_tokens = sum(o["usage"]["completion_tokens"] for o in outs)
        res.prompt_tokens_mean = sum(o["usage"]["prompt_tokens"] for o in outs) / len(outs)
        res.tpot_ms = sum(o["pask"]["tpot_ms"] for o in outs) / len(outs)
        res.step_ms = sum(o["pask"].get("step_ms", 0.0) for o in outs) / len(outs)
        res.throughput_tps = res.completion_tokens / res.wall_s if res.wall_s else 0.0
        res.prefill_s = sum(o["pask"].get("prefill_ms", 0.0) for o in outs) / 1e3
        decode_wall = res.wall_s - res.prefill_s
        res.decode_tps = res.completion_tokens / decode_wall if decode_wall > 0 else 0.0
        avgs = [o["pask"]["budget"]["b_total_avg"] for o in outs if o["pask"].get("budget")]
        res.b_avg = sum(avgs) / len(avgs) if avgs else None
    return res


# -- the run -----------------------------------------------------------------------------------
def bandwidth_limit(weight_bytes: int, kv_per_token: int, context: float, concurrency: int, b: float) -> float:
    """Decode-step bytes of Full KV over those at budget ``b`` (weights read once per step, KV per request)."""
    kv = concurrency * context * kv_per_token
    return (weight_bytes + kv) / (weight_bytes + kv * b)


def decode_linears(model) -> str:
    """What computes the decode steps' linear layers: the native bf16 GEMV (with its ISA) or PyTorch."""
    from pask.cpu import native_gemv

    n = getattr(model, "pask_bf16_gemv_linears", 0)
    return f"native bf16 GEMV ({native_gemv.isa()}, {n} layers)" if n else "PyTorch"


def bench_serve(
    lm: LoadedModel,
    factories: dict[str, Callable],
    cfg: BenchConfig,
    progress: Callable[[str], None] | None = None,
    on_request: Callable[[], None] | None = None,
    command: str | None = None,
    warm_prefills: bool = False,
) -> dict:
    """Run every policy (Full KV first, as the reference) and relate each to it; returns a JSON-able dict.

    ``progress`` gets each policy's name as it starts, ``on_request`` a call per request sent.
    ``warm_prefills``: first send every input once (``max_tokens`` 1, untimed) under the first
    policy, so that a prefill store (``$PASK_PREFILL_STORE``) holds them all and every timed policy
    loads its prompts instead of recomputing them: TPOT is then decode-bound, not dominated by
    serial prefills (the prefill store is what makes that equal for every policy).
    """
    if not factories:
        raise PaskError("the serving benchmark needs at least one policy")
    n = min(cfg.concurrency * cfg.requests_per_client, MAX_BODIES)  # a soak test cycles through them
    bodies = build_bodies(lm.tokenizer, lm.name, n, cfg)
    weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    per_token = kv_bytes_per_token(lm.model.config, next(lm.model.parameters()).dtype)
    results = {}
    order = [REF_POLICY] if REF_POLICY in factories else []
    names = [*order, *[p for p in factories if p != REF_POLICY]]
    if warm_prefills:
        from pask.runtime.prefill_store import PrefillStore

        if PrefillStore.from_env(lm.model) is None:
            raise PaskError("warm_prefills needs a prefill store ($PASK_PREFILL_STORE)")
        if progress:
            progress("(prefilling every input into the store)")
        run_policy(lm, "warm", factories[names[0]], [{**b, "max_tokens": 1} for b in bodies], cfg, on_request)
    for name in names:
        if progress:
            progress(name)
        results[name] = run_policy(lm, name, factories[name], bodies, cfg, on_request)
    ref = results.get(REF_POLICY)  # without Full KV in the run (a soak test) the ratios stay empty
    context = cfg.input_len + cfg.output_len / 2

    def rate(r: PolicyResult) -> float:
        return r.requests / r.wall_s if r.wall_s else 0.0

    rows = []
    for r in results.values():
        b = r.b_avg if r.b_avg is not None else 1.0
        limit = bandwidth_limit(weights, per_token, context, cfg.concurrency, b)
        speedup = ref.tpot_ms / r.tpot_ms if ref and r.tpot_ms else None
        step = ref.step_ms / r.step_ms if ref and r.step_ms else None
        step_c = ref.step_ms_at_c / r.step_ms_at_c if ref and ref.step_ms_at_c and r.step_ms_at_c else None
        rows.append(
            {
                **asdict(r),
                "tpot_speedup": speedup,
                "step_speedup": step,
                "step_at_c_speedup": step_c,
                "bandwidth_limit": limit,
                "share_of_limit": (speedup - 1) / (limit - 1) if speedup and limit > 1 + 1e-9 else None,
                "step_share_of_limit": (step - 1) / (limit - 1) if step and limit > 1 + 1e-9 else None,
                "throughput_gain": r.throughput_tps / ref.throughput_tps if ref and ref.throughput_tps else None,
                "decode_throughput_gain": r.decode_tps / ref.decode_tps if ref and ref.decode_tps else None,
                "request_rate": rate(r),  # requests finished per second of wall time
                "request_gain": rate(r) / rate(ref) if ref and rate(ref) else None,
                "peak_kv_ratio": r.peak_kv_bytes / ref.peak_kv_bytes if ref and ref.peak_kv_bytes else None,
            }
        )
    return {
        "model": lm.name,
        "config": asdict(cfg),
        "weight_bytes": weights,
        "kv_bytes_per_token": per_token,
        "decode_context": context,
        "prefills": "loaded from a prefill store filled before the timed runs" if warm_prefills else "computed",
        "decode_linears": decode_linears(lm.model),
        "policies": rows,
        "command": command,
    }


def markdown(result: dict) -> str:
    """Tables 13/14 layout: one row per policy, relative to Full KV in the same run."""
    cfg = result["config"]
    cap = cfg["capacity_tokens"] or "unlimited"
    head = (
        f"Serving, {result['model']}, c = {cfg['concurrency']}, input {cfg['input_len']}, output {cfg['output_len']}, "
        f"KV capacity {cap} tokens; prefills {result.get('prefills', 'computed')}"
        f"{'; decode linears: ' + result['decode_linears'] if result.get('decode_linears') else ''}\n\n"
        "| policy | B (avg) | TPOT ms | TPOT speed-up | step ms | step speed-up | step ms at batch c (steps) "
        "| x Full | bandwidth limit | throughput tok/s | x Full | tokens out | requests/s | x Full "
        "| prefill s | decode tok/s | x Full | peak KV MiB | x Full | peak concurrent | 5xx | malformed |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )

    def f(x, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    def fx(x) -> str:  # a ratio
        return "-" if x is None else f"{x:.2f}x"

    lines = [head]
    for r in result["policies"]:
        cells = [
            r["policy"],
            f(r["b_avg"], ".3f"),
            f(r["tpot_ms"], ".1f"),
            fx(r["tpot_speedup"]),
            f(r.get("step_ms"), ".1f"),
            fx(r.get("step_speedup")),
            f"{f(r.get('step_ms_at_c'), '.1f')} ({r.get('steps_at_c', 0)})",
            fx(r.get("step_at_c_speedup")),
            fx(r["bandwidth_limit"]),
            f(r["throughput_tps"], ".2f"),
            fx(r["throughput_gain"]),
            str(r["completion_tokens"]),
            f(r.get("request_rate"), ".3f"),
            fx(r.get("request_gain")),
            f(r.get("prefill_s"), ".1f"),
            f(r.get("decode_tps"), ".2f"),
            fx(r.get("decode_throughput_gain")),
            f(r["peak_kv_bytes"] / 2**20, ".1f"),
            fx(r["peak_kv_ratio"]),
            str(r["peak_running"]),
            str(r["errors_5xx"]),
            str(r["malformed"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    mem = [r for r in result["policies"] if r.get("memory") and r["memory"].get("rss_growth") is not None]
    if mem:
        lines += [
            "",
            "Memory after warm-up (peak RSS and KV bytes held, first vs second half of the run)",
            "",
            "| policy | warm-up s | RSS MiB first | RSS MiB second | RSS growth | KV MiB first | KV MiB second |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in mem:
            m = r["memory"]
            lines.append(
                f"| {r['policy']} | {m['warmup_s']:.0f} | {m['rss_peak_first_mib']:.0f} | "
                f"{m['rss_peak_second_mib']:.0f} | {m['rss_growth']:.3f}x | {m['kv_peak_first_mib']:.1f} | "
                f"{m['kv_peak_second_mib']:.1f} |"
            )
    if result.get("command"):
        lines += ["", f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


def write(result: dict, out: Path, allow_dirty: bool = False) -> tuple[Path, Path]:
    """``out``.json and ``out``.md with their provenance (:func:`pask.experiments.provenance.write_result`:
    refused into the committed results from a dirty code tree unless ``allow_dirty``)."""
    from pask.experiments.provenance import write_result

    return write_result(out, result, markdown(result), command=result.get("command"), allow_dirty=allow_dirty)
