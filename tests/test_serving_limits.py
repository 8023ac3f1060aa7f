"""Limits and controls of ``pask serve`` (docs/serving.md, "Limits and controls"): body size (413),
queue length (429), per-request deadline (504 / a stream's error event), tokenisation off the event
loop, non-streaming disconnects, the API key (401), JSON Content-Type (415), docs off by default,
``/health`` of a dead decode thread (503)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx2 as httpx
import pytest

from pask.policies import FullPolicy
from pask.serving.server import Limits

MODEL = "smollm2-135m"
HI = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 1}
# decodes for as long as it is let (max_tokens 400: tens of seconds on a CPU)
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Count from 1 to 1000, separated by commas."}],
        "max_tokens": 400}  # fmt: skip
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(smol):
    """The app on a loopback port (uvicorn in a thread), Full KV, one request decoding at a time."""
    from pask.serving.server import Service, serve_in_thread

    service = Service.build(smol, FullPolicy, capacity_tokens=4096, default_max_tokens=16, max_batch=1)
    with serve_in_thread(service, start_timeout=30) as url:
        yield url, service


def _post(url: str, body, headers: dict | None = None, timeout: float = 60, **kw) -> httpx.Response:
    """POST a dict as JSON, or bytes / an iterator of bytes (chunked) as they are; JSON Content-Type by default."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = JSON if headers is None else headers
    return httpx.post(f"{url}/v1/chat/completions", content=data, headers=headers, timeout=timeout, **kw)


def _raw_post(url: str, body: dict) -> socket.socket:
    """Send a request on a bare socket and leave it unread: closing the socket is a client disconnect."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _wait(cond, timeout: float = 60.0) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def _idle(service) -> bool:
    g = service.metrics.gauges
    return not g.get("running") and not g.get("waiting") and g.get("kv_bytes_held") == 0


def _count(service, outcome: str) -> int:
    return service.metrics.requests.get(outcome, 0)


def _limits(monkeypatch, service, **kw) -> None:
    monkeypatch.setattr(service, "limits", Limits(**kw), raising=False)


def _asgi_get(app, path: str) -> int:
    """Status of a GET on the ASGI app itself (no server, no lifespan)."""
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": [],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}  # fmt: skip
    asyncio.run(app(scope, receive, send))
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_body_over_the_limit_is_413_before_it_is_parsed(server, monkeypatch):
    url, service = server
    _limits(monkeypatch, service, max_body_bytes=2000)
    big = {**HI, "messages": [{"role": "user", "content": "word " * 1000}]}  # valid, 5 kB
    before = _count(service, "rejected")
    r = _post(url, big)  # Content-Length says it
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large" and "2000 bytes" in r.json()["error"]["message"]
    data = json.dumps(big).encode()
    r = _post(url, iter([data[i : i + 500] for i in range(0, len(data), 500)]))  # chunked: no Content-Length
    assert r.status_code == 413, r.text
    assert _post(url, b"{" * 3000).status_code == 413  # too large, whatever it holds: never parsed
    assert _count(service, "rejected") == before + 3
    assert _post(url, HI).status_code == 200  # under the limit


def test_full_queue_is_429_with_retry_after(server, monkeypatch):
    url, service = server
    _limits(monkeypatch, service, max_queue=1)
    running = _raw_post(url, LONG)
    assert _wait(lambda: service.metrics.gauges.get("running") == 1)
    waiting = _raw_post(url, LONG)  # max_batch 1: it waits for admission
    assert _wait(lambda: service.metrics.gauges.get("waiting") == 1)
    try:
        r = _post(url, HI, timeout=20)
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) > 0 and r.json()["error"]["code"] == "queue_full"
        assert _count(service, "overloaded") >= 1
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        waiting.close()
        running.close()
    assert _wait(lambda: _idle(service))
    assert _post(url, HI).status_code == 200  # room again


def test_request_past_its_deadline_is_cancelled_with_504_or_a_stream_error(server, monkeypatch):
    url, service = server
    _limits(monkeypatch, service, request_timeout=1.5)
    before = _count(service, "timeout")
    t0 = time.perf_counter()
    r = _post(url, LONG, timeout=30)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "request_timeout" and time.perf_counter() - t0 < 10
    assert _wait(lambda: _idle(service) and _count(service, "timeout") == before + 1)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**LONG, "stream": True}, timeout=30) as s:
        assert s.status_code == 200  # the stream had begun: it ends with an error event
        lines = [x[6:] for x in s.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "request_timeout"
    assert _wait(lambda: _idle(service) and _count(service, "timeout") == before + 2)
    g = service.metrics.gauges
    assert g["kv_bytes_held"] == 0 and g["kv_bytes_reserved"] == 0


def test_health_answers_while_a_large_body_is_tokenised(server, monkeypatch):
    url, service = server
    _limits(monkeypatch, service, max_body_bytes=16 << 20)
    big = {**HI, "messages": [{"role": "user", "content": "hello world " * 420_000}]}  # 5 MB: seconds to tokenise
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", _post(url, big, timeout=300)))
    thread.start()
    time.sleep(0.3)  # the body arrives; templating and tokenisation begin
    latencies = []
    while thread.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(f"{url}/health", timeout=300).status_code == 200
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.1)
    thread.join()
    assert out["r"].status_code == 400 and out["r"].json()["error"]["code"] == "context_length_exceeded"
    assert len(latencies) >= 3 and max(latencies) < 1.0, latencies


def test_disconnected_client_cancels_a_non_streaming_request(server):
    url, service = server
    ok, cancelled = _count(service, "ok"), _count(service, "cancelled")
    sock = _raw_post(url, LONG)
    assert _wait(lambda: service.metrics.gauges.get("running") == 1 and service.metrics.gauges["kv_bytes_held"] > 0)
    t0 = time.perf_counter()
    sock.close()
    assert _wait(lambda: _idle(service))
    assert time.perf_counter() - t0 < 10  # not decoded to max_tokens
    assert _count(service, "cancelled") == cancelled + 1 and _count(service, "ok") == ok
    g = service.metrics.gauges
    assert g["kv_bytes_held"] == 0 and g["kv_bytes_reserved"] == 0


def test_api_key_guards_v1_only(server, monkeypatch):
    import openai

    url, service = server
    _limits(monkeypatch, service, api_key="s3cret-key")
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic s3cret-key"}):
        r = _post(url, HI, {**JSON, **headers})
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert _post(url, HI, {**JSON, "authorization": "Bearer s3cret-key"}).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret-key")
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope").models.list()


def test_post_needs_a_json_content_type(server):
    url, _ = server
    for headers in ({"content-type": "text/plain", "origin": "http://evil.example"}, {}):
        r = _post(url, HI, headers)
        assert r.status_code == 415, r.text
        assert r.json()["error"]["code"] == "unsupported_media_type"
    assert _post(url, HI, {"content-type": "application/json; charset=utf-8"}).status_code == 200


def test_docs_are_off_unless_asked(server):
    from pask.serving.server import create_app

    url, service = server
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{url}{path}").status_code == 404, path
    with_docs = create_app(dataclasses.replace(service, limits=Limits(docs=True)))
    assert [_asgi_get(with_docs, p) for p in ("/docs", "/redoc", "/openapi.json")] == [200, 200, 200]


def test_health_is_503_when_the_decode_thread_is_dead(server, monkeypatch):
    from pask.serving.metrics import Metrics
    from pask.serving.worker import Worker

    url, service = server
    r = httpx.get(f"{url}/health")
    assert r.status_code == 200 and r.json()["decode_thread"] == "alive"
    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join()
    monkeypatch.setattr(service.worker, "_thread", dead)
    r = httpx.get(f"{url}/health")
    assert r.status_code == 503 and r.json()["status"] == "unavailable" and r.json()["decode_thread"] == "dead"
    assert _post(url, HI).status_code == 503  # not queued for a thread that will never take it
    monkeypatch.undo()
    assert httpx.get(f"{url}/health").status_code == 200

    # an error outside a step ends the thread: alive turns False, and jobs in flight end with an error
    calls = []

    def snapshot():
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("boom")
        return {}

    failed = []
    fake = SimpleNamespace(listeners=[], tokenizer_lock=threading.Lock(), idle=True, snapshot=snapshot,
                           capacity=SimpleNamespace(capacity_bytes=0), fail_all=failed.append)  # fmt: skip
    worker = Worker(fake, Metrics())
    worker.start()
    assert _wait(lambda: not worker.alive, 10)
    assert failed and "decode thread died" in failed[0]
