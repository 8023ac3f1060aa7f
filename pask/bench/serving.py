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
B``, Full over the policy, at the mean decode context ``input_len + output_len / 2``. ``weights``
counts every linear layer and norm once, the embedding table not at all (a step reads a few of its
rows) and the LM head as the masked head measured it in the run (:mod:`pask.runtime.masked_head`:
under the grammar most steps' rows allow a few tokens, whose rows it gathers; the whole weight is
read only in a step with a wide row), each policy's own; without a masked head, the whole head. With a fixed
``capacity_tokens`` (Table 3 setting) the peak number of concurrent requests shows the admission
effect. Prefills run one at a time in the scheduler's thread, so the wall time splits into summed
prefill time and the rest; the decode throughput (generated tokens per second outside prefills) is
where admitting more requests pays, and it is reported next to the end-to-end throughput.

A hostile mix (``BenchConfig.mix``; default: every request valid) makes each request one of
``valid``, ``malformed`` (a rotating set of bad bodies, each of which must get a 4xx),
``cancel`` (streamed; the client closes the connection after a few content chunks or a short
random delay) or ``disconnect`` (not streamed; the client closes before the answer), drawn from a
seeded RNG per client. The server runs in this process, so the run also checks on its scheduler
that every cancelled or disconnected request's KV rows are freed (:class:`HostileMix`), that no
KV byte is held once the run is over, and reports a pass/fail line per acceptance criterion.
"""

from __future__ import annotations

import contextlib
import functools
import json
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import jsonschema

from pask.cpu.weights import step_weight_bytes
from pask.errors import PaskError
from pask.runtime.capacity import kv_bytes_per_token
from pask.runtime.masked_head import head_bytes
from pask.runtime.models import LoadedModel
from pask.tasks.function_calling import NON_LIVE, FunctionCase, build_prompt, load_cases

REF_POLICY = "full"
MAX_BODIES = 256
MIX_KINDS = ("valid", "malformed", "cancel", "disconnect")
MIN_ABORT_S = 0.05  # the shortest delay before a cancel / disconnect closes its connection
RSS_GROWTH_LIMIT = 1.05  # the soak's flatness criterion (second half's peak RSS over the first's)


def check_mix(mix: dict[str, float]) -> dict[str, float]:
    """The request mix, every kind of :data:`MIX_KINDS` present (PaskError if a kind is unknown, a
    fraction negative or not a number, or the fractions do not sum to 1 within 1e-6)."""
    for kind, share in mix.items():
        if kind not in MIX_KINDS:
            raise PaskError(f"--mix: unknown kind '{kind}' (kinds: {', '.join(MIX_KINDS)})")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not share >= 0 or share == float("inf"):
            raise PaskError(f"--mix: the fraction of '{kind}' must be a number >= 0, got {share!r}")
    total = sum(mix.values())
    if abs(total - 1.0) > 1e-6:
        raise PaskError(f"--mix: the fractions must sum to 1, they sum to {total:.6g}")
    return {k: float(mix.get(k, 0.0)) for k in MIX_KINDS}


def parse_mix(text: str) -> dict[str, float]:
    """``valid=0.7,malformed=0.1,cancel=0.1,disconnect=0.1`` -> the mix (see :func:`check_mix`); kinds
    left out get 0."""
    mix: dict[str, float] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        kind, eq, value = item.partition("=")
        kind = kind.strip()
        if not eq or not kind:
            raise PaskError(f"--mix: expected KIND=FRACTION items separated by commas, got '{item.strip()}'")
        if kind in mix:
            raise PaskError(f"--mix: '{kind}' is given twice")
        try:
            mix[kind] = float(value)
        except ValueError:
            raise PaskError(f"--mix: the fraction of '{kind}' must be a number, got '{value.strip()}'") from None
    if not mix:
        raise PaskError("--mix: no KIND=FRACTION item")
    return check_mix(mix)


@dataclass
class BenchConfig:
    """Load shape of one benchmark run.

    ``mix``: the share of each request kind (:data:`MIX_KINDS`; default all ``valid``: the plain
    load test); ``abort_within``: a cancel / disconnect closes its connection after a random delay
    in [:data:`MIN_ABORT_S`, ``abort_within``] seconds (a cancelled text stream also after 1-4
    content chunks); ``release_timeout``: seconds after that close within which the request's KV
    rows must be freed.
    """

    concurrency: int = 8
    input_len: int = 8192
    output_len: int = 256
    requests_per_client: int = 2
    capacity_tokens: int | None = None
    max_seconds: float = 3600.0  # per policy: no new request after this
    seed: int = 0
    sample_every: float = 0.0  # seconds between memory samples (0: none); the soak test's flatness check
    mix: dict[str, float] = field(default_factory=lambda: {"valid": 1.0})
    abort_within: float = 2.0
    release_timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.requests_per_client < 1:
            raise PaskError("concurrency and requests per client must be >= 1")
        if self.input_len < 64 or self.output_len < 1:
            raise PaskError("input length must be >= 64 tokens and output length >= 1")
        if self.sample_every < 0 or self.max_seconds <= 0:
            raise PaskError("sample_every must be >= 0 and max_seconds > 0")
        if not self.abort_within >= MIN_ABORT_S or not self.release_timeout > 0:
            raise PaskError(f"abort_within must be >= {MIN_ABORT_S} s and release_timeout > 0")
        self.mix = check_mix(self.mix)

    @property
    def hostile(self) -> bool:
        """Whether some requests are not plain valid ones."""
        return self.mix["valid"] < 1.0


def request_kinds(cfg: BenchConfig, client: int) -> Iterator[str]:
    """The kinds of client ``client``'s requests, in order: drawn from ``cfg.mix`` by an RNG seeded
    with ``cfg.seed`` and the client, so every run of a config sends the same sequence."""
    rng = random.Random(f"{cfg.seed}:{client}")
    weights = [cfg.mix[k] for k in MIX_KINDS]
    while True:
        yield rng.choices(MIX_KINDS, weights)[0]


@dataclass
class PolicyResult:
    """What one policy's run measured."""

    policy: str
    requests: int = 0  # a hostile mix: the valid ones (every kind is counted in ``mix``)
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
    head_bytes: float | None = None  # mean LM-head bytes a decode step read (masked head; None without it)
    memory: dict | None = None  # soak samples and the flatness summary (see :func:`memory_summary`)
    mix: dict | None = None  # a hostile mix's counts, KV-release checks and criteria (:meth:`HostileMix.report`)
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


# -- a hostile mix -----------------------------------------------------------------------------
def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@functools.lru_cache(maxsize=2)
def _padding(n: int) -> str:
    return "x" * n  # one string for every body over the limit


def _with_params(body: dict, params: dict) -> dict:
    tool = body["tools"][0]
    return {**body, "tools": [{**tool, "function": {**tool["function"], "parameters": params}}]}


def malformed_requests(body: dict, max_body_bytes: int) -> list[tuple[str, Callable[[], tuple]]]:
    """Bad requests made from a valid tool-call ``body``: ``(name, make)``, ``make()`` giving
    ``(content, headers)`` for ``POST /v1/chat/completions`` (content: bytes, or an iterator of
    bytes, which is sent chunked). The server must answer each with a 4xx."""
    json_type = {"content-type": "application/json"}

    def js(b: dict, headers: dict = json_type) -> Callable[[], tuple]:
        return lambda: (json.dumps(b).encode(), headers)

    msgs = body["messages"]
    name = body["tools"][0]["function"]["name"]
    pad = {"role": "user", "content": _padding(max_body_bytes + 1)}
    text_42 = {"role": "user", "content": [{"type": "text", "text": 42}]}
    calls_5 = {"role": "assistant", "content": None, "tool_calls": 5}
    ref_loop = {"properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    unsat = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 1}}, "required": ["n"]}

    def chunked() -> tuple:
        raw = json.dumps({**body, "messages": [pad, *msgs]}).encode()
        return (raw[i : i + 65536] for i in range(0, len(raw), 65536)), json_type

    return [
        ("content part text 42", js({**body, "messages": [*msgs[:-1], text_42]})),
        ("tool_calls 5", js({**body, "messages": [*msgs[:-1], calls_5, msgs[-1]]})),
        ("tool_choice.function a string", js({**body, "tool_choice": {"type": "function", "function": name}})),
        ("$ref loop schema", js(_with_params(body, ref_loop))),
        ("unsatisfiable schema", js(_with_params(body, unsat))),
        ("temperature 'hot'", js({**body, "temperature": "hot"})),
        ("schema nested 200 deep", js(_with_params(body, _nested_schema(200)))),
        ("schema nested 40 deep", js(_with_params(body, _nested_schema(40)))),
        ("invalid JSON", lambda: (json.dumps(body).encode()[:-7], json_type)),
        ("wrong Content-Type", js(body, {"content-type": "text/plain"})),
        ("body over the limit", js({**body, "messages": [pad, *msgs]})),
        ("body over the limit, chunked", chunked),
        ("unknown model", js({**body, "model": "gpt-9"})),
        ("empty messages", js({**body, "messages": []})),
    ]


def _status_class(status: int) -> str:
    return f"{status // 100}xx" if status // 100 in (2, 4, 5) else "other"


def _row_bytes(cache, row: int | None) -> int:
    """Bytes of KV storage (tier tensors, balance vectors) that row ``row`` of ``cache`` still holds."""
    if row is None:
        return 0
    total = 0
    for layer in cache.layers:
        st = layer.seqs[row] if layer.is_initialized and row < len(layer.seqs) else None
        if st is not None:
            total += st.allocated_bytes()
    return total


class HostileMix:
    """The non-valid requests of a mixed run and the server-side check that each cancel frees its KV.

    Installs three observers on the in-process ``service`` (none changes what the server does):
    its ``prepare`` records which job id each tagged request got (the client sends a unique
    ``user`` field, which the server ignores), its worker's ``cancel`` records when the server
    asked to cancel a job (and the scheduler's step count then), and a scheduler listener records
    each job's end: stop reason, time, step count, tokens generated, and the KV bytes its row still
    held right after it left (0 when the row was freed).

    Each cancelled or disconnected request is then judged by a checker thread (:meth:`_judge`):
    ``cancelled`` (freed by its cancellation; the release time is from the client's close),
    ``done_before_close`` (it had ended before the client closed), ``raced`` (it ended by itself in
    the step during which the server asked to cancel it, or before the server could notice the
    disconnect: within :attr:`UNNOTICED_GRACE_S` of it, no cancel asked), ``no_job`` (it never
    reached the decode thread), and the failures: ``ran_on`` (it went on decoding after the server
    asked to cancel it, or long after the close), ``held`` (still open ``release_timeout`` seconds
    after the close; its residual is then its row's bytes, or its KV reservation while it waits),
    and ``error`` (ended by a server error: counted with the 5xx). A failure's residual bytes and
    the end-of-run state (:meth:`finish`) go into :meth:`report`.
    """

    UNNOTICED_GRACE_S = 2.0  # a disconnect not yet noticed (non-streamed: polled every 0.25 s)

    def __init__(self, service, cfg: BenchConfig, url: str, bodies: list[dict], httpx) -> None:
        self.service, self.cfg, self.url, self.httpx = service, cfg, url, httpx
        self.bad = [malformed_requests(b, service.limits.max_body_bytes) for b in bodies[:8]]
        self.lock = threading.Lock()
        self.counts: dict[str, dict[str, int]] = {k: {"sent": 0} for k in MIX_KINDS}
        self.variants: dict[str, dict[str, dict[str, int]]] = {"malformed": {}, "cancel": {}}
        self.samples: dict[str, str] = {}  # the first unexpected answer per kind / variant
        self.ids: dict[str, str] = {}  # user tag -> job id
        self.cancels: dict[str, tuple[float, int]] = {}  # job id -> (time, scheduler steps) of its first cancel
        self.ends: dict[str, dict] = {}  # job id -> its end
        self.pending: list[dict] = []
        self.checks: list[dict] = []
        self._quiet = threading.Event()  # clients done and the server idle: unmatched tags never reached it
        self._stop = threading.Event()
        sch, worker = service.scheduler, service.worker
        prepare, cancel = service.prepare, worker.cancel

        def tagged_prepare(body: dict):
            chat = prepare(body)
            tag = body.get("user")
            if isinstance(tag, str):
                self.ids[tag] = chat.id
            return chat

        def recorded_cancel(job_id: str, reason: str = "cancelled") -> None:
            cancel(job_id, reason)
            self.cancels.setdefault(job_id, (time.perf_counter(), sch.steps))  # read after the request is queued

        def ended(job) -> None:
            self.ends[job.id] = {
                "stop": job.stop,
                "t": job.t_finish or time.perf_counter(),
                "steps": sch.steps,
                "generated": len(job.generated),
                "residual_bytes": _row_bytes(sch.cache, job.row) if job.stop != "error" else 0,
            }

        service.prepare, worker.cancel = tagged_prepare, recorded_cancel
        sch.listeners.append(ended)
        self._thread = threading.Thread(target=self._check_loop, name="pask-bench-release", daemon=True)
        self._thread.start()

    # -- the requests ---------------------------------------------------------------------------
    def count(self, kind: str, outcome: str, note: str | None = None, variant: str | None = None, detail=None) -> None:
        """One request's outcome; ``variant``: its bad body or stream mode, counted by ``detail`` (default: outcome)."""
        with self.lock:
            c = self.counts[kind]
            c["sent"] += 1
            c[outcome] = c.get(outcome, 0) + 1
            if variant is not None:
                v = self.variants[kind].setdefault(variant, {})
                key = str(detail or outcome)
                v[key] = v.get(key, 0) + 1
            if note is not None:
                self.samples.setdefault(f"{kind}/{variant or outcome}", note[:300])

    def send(self, kind: str, client, body: dict, rng: random.Random, tag: str, index: int) -> None:
        """One request of ``kind`` (not ``valid``) on ``client`` (an httpx client of this thread);
        ``index``: which bad body a malformed request sends (rotating). Anything unexpected (an
        event that is not JSON...) is counted as ``client_error``, never the end of the client."""
        try:
            if kind == "malformed":
                bad = self.bad[index % len(self.bad)]
                self.malformed(client, *bad[index % len(bad)])
            elif kind == "cancel":
                self.cancel(client, body, rng, tag)
            else:
                self.disconnect(client, body, rng, tag)
        except Exception as e:
            self.count(kind, "client_error", f"{type(e).__name__}: {e}")

    def malformed(self, client, variant: str, make: Callable[[], tuple]) -> None:
        content, headers = make()
        try:
            r = client.post(self.url, content=content, headers=headers)
        except self.httpx.TransportError as e:
            self.count("malformed", "transport_error", f"{type(e).__name__}: {e}", variant)
            return
        outcome = _status_class(r.status_code)
        note = None if outcome == "4xx" else f"{r.status_code}: {r.text}"
        self.count("malformed", outcome, note, variant, r.status_code)

    def cancel(self, client, body: dict, rng: random.Random, tag: str) -> None:
        """A streamed request closed after 1-4 content chunks (text) or a random delay (tool calls,
        whose chunks come at the end)."""
        text = rng.random() < 0.5
        want, delay = rng.randint(1, 4), rng.uniform(MIN_ABORT_S, self.cfg.abort_within)
        b = {**body, "stream": True, "user": tag}
        if text:
            b = {k: v for k, v in b.items() if k not in ("tools", "tool_choice")}
        outcome, note = "ended_without_done", None
        try:
            with client.stream("POST", self.url, json=b, timeout=self.httpx.Timeout(None, read=delay)) as r:
                if r.status_code != 200:
                    outcome, note = _status_class(r.status_code), f"{r.status_code}: {r.read()[:300]!r}"
                else:
                    seen = 0
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            outcome = "completed"
                            break
                        event = json.loads(line[6:])
                        if "error" in event:
                            outcome, note = "error_event", line
                            break
                        delta = event["choices"][0]["delta"] if event.get("choices") else {}
                        seen += bool(delta.get("content") or delta.get("tool_calls"))
                        if seen >= want:
                            outcome = "closed_after_chunks"
                            break
        except self.httpx.ReadTimeout:
            outcome = "closed_after_delay"
        except self.httpx.TransportError as e:
            outcome, note = "transport_error", f"{type(e).__name__}: {e}"
        t_close = time.perf_counter()
        self.count("cancel", outcome, note, "text" if text else "tools")
        if outcome in ("closed_after_chunks", "closed_after_delay"):
            self._expect_release(f"cancel ({'text' if text else 'tools'}, {outcome})", tag, t_close)

    def disconnect(self, client, body: dict, rng: random.Random, tag: str) -> None:
        """A non-streamed request whose client closes its connection after a random delay."""
        delay = rng.uniform(MIN_ABORT_S, self.cfg.abort_within)
        try:
            r = client.post(self.url, json={**body, "user": tag}, timeout=self.httpx.Timeout(None, read=delay))
        except self.httpx.ReadTimeout:
            t_close = time.perf_counter()
            self.count("disconnect", "closed")
            self._expect_release("disconnect", tag, t_close)
            return
        except self.httpx.TransportError as e:
            self.count("disconnect", "transport_error", f"{type(e).__name__}: {e}")
            return
        outcome = _status_class(r.status_code)  # answered before the delay ran out
        self.count("disconnect", outcome, None if outcome == "2xx" else f"{r.status_code}: {r.text}")

    # -- the KV release checks ------------------------------------------------------------------
    def _expect_release(self, kind: str, tag: str, t_close: float) -> None:
        with self.lock:
            self.pending.append({"kind": kind, "tag": tag, "t_close": t_close})

    def _check_loop(self) -> None:
        while True:
            with self.lock:
                items = list(self.pending)
            done = [(item, v) for item in items if (v := self._judge(item)) is not None]
            with self.lock:
                for item, verdict in done:
                    self.pending.remove(item)
                    self.checks.append(verdict)
                left = len(self.pending)
            if self._stop.is_set() and not left:
                return
            time.sleep(0.02)

    def _judge(self, item: dict) -> dict | None:
        """The verdict on one closed request, or None while it is still undecided."""
        job_id = self.ids.get(item["tag"])
        end = self.ends.get(job_id) if job_id else None
        out = {"kind": item["kind"], "job": job_id, "residual_bytes": 0, "release_s": None}
        late = time.perf_counter() > item["t_close"] + self.cfg.release_timeout
        if end is None:
            if job_id is None and (late or self._quiet.is_set()):
                return {**out, "verdict": "no_job"}
            if late or self._stop.is_set():
                return {**out, "verdict": "held", "residual_bytes": self._open_bytes(job_id)}
            return None
        after = end["t"] - item["t_close"]
        out.update(stop=end["stop"], generated=end["generated"], residual_bytes=end["residual_bytes"])
        if end["stop"] == "cancelled":
            verdict = "cancelled"
        elif end["stop"] == "error":
            verdict = "error"
        elif after <= 0:
            verdict = "done_before_close"
        else:
            asked = self.cancels.get(job_id)
            if asked is not None:  # it may end by itself in the step during which its cancel was asked
                verdict = "raced" if end["steps"] <= asked[1] else "ran_on"
            else:
                verdict = "raced" if after <= self.UNNOTICED_GRACE_S else "ran_on"
        return {**out, "verdict": verdict, "release_s": max(0.0, after)}

    def _open_bytes(self, job_id: str | None) -> int:
        """KV bytes a job still open holds: its row's, or while it waits for admission its reservation
        (read from another thread: a torn read counts as -1)."""
        worker = self.service.worker
        with worker._lock:
            job = worker._jobs.get(job_id)
        if job is None:
            return 0
        try:
            return _row_bytes(self.service.scheduler.cache, job.row) if job.row is not None else job.reserved
        except Exception:
            return -1

    def finish(self) -> dict:
        """After the clients: wait for the server to go idle and every check to be decided; the KV
        the scheduler still holds, reserves or keeps open."""
        sch, worker = self.service.scheduler, self.service.worker
        deadline = time.perf_counter() + self.cfg.release_timeout + 1
        while time.perf_counter() < deadline and (worker.open_jobs() or self.service.preparing or not sch.idle):
            time.sleep(0.05)
        time.sleep(0.1)  # a job's end listeners may still be running
        self._quiet.set()
        self._stop.set()
        self._thread.join()
        return {
            "kv_bytes_held": sch.cache.held_bytes(),
            "kv_bytes_allocated": sch.cache.allocated_bytes(),
            "kv_bytes_reserved": sch.reserved,
            "open_jobs": worker.open_jobs(),
            "running": len(sch.running),
            "waiting": len(sch.waiting),
        }

    def report(self, res: PolicyResult, end: dict) -> dict:
        """Counts per kind, the release checks and a pass / fail line per criterion."""
        verdicts: dict[str, int] = {}
        for c in self.checks:
            verdicts[c["verdict"]] = verdicts.get(c["verdict"], 0) + 1
        released = [c["release_s"] for c in self.checks if c["verdict"] == "cancelled"]
        residual = max((c["residual_bytes"] for c in self.checks), default=0)
        failed = [c for c in self.checks if c["verdict"] in ("ran_on", "held") or c["residual_bytes"]]
        release = {
            "checked": len(self.checks),
            "verdicts": verdicts,
            "with_tokens": sum(1 for c in self.checks if c["verdict"] == "cancelled" and c.get("generated")),
            "max_release_s": max(released, default=None),
            "mean_release_s": sum(released) / len(released) if released else None,
            "max_residual_bytes": residual,
            "failed": failed[:20],
            "checks": [{k: v for k, v in c.items() if k != "job"} for c in self.checks],
        }
        k = self.counts
        five_all = sum(v.get("5xx", 0) + v.get("error_event", 0) for v in k.values()) + verdicts.get("error", 0)
        bad = k["malformed"]
        not_4xx = bad["sent"] - bad.get("4xx", 0)
        growth = (res.memory or {}).get("rss_growth")
        end_ok = end["kv_bytes_held"] == end["kv_bytes_allocated"] == end["kv_bytes_reserved"] == end["open_jobs"] == 0
        criteria = [
            ("0 5xx for valid requests", res.errors_5xx, res.errors_5xx == 0),
            ("0 5xx for any request (incl. stream error events)", five_all, five_all == 0),
            ("every malformed request answered 4xx", f"{not_4xx} of {bad['sent']} not 4xx", not_4xx == 0),
            ("0 malformed outputs among valid requests", res.malformed, res.malformed == 0),
            (
                "KV freed after each cancelled / disconnected request",
                f"{len(failed)} of {len(self.checks)} not freed; max residual {residual} B",
                not failed,
            ),
            (
                "0 KV bytes held at the end",
                f"held {end['kv_bytes_held']} B, allocated {end['kv_bytes_allocated']} B, "
                f"reserved {end['kv_bytes_reserved']} B, open jobs {end['open_jobs']}",
                end_ok,
            ),
            (
                f"RSS flat after warm-up (<= {RSS_GROWTH_LIMIT}x)",
                "not sampled" if growth is None else f"{growth:.3f}x",
                None if growth is None else growth <= RSS_GROWTH_LIMIT,
            ),
        ]
        rows = [{"criterion": c, "value": v, "pass": p} for c, v, p in criteria]
        return {
            "kinds": self.counts,
            "malformed_variants": self.variants["malformed"],
            "cancel_modes": self.variants["cancel"],  # text streams (chunks) or tool calls (delay)
            "unexpected": self.samples,
            "errors_5xx_valid": res.errors_5xx,
            "errors_5xx_all": five_all,
            "malformed_not_4xx": not_4xx,
            "malformed_outputs": res.malformed,
            "release": release,
            "end": end,
            "rss_growth": growth,
            "criteria": rows,
            "passed": all(r["pass"] is not False for r in rows),
        }


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
    if service.scheduler.head is not None:
        service.scheduler.head.reset_counts()
    mix = HostileMix(service, cfg, url, bodies, httpx) if cfg.hostile else None
    stop_at = time.time() + cfg.max_seconds

    def client(k: int) -> None:
        kinds = request_kinds(cfg, k)
        rng = random.Random(f"{cfg.seed}:{k}:abort")  # each cancel's mode, chunks and delay
        n_malformed = 0
        with httpx.Client(timeout=None) as c:
            for j in range(cfg.requests_per_client):
                if time.time() > stop_at:
                    return
                body = bodies[(k * cfg.requests_per_client + j) % len(bodies)]
                kind = next(kinds) if mix else "valid"
                if progress:
                    progress()
                if kind != "valid":
                    # client k sends bad bodies k, k + c, k + 2c, ...: together the clients rotate through all
                    mix.send(kind, c, body, rng, f"pask-bench-{k}-{j}", k + cfg.concurrency * n_malformed)
                    n_malformed += kind == "malformed"
                    continue
                try:
                    r = c.post(url, json=body)
                except httpx.TransportError as e:
                    if mix is None:
                        raise
                    mix.count("valid", "transport_error", f"{type(e).__name__}: {e}")
                    continue
                if mix:
                    mix.count("valid", _status_class(r.status_code), None if r.status_code == 200 else r.text)
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
    end = mix.finish() if mix else None
    if sampler:
        res.memory = memory_summary(sampler.samples)
    sch = service.scheduler
    res.peak_kv_bytes, res.peak_running = sch.peak_held_bytes, sch.peak_running
    res.head_bytes = sch.head.bytes_per_step() if sch.head is not None else None
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
    if mix:
        res.mix = mix.report(res, end)
    return res


# -- the run -----------------------------------------------------------------------------------
def bandwidth_limit(
    weight_bytes: float,
    kv_per_token: int,
    context: float,
    concurrency: int,
    b: float,
    ref_weight_bytes: float | None = None,
) -> float:
    """Decode-step bytes of Full KV over those at budget ``b`` (weights read once per step, KV per
    request); ``ref_weight_bytes``: Full KV's step weight bytes where they differ from this policy's
    (the masked LM head reads what each run's grammar allows)."""
    kv = concurrency * context * kv_per_token
    ref = weight_bytes if ref_weight_bytes is None else ref_weight_bytes
    return (ref + kv) / (weight_bytes + kv * b)


def step_weights(static_bytes: int, head_full: int, head_read: float | None) -> float:
    """Weight bytes a decode step reads: :func:`~pask.cpu.weights.step_weight_bytes` (which counts the
    whole LM head) with the head's full ``head_full`` replaced by what the masked head measured it
    read per step (``head_read``; None: the whole head)."""
    return static_bytes - head_full + (head_full if head_read is None else head_read)


def decode_linears(model) -> str:
    """What computes the decode steps' linear layers: the native INT4 / INT8 or bf16 GEMV (with its ISA) or PyTorch."""
    from pask.cpu import native_gemv

    w = getattr(model, "pask_weights", None) or {}
    if w.get("layers"):
        kernel = native_gemv.quant_kernel()
        how = {"amx-int8": "AMX-INT8 tiles", "avx2-int8": "AVX2 int8 products"}.get(kernel)
        how = how or f"bf16 kernels, {native_gemv.isa()}"
        return f"native {w['weights'].upper()} GEMV ({how}, {w['layers']} layers)"
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
    rounds: int = 1,
) -> dict:
    """Run every policy (Full KV first, as the reference) and relate each to it; returns a JSON-able dict.

    ``rounds`` > 1 runs the whole list that many times in turn (Full KV, the others, Full KV, ...), so
    that a host's slow minutes fall on every policy alike: a row's times are the medians over its
    rounds, its speed-ups and gain shares the medians of the per-round ratios against the same
    round's Full KV (paired), and ``rounds`` lists each round's figures.

    ``progress`` gets each policy's name as it starts, ``on_request`` a call per request sent.
    ``warm_prefills``: first send every input once (``max_tokens`` 1, untimed) under the first
    policy, so that a prefill store (``$PASK_PREFILL_STORE``) holds them all and every timed policy
    loads its prompts instead of recomputing them: TPOT is then decode-bound, not dominated by
    serial prefills (the prefill store is what makes that equal for every policy).
    """
    if not factories:
        raise PaskError("the serving benchmark needs at least one policy")
    if rounds < 1:
        raise PaskError(f"rounds must be at least 1, got {rounds}")
    n = min(cfg.concurrency * cfg.requests_per_client, MAX_BODIES)  # a soak test cycles through them
    bodies = build_bodies(lm.tokenizer, lm.name, n, cfg)
    weights = step_weight_bytes(lm.model)
    out_emb = lm.model.get_output_embeddings()
    head_full = head_bytes(out_emb) if out_emb is not None else 0
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
        plain = replace(cfg, mix={"valid": 1.0})  # only valid requests fill the store
        run_policy(lm, "warm", factories[names[0]], [{**b, "max_tokens": 1} for b in bodies], plain, on_request)
    per: dict[str, list[PolicyResult]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names:
            if progress:
                progress(name if rounds == 1 else f"{name} (round {i + 1} / {rounds})")
            per[name].append(run_policy(lm, name, factories[name], bodies, cfg, on_request))
    results = {name: merge_rounds(rs) for name, rs in per.items()}
    ref = results.get(REF_POLICY)  # without Full KV in the run (a soak test) the ratios stay empty
    refs = per.get(REF_POLICY)
    context = cfg.input_len + cfg.output_len / 2

    def ratios(name: str, attr: str) -> list[float | None]:
        """Per round, Full KV's ``attr`` over this policy's in the same round (None where one is missing)."""
        if refs is None:
            return [None] * len(per[name])
        return [
            getattr(a, attr) / getattr(b, attr) if getattr(a, attr) and getattr(b, attr) else None
            for a, b in zip(refs, per[name], strict=True)
        ]

    def paired(name: str, attr: str) -> float | None:
        """The median over rounds of :func:`ratios`."""
        vals = [v for v in ratios(name, attr) if v is not None]
        return statistics.median(vals) if vals else None

    def rate(r: PolicyResult) -> float:
        return r.requests / r.wall_s if r.wall_s else 0.0

    rows = []
    ref_weights = step_weights(weights, head_full, ref.head_bytes) if ref else None
    for name, r in results.items():
        b = r.b_avg if r.b_avg is not None else 1.0
        w = step_weights(weights, head_full, r.head_bytes)
        limit = bandwidth_limit(w, per_token, context, cfg.concurrency, b, ref_weights)
        speedup = paired(name, "tpot_ms")
        step = paired(name, "step_ms")
        step_c = paired(name, "step_ms_at_c")
        rows.append(
            {
                **asdict(r),
                "rounds": [
                    {
                        "tpot_ms": x.tpot_ms,
                        "step_ms": x.step_ms,
                        "step_ms_at_c": x.step_ms_at_c,
                        "tpot_speedup": tp,
                        "step_speedup": st,
                    }
                    for x, tp, st in zip(per[name], ratios(name, "tpot_ms"), ratios(name, "step_ms"), strict=True)
                ],
                "tpot_speedup": speedup,
                "step_speedup": step,
                "step_at_c_speedup": step_c,
                "step_weight_bytes": w,
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
        "rounds": rounds,
        "weight_bytes": weights,
        "lm_head_bytes": head_full,
        "kv_bytes_per_token": per_token,
        "decode_context": context,
        "prefills": "loaded from a prefill store filled before the timed runs" if warm_prefills else "computed",
        "decode_linears": decode_linears(lm.model),
        "policies": rows,
        "command": command,
    }


_SUMMED = (
    "requests",
    "errors_5xx",
    "errors_other",
    "malformed",
    "completion_tokens",
    "wall_s",
    "prefill_s",
    "steps_at_c",
)
_MEDIAN = (
    "prompt_tokens_mean",
    "tpot_ms",
    "step_ms",
    "step_ms_at_c",
    "throughput_tps",
    "decode_tps",
    "b_final",
    "b_avg",
    "head_bytes",
)


def merge_rounds(rs: list[PolicyResult]) -> PolicyResult:
    """One policy's rounds as one result: counts and seconds summed, times, rates and B the medians,
    peaks the largest; memory samples, a mix's report and extras from the first round."""
    if len(rs) == 1:
        return rs[0]
    out = replace(rs[0])
    for f in _SUMMED:
        setattr(out, f, sum(getattr(r, f) for r in rs))
    for f in _MEDIAN:
        vals = [getattr(r, f) for r in rs if getattr(r, f) is not None]
        setattr(out, f, statistics.median(vals) if vals else None)
    out.peak_kv_bytes = max(r.peak_kv_bytes for r in rs)
    out.peak_running = max(r.peak_running for r in rs)
    return out


def markdown(result: dict) -> str:
    """Tables 13/14 layout: one row per policy, relative to Full KV in the same run."""
    cfg = result["config"]
    cap = cfg["capacity_tokens"] or "unlimited"
    linears = f"; decode linears: {result['decode_linears']}" if result.get("decode_linears") else ""
    wbytes = f"; weights a step reads: {result['weight_bytes'] / 1e6:.0f} MB" if result.get("weight_bytes") else ""
    full = next((r for r in result["policies"] if r["policy"] == REF_POLICY), None)
    if wbytes and result.get("lm_head_bytes") and full and full.get("head_bytes") is not None:
        wbytes = (
            f"; weights a step reads: {full['step_weight_bytes'] / 1e6:.0f} MB under Full KV "
            f"({result['weight_bytes'] / 1e6:.0f} MB "
            f"with the whole LM head of {result['lm_head_bytes'] / 1e6:.0f} MB; the masked head read "
            f"{full['head_bytes'] / 1e6:.0f} MB of it per step: the whole weight in a step with a wide row, the "
            "gathered rows of narrow ones; each policy's limit counts what its own steps read)"
        )
    head = (
        f"Serving, {result['model']}, c = {cfg['concurrency']}, input {cfg['input_len']}, output {cfg['output_len']}, "
        f"KV capacity {cap} tokens; prefills {result.get('prefills', 'computed')}{linears}{wbytes}"
        "\n\nGain share: (speed-up - 1) / (limit - 1), the part of the bandwidth model's gain above 1x reached "
        "(the limit from the bytes a step reads: weights, KV held).\n\n"
        f"{rounds_note(result.get('rounds', 1))}"
        "| policy | B (avg) | TPOT ms | TPOT speed-up | step ms | step speed-up | step ms at batch c (steps) "
        "| x Full | bandwidth limit | gain share (TPOT) | gain share (step) | throughput tok/s | x Full | tokens out "
        "| requests/s | x Full | prefill s | decode tok/s | x Full | peak KV MiB | x Full | peak concurrent | 5xx "
        "| malformed |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )

    def f(x, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    def fx(x) -> str:  # a ratio
        return "-" if x is None else f"{x:.2f}x"

    def pct(x) -> str:  # a share
        return "-" if x is None else f"{100 * x:.0f} %"

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
            pct(r.get("share_of_limit")),
            pct(r.get("step_share_of_limit")),
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
    if result.get("rounds", 1) > 1:
        lines += ["", "Per round (ms; x Full KV of the same round):", "", "| policy | TPOT | step |", "|---|---|---|"]
        for r in result["policies"]:
            tp = ", ".join(f"{x['tpot_ms']:.1f} ({fx(x['tpot_speedup'])})" for x in r["rounds"])
            st = ", ".join(f"{x['step_ms']:.1f} ({fx(x['step_speedup'])})" for x in r["rounds"])
            lines.append(f"| {r['policy']} | {tp} | {st} |")
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
    for r in result["policies"]:
        if r.get("mix"):
            lines += mix_markdown(r["policy"], r["mix"], cfg)
    if result.get("command"):
        lines += ["", f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


def rounds_note(rounds: int) -> str:
    """The markdown's line on alternating rounds ('' for one)."""
    if rounds <= 1:
        return ""
    return (
        f"{rounds} alternating rounds (Full KV, then each policy, {rounds} times): times are each policy's "
        "medians over its rounds, speed-ups and gain shares the medians of the per-round ratios against the "
        "same round's Full KV (paired; the rounds are listed below).\n\n"
    )


def mix_markdown(policy: str, mix: dict, cfg: dict) -> list[str]:
    """A hostile mix's section: requests per kind and outcome, the KV release checks, the criteria."""
    shares = ", ".join(f"{k} {v:.2f}" for k, v in cfg["mix"].items() if v)
    lines = [
        "",
        f"Hostile mix, {policy} ({shares}; seed {cfg['seed']}; cancels / disconnects close within "
        f"{cfg['abort_within']:g} s)",
        "",
        "| kind | sent | outcomes |",
        "|---|---|---|",
    ]
    for kind, counts in mix["kinds"].items():
        outcomes = ", ".join(f"{k} {v}" for k, v in counts.items() if k != "sent") or "-"
        lines.append(f"| {kind} | {counts['sent']} | {outcomes} |")
    if mix["malformed_variants"]:
        variants = sorted(mix["malformed_variants"].items())
        by = "; ".join(f"{name}: " + ", ".join(f"{k} {v}" for k, v in c.items()) for name, c in variants)
        lines += ["", f"Malformed bodies: {by}"]
    rel = mix["release"]
    verdicts = ", ".join(f"{k} {v}" for k, v in sorted(rel["verdicts"].items())) or "none"
    rel_s = "-"
    if rel["max_release_s"] is not None:
        rel_s = f"max {rel['max_release_s']:.2f} s, mean {rel['mean_release_s']:.2f} s"
    lines += [
        "",
        f"Cancelled / disconnected requests checked on the server: {rel['checked']} ({verdicts}; cancelled "
        f"after their first token {rel['with_tokens']}); KV freed {rel_s} after the client's close; max "
        f"residual {rel['max_residual_bytes']} B",
        "",
        "| criterion | value | result |",
        "|---|---|---|",
    ]
    for c in mix["criteria"]:
        verdict = {True: "PASS", False: "FAIL", None: "not measured"}[c["pass"]]
        lines.append(f"| {c['criterion']} | {c['value']} | {verdict} |")
    lines += ["", f"Overall: {'PASS' if mix['passed'] else 'FAIL'}"]
    return lines


def write(result: dict, out: Path, allow_dirty: bool = False) -> tuple[Path, Path]:
    """``out``.json and ``out``.md with their provenance (:func:`pask.experiments.provenance.write_result`:
    refused into the committed results from a dirty code tree unless ``allow_dirty``)."""
    from pask.experiments.provenance import write_result

    return write_result(out, result, markdown(result), command=result.get("command"), allow_dirty=allow_dirty)
