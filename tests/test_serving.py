"""Serving: continuous batching is exact, admission follows the KV capacity, the HTTP server speaks OpenAI."""

from __future__ import annotations

import json
import time

import httpx2 as httpx
import jsonschema
import pytest
import torch

from pask.errors import PaskError
from pask.kv.cache import CacheConfig, TieredCache
from pask.kv.errors import KVCacheError
from pask.policies import FullPolicy, get_policy
from pask.runtime.capacity import CapacityError, KVCapacity, kv_bytes_per_token, policy_target_b
from pask.runtime.engine import Request, generate
from pask.runtime.scheduler import SERVE_HEADROOM, Job, Scheduler

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _chat_ids(lm, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    return lm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)


# -- cache rows moving between caches ----------------------------------------------------------
def _prefilled(cfg, n_tokens: int = 12) -> TieredCache:
    from transformers import LlamaConfig

    mc = LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=256)
    cache = TieredCache(mc, cfg, batch_size=1)
    cache.begin_prefill([0])
    k = torch.randn(1, 2, n_tokens, 64)
    for layer in range(4):
        cache.update(k, k + 1, layer)
    return cache


def test_adopt_moves_rows_and_compaction_drops_the_dead():
    cfg = CacheConfig(num_groups=2, recent_window=2)
    running = TieredCache(_prefilled(cfg)._model_config, cfg, batch_size=0)
    a, b = _prefilled(cfg, 10), _prefilled(cfg, 14)
    a.apply(0, 0, [0, 1], 2)  # release two tokens of group 0 before the move
    held_a = a._seq_bytes(0)
    assert running.adopt(a, 0) == 0 and running.adopt(b, 0) == 1
    assert running._seq_bytes(0) == held_a and running.seq_length(1) == 14
    assert a.dropped[0] and a.held_bytes() == 0  # moved, not copied
    assert running.mode == "extend" and running.prompt_length(0) == 10
    running.drop(0)
    held = running.held_bytes()
    compact, rows = running.compacted()
    assert rows == {1: 0} and compact.num_seqs == 1 and compact.seq_length(0) == 14
    assert compact.held_bytes() == held > 0 and running.held_bytes() == 0
    with pytest.raises(KVCacheError, match="dropped"):
        compact.adopt(a, 0)
    with pytest.raises(KVCacheError, match="not been prefilled"):
        compact.adopt(TieredCache(a._model_config, cfg, batch_size=1), 0)
    with pytest.raises(KVCacheError, match="same model layout"):
        compact.adopt(_prefilled(CacheConfig(num_groups=4, recent_window=2)), 0)


# -- admission ---------------------------------------------------------------------------------
def test_capacity_rule_turns_saved_bytes_into_concurrency():
    full = KVCapacity(bytes_per_token=100, target_b=1.0, tokens=1000)
    third = KVCapacity(bytes_per_token=100, target_b=0.33, tokens=1000)
    assert full.cost(400, 100) == 50_000 and third.cost(400, 100) == 16_500
    assert sum(1 for n in range(1, 10) if full.fits(n * full.cost(400, 100))) == 2
    assert sum(1 for n in range(1, 10) if third.fits(n * third.cost(400, 100))) == 6
    assert third.max_new_tokens(400) == 3030 - 400
    with pytest.raises(CapacityError, match="over the server's capacity"):
        full.check(900, 200)
    with pytest.raises(PaskError):
        KVCapacity(bytes_per_token=100, target_b=0.0)
    assert KVCapacity(bytes_per_token=1).fits(10**15)  # unlimited
    assert policy_target_b(FullPolicy()) == 1.0 and policy_target_b(get_policy("snapkv", budget=0.4)) == 0.4


def test_scheduler_admits_within_capacity(smol):
    """At B = 1/3 three requests run together where Full KV admits one at a time."""
    ids = _chat_ids(smol, "Name three prime numbers and explain, step by step and in detail, why each is prime. " * 2)
    per = len(ids) + 6

    def peak_running(factory) -> int:
        sch = Scheduler(smol, factory, capacity_tokens=per + per // 2)
        jobs = [Job(str(i), Request(list(ids), max_new_tokens=6)) for i in range(3)]
        for j in jobs:
            sch.submit(j)
        peak = 0
        while not sch.idle:
            sch.step()
            peak = max(peak, len(sch.running))
            assert sch.reserved <= sch.capacity.capacity_bytes
        sch.close()
        assert all(j.finished and j.stop != "error" for j in jobs)
        assert sch.snapshot()["kv_bytes_held"] == 0 and sch.reserved == 0
        return peak

    assert peak_running(FullPolicy) == 1
    assert peak_running(lambda: get_policy("static_mix", h=0.2, l=0.2, r=0.6)) == 1  # no budget: reserves B = 1
    assert peak_running(lambda: get_policy("snapkv", budget=0.33)) == 3
    assert kv_bytes_per_token(smol.model.config, torch.float32) == 2 * 30 * 3 * 64 * 4


# -- continuous batching is exact --------------------------------------------------------------
def _requests(lm) -> list[Request]:
    from pask.evaluation.run_bfcl import prepare
    from pask.tasks.function_calling import load_cases

    cases = load_cases(["simple", "parallel"], split="test", limit=1)
    reqs = [prepare(lm, c, 24)[0] for c in cases]
    reqs.append(Request(_chat_ids(lm, "Name three prime numbers."), max_new_tokens=14))
    return reqs


@pytest.mark.parametrize("policy", ["full", "h2o"])
def test_continuous_batching_equals_engine_alone(smol, policy, monkeypatch):
    """Staggered arrivals into a running batch give exactly the tokens of each request run alone (fp32).

    Alone without the masked head, batched with it: the head changes no token.
    """
    from pask.runtime.masked_head import ENV

    factory = FullPolicy if policy == "full" else (lambda: get_policy("h2o", budget=0.5))
    engine_policy = (lambda: None) if policy == "full" else factory  # Full KV alone: DynamicCache
    monkeypatch.setenv(ENV, "0")
    alone = [generate(smol, [r], policy=engine_policy())[0].token_ids for r in _requests(smol)]
    monkeypatch.setenv(ENV, "1")
    sch = Scheduler(smol, factory)
    head = sch.head
    jobs = [Job(str(i), r) for i, r in enumerate(_requests(smol))]
    sch.submit(jobs[0])
    sch.step()
    sch.step()
    sch.submit(jobs[1])
    sch.step()
    sch.submit(jobs[2])
    sch.run_until_idle()
    sch.close()
    assert [j.generated for j in jobs] == alone
    assert head.narrow_rows > 0 and "forward" not in smol.model.get_output_embeddings().__dict__
    assert all(j.result is not None and j.result.token_ids == j.generated for j in jobs)
    log = sch.step_log  # every decode step once, under its batch size
    assert {1, 3} <= set(log) <= {1, 2, 3} and all(t > 0 for ts in log.values() for t in ts)
    assert sum(b * len(ts) for b, ts in log.items()) == sum(j.decode_steps for j in jobs)
    if policy == "h2o":
        assert all(0.4 < j.budget["b_total"] < 0.7 for j in jobs)
    assert sch.snapshot()["kv_bytes_held"] == 0 and sch.cache.num_seqs == 0
    assert smol.model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("headroom", [None, 0])
def test_serving_headroom_spares_the_row_copy_of_a_doubling_tier(smol, headroom):
    """A 64-token prompt fills its first allocation; without headroom the first decode append doubles (copies) it."""
    ids = (_chat_ids(smol, "Say hello.") * 16)[:64]
    config = None if headroom is None else CacheConfig(headroom=headroom)
    sch = Scheduler(smol, FullPolicy, cache_config=config)
    job = Job("0", Request(ids, max_new_tokens=4))
    sch.submit(job)
    sch.run_until_idle()
    sch.close()
    assert job.decode_steps >= 1
    if headroom is None:  # the scheduler's default
        assert sch.config.headroom == SERVE_HEADROOM and sch.cache.stats.copied_bytes == 0
    else:
        assert sch.cache.stats.copied_bytes > 0


def test_cancel_frees_rows_and_others_go_on(smol):
    sch = Scheduler(smol, FullPolicy)
    a = Job("a", Request(_chat_ids(smol, "Tell me a long story."), max_new_tokens=30))
    b = Job("b", Request(_chat_ids(smol, "Hi!"), max_new_tokens=5))
    sch.submit(a)
    sch.submit(b)
    sch.step()
    assert sch.cancel("a") and not sch.cancel("nope")
    sch.step()
    assert a.stop == "cancelled" and a.result is None and sch.cache.num_seqs == 1
    sch.run_until_idle()
    sch.close()
    assert b.stop in ("eos", "length") and sch.snapshot()["kv_bytes_held"] == 0


def test_a_cancel_during_admission_skips_the_prefill_and_ends_running_rows_first(smol, monkeypatch):
    """The server flags ``Job.cancelled`` from its handler threads while the decode thread prefills
    a step's admissions one after another: a flagged waiting job is never prefilled, a flagged
    running one takes no further token."""
    sch = Scheduler(smol, FullPolicy)
    run = Job("run", Request(_chat_ids(smol, "Tell me a long story."), max_new_tokens=30))
    sch.submit(run)
    sch.step()
    n = len(run.generated)
    late = [Job(str(i), Request(_chat_ids(smol, f"Question {i}?"), max_new_tokens=4)) for i in range(4)]
    for job in late:
        sch.submit(job)
    prefilled, prefill = [], sch._prefill

    def prefill_and_cancel(job):
        prefilled.append(job.id)
        prefill(job)
        if job.id == "0":  # as a handler thread would, mid-admission
            late[1].cancelled = late[3].cancelled = run.cancelled = True

    monkeypatch.setattr(sch, "_prefill", prefill_and_cancel)
    sch.step()
    assert prefilled == ["0", "2"] and late[1].stop == "cancelled" and late[1].prefill_ms == 0
    # every flagged waiting job ends before the next prefill, not when it reaches the queue's head
    assert late[3].stop == "cancelled" and late[3].t_finish < late[2].t_admit
    assert run.stop == "cancelled" and len(run.generated) == n
    sch.run_until_idle()
    sch.close()
    assert late[0].stop in ("eos", "length") and late[2].stop in ("eos", "length")
    assert sch.snapshot()["kv_bytes_held"] == 0 and sch.reserved == 0


# -- the HTTP server ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(smol):
    """The app on a loopback port (uvicorn in a thread), Full KV, a 4096-token capacity."""
    from pask.serving.server import Service, serve_in_thread

    service = Service.build(smol, FullPolicy, capacity_tokens=4096, default_max_tokens=48)
    with serve_in_thread(service, start_timeout=30) as url:
        yield url, service


def _post(url: str, body: dict | bytes, **kw) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    kw.setdefault("headers", {"content-type": "application/json"})
    return httpx.post(f"{url}/v1/chat/completions", content=data, timeout=120, **kw)


def _sse(lines) -> list[dict | str]:
    out = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_tool_calls_validate_against_their_schemas(server):
    url, _ = server
    for choice, name in (("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")):
        body = {"model": "smollm2-135m", "messages": ASK_WEATHER, "tools": [WEATHER, TIME], "tool_choice": choice}
        r = _post(url, {**body, "max_tokens": 64})
        assert r.status_code == 200, r.text
        out = r.json()
        msg = out["choices"][0]["message"]
        assert out["choices"][0]["finish_reason"] == "tool_calls" and msg["content"] is None
        assert msg["tool_calls"], msg
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
        for call in msg["tool_calls"]:
            assert call["type"] == "function" and call["id"].startswith("call_")
            assert name is None or call["function"]["name"] == name
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
        assert out["usage"]["prompt_tokens"] > 0 and out["usage"]["completion_tokens"] > 0
        assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"]


def test_json_schema_response_validates_and_streams_the_same_text(server):
    url, _ = server
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": "Invent a person. Answer in JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        "max_tokens": 40,
    }
    r = _post(url, body)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), PERSON)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = _sse(s.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == text and len(chunks) > 3
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_streamed_tool_calls_equal_non_streamed(server):
    url, _ = server
    body = {"model": "smollm2-135m", "messages": ASK_WEATHER, "tools": [WEATHER], "tool_choice": "required"}
    plain = _post(url, {**body, "max_tokens": 64}).json()["choices"][0]["message"]["tool_calls"]
    stream_body = {**body, "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=stream_body, timeout=120) as s:
        events = _sse(s.iter_lines())
    calls = [tc for e in events[:-1] for c in e["choices"] for tc in c["delta"].get("tool_calls") or []]
    assert [c["function"] for c in calls] == [c["function"] for c in plain]
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] > 0
    assert events[-3]["choices"][0]["finish_reason"] == "tool_calls"


BAD = {
    "malformed JSON": (b'{"model": "smollm2-135m", "messages": [', 400, "malformed JSON"),
    "not an object": (b"[1, 2]", 400, "JSON object"),
    "no messages": ({"model": "smollm2-135m"}, 400, "messages"),
    "unknown model": ({"model": "gpt-9", "messages": ASK_WEATHER}, 404, "does not exist"),
    "bad tool_choice": (
        {"model": "smollm2-135m", "messages": ASK_WEATHER, "tools": [WEATHER], "tool_choice": "sometimes"},
        400,
        "tool_choice must be",
    ),
    "unknown named tool": (
        {
            "model": "smollm2-135m",
            "messages": ASK_WEATHER,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        400,
        "not among the tools",
    ),
    "tool_choice without tools": (
        {"model": "smollm2-135m", "messages": ASK_WEATHER, "tool_choice": "required"},
        400,
        "needs 'tools'",
    ),
    "invalid schema": (
        {
            "model": "smollm2-135m",
            "messages": ASK_WEATHER,
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}},
        },
        400,
        "not a valid JSON Schema",
    ),
    "unsatisfiable schema": (
        {
            "model": "smollm2-135m",
            "messages": ASK_WEATHER,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "integer", "minimum": 5, "maximum": 1}},
            },
        },
        400,
        "minimum 5 > maximum 1",
    ),
    "over capacity": ({"model": "smollm2-135m", "messages": ASK_WEATHER, "max_tokens": 5000}, 400, "capacity"),
    "bad max_tokens": ({"model": "smollm2-135m", "messages": ASK_WEATHER, "max_tokens": -1}, 400, "positive"),
    "bad tool": ({"model": "smollm2-135m", "messages": ASK_WEATHER, "tools": [{"x": 1}]}, 400, "tools[0]"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_requests_get_4xx_with_a_message(server, case):
    url, _ = server
    body, status, words = BAD[case]
    r = _post(url, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"].endswith("_error")


def test_cancelled_stream_frees_its_cache_rows(server):
    url, service = server
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Tell me a long story."}]}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "max_tokens": 400, "stream": True}) as s:
        lines = s.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few chunks: the request is decoding
        assert any("content" in x for x in got)
        assert service.metrics.gauges["kv_bytes_held"] > 0
    deadline = time.time() + 30
    while time.time() < deadline and service.metrics.gauges.get("running"):
        time.sleep(0.1)
    g = service.metrics.gauges
    assert g["running"] == 0 and g["kv_bytes_held"] == 0 and g["kv_bytes_reserved"] == 0
    assert service.metrics.requests.get("cancelled", 0) >= 1


def test_health_models_and_metrics(server):
    url, _ = server
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "smollm2-135m"
    text = httpx.get(f"{url}/metrics").text
    for name in ("requests_total", "tpot_seconds", "throughput_tokens_per_second", "kv_bytes_held", "kv_budget"):
        assert f"pask_{name}" in text, name


def test_official_openai_client_works_unchanged(server):
    import openai

    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["smollm2-135m"]
    out = client.chat.completions.create(
        model="smollm2-135m", messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required", max_tokens=64
    )
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    assert out.usage.prompt_tokens > 0
    stream = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    plain = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Hi!"}], max_tokens=8
    )
    assert text == plain.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=ASK_WEATHER)


# -- the serving benchmark ---------------------------------------------------------------------
def test_bandwidth_limit_matches_the_issue_numbers():
    """qwen2.5-coder-0.5b in bf16 at B = 0.33, c = 8: about 1.4x at 8k and 2.0x at 32k context."""
    from pask.bench.serving import bandwidth_limit

    weights, per_token = 494_032_768 * 2, 24 * 2 * 2 * 64 * 2
    assert bandwidth_limit(weights, per_token, 8192, 8, 0.33) == pytest.approx(1.43, abs=0.02)
    assert bandwidth_limit(weights, per_token, 32768, 8, 0.33) == pytest.approx(2.05, abs=0.02)
    assert bandwidth_limit(weights, per_token, 8192, 8, 1.0) == 1.0
    # each side's own weight bytes (the masked head reads what its grammar allows): Full KV's over the policy's
    kv = 8 * 8192 * per_token
    assert bandwidth_limit(weights - 10**8, per_token, 8192, 8, 0.33, weights) == pytest.approx(
        (weights + kv) / (weights - 10**8 + 0.33 * kv)
    )


def test_step_weights_count_the_head_as_read():
    from pask.bench.serving import step_weights

    assert step_weights(1000, 300, None) == 1000  # no masked head: the whole head
    assert step_weights(1000, 300, 120.5) == 820.5
    assert step_weights(1000, 300, 0.0) == 700


def test_bench_serve_smoke(smol, tmp_path):
    """Tiny loopback run: BFCL inputs near the asked length, every request answered, rows relative to Full KV."""
    from pask.bench.serving import BenchConfig, bandwidth_limit, bench_serve, write

    cfg = BenchConfig(concurrency=2, input_len=300, output_len=4, requests_per_client=1)
    result = bench_serve(smol, {"full": FullPolicy, "snapkv": lambda: get_policy("snapkv", budget=0.4)}, cfg)
    full, snap = result["policies"]
    assert full["policy"] == "full" and full["tpot_speedup"] == 1.0 and full["peak_kv_ratio"] == 1.0
    for r in (full, snap):
        assert r["requests"] == 2 and r["errors_5xx"] == r["errors_other"] == 0
        assert 250 <= r["prompt_tokens_mean"] <= 700 and r["completion_tokens"] > 0
        assert 0 < r["prefill_s"] < r["wall_s"] and r["decode_tps"] > r["throughput_tps"] > 0
        assert 0 < r["step_ms"] <= r["tpot_ms"]  # TPOT also holds the stalls for the other request's prefill
        assert (r["step_ms_at_c"] is None) == (r["steps_at_c"] == 0)
    assert full["decode_throughput_gain"] == 1.0 and full["step_speedup"] == 1.0 and full["request_gain"] == 1.0
    for r in (full, snap):
        assert r["request_rate"] == pytest.approx(r["requests"] / r["wall_s"])
    assert snap["request_gain"] == pytest.approx(snap["request_rate"] / full["request_rate"])
    assert snap["b_avg"] == pytest.approx(0.4, abs=0.05) and snap["peak_kv_ratio"] < 0.6
    assert 1.0 < snap["bandwidth_limit"] < 1.2
    # the limit counts the LM head as the masked head measured it read, each policy its own steps
    assert 0 < result["lm_head_bytes"] < result["weight_bytes"]
    for r in (full, snap):
        assert 0 < r["head_bytes"] <= result["lm_head_bytes"] * 1.1
        assert r["step_weight_bytes"] == result["weight_bytes"] - result["lm_head_bytes"] + r["head_bytes"]
    ctx, per_token = result["decode_context"], result["kv_bytes_per_token"]
    assert snap["bandwidth_limit"] == pytest.approx(
        bandwidth_limit(snap["step_weight_bytes"], per_token, ctx, 2, snap["b_avg"], full["step_weight_bytes"])
    )
    js, md = write(result, tmp_path / "serving")
    assert json.loads(js.read_text())["model"] == "smollm2-135m" and "| snapkv |" in md.read_text()
    assert "gain share (TPOT)" in md.read_text() and "weights a step reads" in md.read_text()
    with pytest.raises(PaskError, match="at least one policy"):
        bench_serve(smol, {}, cfg)


def test_bench_serve_rounds_alternate_and_pair_the_ratios(smol):
    """rounds=2 runs full, snapkv, full, snapkv; rows hold medians, speed-ups the per-round ratios' median."""
    import statistics

    from pask.bench.serving import BenchConfig, bench_serve, markdown

    cfg = BenchConfig(concurrency=2, input_len=200, output_len=3, requests_per_client=1)
    seen = []
    result = bench_serve(
        smol,
        {"full": FullPolicy, "snapkv": lambda: get_policy("snapkv", budget=0.5)},
        cfg,
        progress=seen.append,
        rounds=2,
    )
    assert seen == ["full (round 1 / 2)", "snapkv (round 1 / 2)", "full (round 2 / 2)", "snapkv (round 2 / 2)"]
    full, snap = result["policies"]
    assert result["rounds"] == 2 and len(full["rounds"]) == len(snap["rounds"]) == 2
    assert full["requests"] == snap["requests"] == 4  # summed over the rounds
    assert full["tpot_ms"] == pytest.approx(statistics.median(x["tpot_ms"] for x in full["rounds"]))
    ratios = [f["tpot_ms"] / s["tpot_ms"] for f, s in zip(full["rounds"], snap["rounds"], strict=True)]
    assert snap["tpot_speedup"] == pytest.approx(statistics.median(ratios))
    assert [x["tpot_speedup"] for x in snap["rounds"]] == pytest.approx(ratios)
    assert full["tpot_speedup"] == pytest.approx(1.0)
    md = markdown(result)
    assert "2 alternating rounds" in md and "Per round" in md and md.count("| snapkv |") == 2
    with pytest.raises(PaskError, match="rounds must be at least 1"):
        bench_serve(smol, {"full": FullPolicy}, cfg, rounds=0)


def test_merge_rounds_sums_counts_and_takes_medians():
    from pask.bench.serving import PolicyResult, merge_rounds

    rs = [
        PolicyResult("p", requests=2, tpot_ms=10.0, step_ms=8.0, peak_kv_bytes=5, b_avg=0.3, wall_s=1.0),
        PolicyResult("p", requests=2, tpot_ms=30.0, step_ms=9.0, peak_kv_bytes=7, b_avg=0.5, wall_s=2.0),
        PolicyResult("p", requests=3, tpot_ms=20.0, step_ms=20.0, peak_kv_bytes=6, b_avg=None, wall_s=3.0),
    ]
    m = merge_rounds(rs)
    assert (m.requests, m.wall_s, m.tpot_ms, m.step_ms, m.peak_kv_bytes) == (7, 6.0, 20.0, 9.0, 7)
    assert m.b_avg == pytest.approx(0.4) and rs[0].tpot_ms == 10.0  # the inputs are left alone
    assert merge_rounds(rs[:1]) is rs[0]


def test_soak_run_without_reference_samples_memory(smol):
    """A soak run (no Full KV reference): requests cycle through the bodies, memory is sampled, ratios stay empty."""
    from pask.bench.serving import BenchConfig, bench_serve, markdown

    cfg = BenchConfig(concurrency=2, input_len=200, output_len=3, requests_per_client=3, sample_every=0.05)
    sent = []
    result = bench_serve(
        smol, {"snapkv": lambda: get_policy("snapkv", budget=0.5)}, cfg, on_request=lambda: sent.append(1)
    )
    (row,) = result["policies"]
    assert row["requests"] == len(sent) == 6 and row["errors_5xx"] == 0
    assert row["tpot_speedup"] is None and row["throughput_gain"] is None
    mem = row["memory"]
    assert len(mem["samples"]) >= 4 and all(s[1] > 0 for s in mem["samples"])
    assert mem["rss_growth"] is not None and "RSS growth" in markdown(result)


def test_memory_summary_flags_growth_after_warmup():
    from pask.bench.serving import memory_summary

    flat = [(t, 1000 if t < 2 else 2000, 10, 1) for t in range(10)]  # warm-up growth only
    leak = [(t, 1000 + 100 * t, 10, 1) for t in range(10)]
    assert memory_summary(flat)["rss_growth"] == 1.0
    assert memory_summary(leak)["rss_growth"] > 1.2
    assert memory_summary(leak[:2])["rss_growth"] is None
    from pask.bench.serving import BenchConfig

    with pytest.raises(PaskError, match="sample_every"):
        BenchConfig(sample_every=-1)


def test_bench_serve_warms_a_prefill_store(smol, tmp_path, monkeypatch):
    """With warm_prefills every input is stored before the timed runs; without a store it is an error."""
    from pask.bench.serving import BenchConfig, bench_serve, markdown
    from pask.runtime.prefill_store import ENV

    cfg = BenchConfig(concurrency=2, input_len=300, output_len=3, requests_per_client=1)
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(PaskError, match="prefill store"):
        bench_serve(smol, {"full": FullPolicy}, cfg, warm_prefills=True)
    monkeypatch.setenv(ENV, str(tmp_path))
    result = bench_serve(smol, {"full": FullPolicy}, cfg, warm_prefills=True)
    assert len(list(tmp_path.rglob("*.pt"))) == 3  # both inputs + the server's warm-up message
    (full,) = result["policies"]
    assert full["requests"] == 2 and full["completion_tokens"] > 0 and full["errors_5xx"] == 0
    assert "loaded from a prefill store" in markdown(result)
