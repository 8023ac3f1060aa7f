"""Replicas on Ray Serve (``pask serve --replicas N --ray``; docs/serving.md, "Replicas on Ray Serve"):
two replicas of smollm2-135m on a local Ray instance answer as one process does, ``/metrics`` sums
them, and a killed replica fails its own requests cleanly while the other's complete."""

from __future__ import annotations

import json
import re
import threading
import time
from types import SimpleNamespace

import httpx2 as httpx
import pytest
import torch
from typer.testing import CliRunner

from pask.cli import app
from pask.serving import metrics as metrics_mod
from pask.serving import replicas as replicas_mod

MODEL = "smollm2-135m"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
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
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
BODIES = [  # (body, streamed)
    ({"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 12}, False),
    ({"model": MODEL, "messages": [{"role": "user", "content": "Name three prime numbers."}], "max_tokens": 20}, True),
    ({"model": MODEL, "messages": ASK_WEATHER, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 48},
     False),
    ({"model": MODEL, "messages": ASK_WEATHER, "tools": [WEATHER, TIME], "max_tokens": 48,
      "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, True),
]  # fmt: skip
# decodes for as long as it is let
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Count from 1 to 1000, separated by commas."}],
        "max_tokens": 120}  # fmt: skip
TIMEOUT = 300.0  # a loaded 2-core machine (an evaluation beside the suite) took over 120 s
runner = CliRunner()


# -- the command line: bad input stops before Ray or a model ------------------------------------
@pytest.mark.parametrize(
    "args, words",
    [
        (["--replicas", "0"], "--replicas must be >= 1"),
        (["--replicas", "2"], "add --ray local"),
        (["--replicas", "2", "--ray", "local", "--dtype", "fp64"], "unknown dtype"),
        (["--replicas", "2", "--ray", "local", "--threads", "0"], "--threads must be >= 1"),
        (["--replicas", "2", "--ray", "local", "--policy", "pask"], "--table"),
        (["--replicas", "2", "--ray", "local", "--budget", "2"], "(0, 1]"),
    ],
)
def test_cli_refuses_bad_replica_options_before_anything_starts(monkeypatch, args, words):
    def boom(*a, **k):
        raise AssertionError("nothing may start")

    monkeypatch.setattr("pask.cli.serving_model", boom)
    monkeypatch.setattr(replicas_mod, "deploy", boom)
    monkeypatch.setattr(replicas_mod, "connect", boom)
    res = runner.invoke(app, ["serve", *args])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert words in " ".join(res.output.split()), res.output


# -- pieces, without Ray -------------------------------------------------------------------------
def _state(ok: int, tokens: int, running: int, b_live: float, full: int) -> dict:
    return {
        "model": MODEL, "policy": "full", "requests": {"ok": ok}, "prompt_tokens": 10 * ok,
        "completion_tokens": tokens, "tpot_sum_s": 0.1 * ok, "tpot_count": ok, "ttft_sum_s": 0.2 * ok,
        "ttft_count": ok, "throughput": float(tokens),
        "gauges": {"running": running, "kv_bytes_full": full, "b_live": b_live, "b_finished": 0.5},
    }  # fmt: skip


def test_metrics_of_replicas_sum_and_a_silent_replica_retires(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(replicas_mod.time, "monotonic", lambda: clock[0])
    hub = replicas_mod.MetricsHub()
    hub.put("a", _state(3, 30, 1, 0.5, 100))
    hub.put("b", _state(2, 20, 2, 0.25, 300))
    live, gone = hub.collect()
    assert set(live) == {"a", "b"} and gone is None
    text = metrics_mod.render(metrics_mod.merge(list(live.values())), live)
    assert 'pask_requests_total{model="smollm2-135m",policy="full",outcome="ok"} 5' in text
    assert 'pask_completion_tokens_total{model="smollm2-135m",policy="full"} 50' in text
    assert 'pask_running{model="smollm2-135m",policy="full"} 3' in text
    assert 'pask_running{model="smollm2-135m",policy="full",replica="b"} 2' in text
    assert 'pask_kv_budget{model="smollm2-135m",policy="full",scope="live"} 0.3125' in text  # by Full-KV bytes
    assert 'scope="finished"} ' not in text  # a ratio of finished requests has no sum: per replica only
    assert 'pask_replicas{model="smollm2-135m",policy="full"} 2' in text
    assert 'pask_tpot_seconds_count{model="smollm2-135m",policy="full",replica=' not in text  # counters: sums
    clock[0] += replicas_mod.STALE_S + 1  # a dies; b publishes again
    hub.put("b", _state(4, 40, 0, 0.25, 300))
    live, gone = hub.collect()
    assert set(live) == {"b"} and gone["requests"] == {"ok": 3} and gone["gauges"] == {}
    total = metrics_mod.merge([*live.values(), gone])
    assert total["requests"] == {"ok": 7} and total["completion_tokens"] == 70  # counters never go down
    assert total["gauges"]["running"] == 0 and total["throughput"] == 40.0


def test_health_check_fails_when_the_decode_thread_is_dead():
    alive = SimpleNamespace(id="r", service=SimpleNamespace(worker=SimpleNamespace(alive=True)))
    replicas_mod.Replica.check_health(alive)
    alive.service.worker.alive = False
    with pytest.raises(RuntimeError, match="decode thread"):
        replicas_mod.Replica.check_health(alive)


# -- two replicas on a local Ray instance --------------------------------------------------------
def _ask(url: str, body: dict, streamed: bool) -> dict:
    """One request: status, replica, the message (text / tool calls without ids), finish reason, usage."""
    if not streamed:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        out = r.json()
        msg = out["choices"][0]["message"]
        calls = [c["function"] for c in msg.get("tool_calls") or []]
        return {"replica": r.headers.get("x-pask-replica"), "text": msg["content"], "calls": calls,
                "finish": out["choices"][0]["finish_reason"], "usage": out["usage"]}  # fmt: skip
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        replica = s.headers.get("x-pask-replica")
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    text = "".join(d.get("content") or "" for d in deltas)
    calls = [tc["function"] for d in deltas for tc in d.get("tool_calls") or []]
    finish = next(c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    return {"replica": replica, "text": text or None, "calls": calls, "finish": finish, "usage": chunks[-1]["usage"]}


def _all(url: str, jobs: list[tuple[dict, bool]]) -> list[dict]:
    """The requests sent together, each from its own thread."""
    out: list = [None] * len(jobs)

    def one(i: int) -> None:
        try:
            out[i] = _ask(url, *jobs[i])
        except BaseException as e:  # reported by the assertion below
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT)
    assert all(isinstance(o, dict) for o in out), out
    return out


@pytest.fixture(scope="module")
def reference(smol):
    """The answers of one in-process server (one torch thread, as each replica), sent together too."""
    from pask.policies import FullPolicy
    from pask.serving.server import Service, serve_in_thread

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        service = Service.build(smol, FullPolicy, capacity_tokens=4096, default_max_tokens=48)
        with serve_in_thread(service, start_timeout=30) as url:
            return _all(url, BODIES)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def served():
    """Two replicas (one thread, one Ray CPU each) on a local Ray instance of two CPUs."""
    pytest.importorskip("ray.serve")
    from pask.serving.replicas import ReplicaSpec, serve_replicas

    spec = ReplicaSpec(MODEL, "fp32", capacity_tokens=4096, max_tokens=48, threads=1)
    with serve_replicas(spec, replicas=2, address="local", num_cpus=2) as url:
        yield url


def test_replicas_answer_as_one_process(reference, served):
    got = _all(served, BODIES)
    for (body, _), want, have in zip(BODIES, reference, got, strict=True):
        assert have.pop("replica") and want.pop("replica") is None  # only replicas name themselves
        assert have == want, body
    assert got[2]["calls"] and got[3]["calls"][0]["name"] == "get_time"
    assert httpx.get(f"{served}/health").json()["status"] == "ok"
    assert httpx.get(f"{served}/v1/models").json()["data"][0]["id"] == MODEL


def _metrics(url: str) -> str:
    r = httpx.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


def _sample(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf'^pask_{name}{{model="{MODEL}",policy="full"{labels}}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _settled(url: str, cond, timeout: float = 10.0) -> str:
    """``/metrics`` once ``cond(text)`` holds (replicas publish every PUBLISH_S)."""
    end = time.time() + timeout
    text = _metrics(url)
    while not cond(text) and time.time() < end:
        time.sleep(0.25)
        text = _metrics(url)
    return text


def test_metrics_are_summed_over_the_replicas(served):
    before = _settled(served, lambda t: _sample(t, "running") == 0)
    ok0, tokens0 = _sample(before, "requests_total", ',outcome="ok"'), _sample(before, "completion_tokens_total")
    got = _all(served, [({**LONG, "max_tokens": 6}, False)] * 6)
    tokens = sum(g["usage"]["completion_tokens"] for g in got)
    text = _settled(served, lambda t: _sample(t, "requests_total", ',outcome="ok"') == ok0 + 6)
    assert _sample(text, "requests_total", ',outcome="ok"') == ok0 + 6
    assert _sample(text, "completion_tokens_total") == tokens0 + tokens
    assert _sample(text, "replicas") == 2
    names = set(re.findall(r'pask_kv_capacity_bytes\{[^}]*replica="([^"]+)"\}', text))
    assert len(names) == 2 and {g["replica"] for g in got} <= names
    assert _sample(text, "kv_capacity_bytes") == sum(
        _sample(text, "kv_capacity_bytes", f',replica="{n}"') for n in names
    )


def _replica_actors() -> dict[str, str]:
    """Replica id -> actor name of the running Serve replicas."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return {n.rsplit("#", 1)[-1]: n for n in names if n.startswith("SERVE_REPLICA::")}


def test_a_killed_replica_fails_its_own_requests_and_spares_the_others(served):
    import ray
    from ray import serve

    results: dict[int, tuple] = {}  # request -> (done | cut | failed, detail)
    replica_of: dict[int, str] = {}  # from the X-Pask-Replica header (a 5xx of the proxy has none)
    streaming = threading.Semaphore(0)

    def stream(i: int) -> None:
        try:
            url, body = f"{served}/v1/chat/completions", {**LONG, "stream": True}
            with httpx.stream("POST", url, json=body, timeout=TIMEOUT) as s:
                replica_of[i] = s.headers.get("x-pask-replica")
                streaming.release()
                lines = [x for x in s.iter_lines() if x.startswith("data: ")]
            results[i] = ("done" if lines and lines[-1] == "data: [DONE]" else "cut", s.status_code)
        except httpx.TransportError as e:  # the connection cut mid-stream: a clean end, no hang
            results[i] = ("cut", type(e).__name__)

    def plain(i: int) -> None:
        # a plain request gets an answer (200, or a 5xx for the dead replica): a transport error
        # ends the thread without a result, and the assertion below fails
        r = httpx.post(f"{served}/v1/chat/completions", json=LONG, timeout=TIMEOUT)
        if r.headers.get("x-pask-replica"):
            replica_of[i] = r.headers["x-pask-replica"]
        ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        results[i] = ("done", 200) if ok else ("failed", r.status_code, r.text)

    threads = [threading.Thread(target=stream if i % 2 == 0 else plain, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for _ in range(3):  # the three streams are decoding
        assert streaming.acquire(timeout=TIMEOUT)
    victim = replica_of[0]
    ray.kill(ray.get_actor(_replica_actors()[victim], namespace="serve"), no_restart=True)
    t_kill = time.time()
    for t in threads:
        t.join(2 * TIMEOUT)
    assert not any(t.is_alive() for t in threads) and len(results) == 6, results
    for i, res in results.items():
        if replica_of.get(i) not in (None, victim):  # on the other replica: complete
            assert res[0] == "done", (i, res)
        elif res[0] == "failed":  # the proxy's answer for the dead replica: a 5xx with a message
            assert res[1] >= 500 and res[2].strip(), (i, res)
    assert results[0][0] == "cut"  # the victim's stream ended without [DONE]

    end = t_kill + 2 * TIMEOUT  # Serve replaces the dead replica
    while time.time() < end:
        status = serve.status().applications["pask"]
        actors = _replica_actors()
        running = status.deployments["pask"].replica_states.get("RUNNING") == 2
        if running and len(actors) == 2 and victim not in actors:  # the actor list can lag the status
            break
        time.sleep(0.5)
    assert len(actors) == 2 and victim not in actors, actors
    got = _all(served, [({**LONG, "max_tokens": 4}, False)] * 4)
    assert all(g["finish"] in ("stop", "length") for g in got)
    assert httpx.get(f"{served}/health").json()["status"] == "ok"
