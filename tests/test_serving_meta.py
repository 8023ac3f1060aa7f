"""MetaKV in the server: per-request limits in the body's ``pask`` field choose the configuration."""

from __future__ import annotations

import json

import httpx2 as httpx
import pytest

from pask.meta.candidates import Candidate
from pask.meta.predictor import fit
from pask.meta.selection import Constraints
from pask.meta.selector import MetaSelector
from tests.test_meta import _observations
from tests.test_serving import ASK_WEATHER, WEATHER

CANDS = [Candidate("full"), Candidate("kivi-4", 0.33), Candidate("snapkv", 0.33)]


@pytest.fixture(scope="module")
def meta_server(smol):
    from pask.serving.server import Service, serve_in_thread

    pred = fit(_observations(), CANDS, model_name=smol.name, fingerprint=smol.fingerprint, task="bfcl",
               bytes_per_token=12288, batch_size=2, max_new_tokens=48, folds=1)  # fmt: skip
    selector = MetaSelector(pred, Constraints(), fingerprint=smol.fingerprint)
    service = Service.build(smol, None, capacity_tokens=4096, default_max_tokens=32, selector=selector)
    with serve_in_thread(service, start_timeout=30) as url:
        yield url, service


def _post(url: str, body: dict) -> httpx.Response:
    data = json.dumps(body).encode()
    return httpx.post(f"{url}/v1/chat/completions", content=data, headers={"content-type": "application/json"},
                      timeout=300)  # fmt: skip


def test_tight_limits_get_a_cheaper_configuration(meta_server):
    from openai import OpenAI

    url, _ = meta_server
    client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=300)
    args = {"model": "smollm2-135m", "messages": ASK_WEATHER, "tools": [WEATHER], "max_tokens": 24}
    loose = client.chat.completions.create(**args, extra_body={"pask": {"max_kv_mb": 1000}})
    tight = client.chat.completions.create(**args, extra_body={"pask": {"max_kv_mb": 0.5, "max_latency_ms": 1e6}})
    pick = {}
    for name, r in (("loose", loose), ("tight", tight)):
        meta = r.model_extra["pask"]["meta"]
        pick[name] = meta
        assert meta["configuration"] in ("full", "kivi-4@0.33", "snapkv@0.33")
        assert len(meta["predictions"]) == 3
    kv = {p["candidate"]: p["kv_mb"] for p in pick["loose"]["predictions"]}
    assert kv[pick["tight"]["configuration"]] < kv[pick["loose"]["configuration"]]
    assert pick["tight"]["configuration"] != "full"
    # the bytes held follow the choice: the tight request's measured B is below Full KV's
    assert tight.model_extra["pask"]["budget"]["b_total"] < 0.6
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert 'pask_meta_choices_total{model="smollm2-135m",policy="meta",configuration=' in metrics


def test_streamed_response_reports_the_choice(meta_server):
    url, _ = meta_server
    body = {"model": "smollm2-135m", "messages": ASK_WEATHER, "tools": [WEATHER], "max_tokens": 16, "stream": True,
            "pask": {"max_kv_mb": 0.5}}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/chat/completions", content=json.dumps(body).encode(),
                      headers={"content-type": "application/json"}, timeout=300) as r:  # fmt: skip
        assert r.status_code == 200
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    final = [e for e in events if "pask" in e]
    assert len(final) == 1 and final[0]["pask"]["meta"]["configuration"] != "full"


@pytest.mark.parametrize(
    ("limits", "match"),
    [({"max_kv_mb": -1}, "'pask.max_kv_mb' must be a positive number"),
     ({"max_kv_mb": "5"}, "'pask.max_kv_mb' must be a positive number"),
     ({"max_latency_ms": 0}, "'pask.max_latency_ms' must be a positive number"),
     ({"max_memory": 5}, "pask.max_memory"),
     ("tight", "invalid type for 'pask'")],
)  # fmt: skip
def test_bad_limits_get_400(meta_server, limits, match):
    url, _ = meta_server
    r = _post(url, {"model": "smollm2-135m", "messages": ASK_WEATHER, "pask": limits})
    assert r.status_code == 400, r.text
    assert match in r.json()["error"]["message"]


def test_a_one_policy_server_refuses_limits(smol):
    from pask.policies import FullPolicy
    from pask.serving.server import Service, serve_in_thread

    service = Service.build(smol, FullPolicy, capacity_tokens=2048, default_max_tokens=8)
    with serve_in_thread(service, start_timeout=30) as url:
        r = _post(url, {"model": "smollm2-135m", "messages": ASK_WEATHER, "pask": {"max_kv_mb": 2}})
    assert r.status_code == 400 and "start it with --policy meta" in r.json()["error"]["message"]


def test_serve_meta_cli_errors(tmp_path, smol):
    from typer.testing import CliRunner

    from pask.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["serve", "--policy", "meta"])
    assert res.exit_code == 2 and "needs --meta FILE" in res.output
    res = runner.invoke(app, ["serve", "--max-kv-mb", "3"])
    assert res.exit_code == 2 and "options of --policy meta" in res.output
    pred = fit(_observations(), CANDS, model_name=smol.name, fingerprint=smol.fingerprint, task="bfcl",
               bytes_per_token=12288, batch_size=2, max_new_tokens=48, folds=1)  # fmt: skip
    path = tmp_path / "m.json"
    pred.save(path)
    res = runner.invoke(app, ["serve", "--policy", "meta", "--meta", str(path), "--meta-candidates", "full,h2o@0.2"])
    assert res.exit_code == 2 and "unknown ['h2o@0.2']" in res.output
    res = runner.invoke(app, ["serve", "--policy", "meta", "--meta", str(path), "--max-latency-ms", "nan"])
    assert res.exit_code == 2 and "--max-latency-ms must be a positive finite number" in res.output
    res = runner.invoke(app, ["serve", "--policy", "meta", "--meta", str(path), "--ray", "local"])
    assert res.exit_code == 2 and "drop --ray" in res.output
