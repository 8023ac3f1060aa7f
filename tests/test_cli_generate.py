"""`pask generate`: KV policy options on the one API path; requests, schemas and policy options are
checked before the model loads (exit 2, one message, no traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from pask.cli import app

runner = CliRunner()
TABLES = Path(__file__).resolve().parents[1] / "pask" / "tables"
QWEN_TABLE = TABLES / "qwen2.5-coder-0.5b-bfcl-b0.33.json"
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
SMOL = ["--model", "smollm2-135m", "--dtype", "fp32", "--threads", "1"]


def _tool(params: dict) -> dict:
    return {"type": "function", "function": {"name": "get_weather", "parameters": params}}


WEATHER = _tool({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


def _request(tmp_path: Path, body: dict | str) -> str:
    path = tmp_path / "request.json"
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return str(path)


def _run(*args: str):
    res = runner.invoke(app, list(args))
    assert "Traceback" not in res.output, res.output
    return res


def _output(res) -> str:
    return " ".join(res.output.split())  # rich wraps long messages


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test: the checks must come first."""

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("pask.runtime.models.load_model", load)
    monkeypatch.setattr("pask.api.load", load)


def test_kivi_at_half_budget_reports_measured_b_and_tags(tmp_path):
    req = _request(tmp_path, {"messages": MESSAGES, "tools": [WEATHER]})
    res = _run("generate", req, *SMOL, "--policy", "kivi-4", "--budget", "0.5", "--max-new-tokens", "40", "--save-tags")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["model"] == "smollm2-135m" and out["policy"] == "kivi-4" and out["target_b"] == 0.5
    assert out["stop_reason"] in ("eos", "grammar", "length") and out["text"].startswith("<tool_call>")
    assert all(c["name"] == "get_weather" for c in out["calls"])
    assert 0 < out["budget"]["b_total"] < 1 and abs(out["budget"]["b_total"] - 0.5) < 0.1
    assert set(out["timings"]) == {"prefill_ms", "tpot_ms"} and out["n_generated"] == len(out["tags"])
    assert all(t["tag"] for t in out["tags"])


def test_pask_without_table_uses_the_committed_one(tmp_path, monkeypatch):
    """qwen2.5-coder-0.5b at B 0.33 has a committed table: it goes to pask.api.generate (no real run here)."""
    import pask.api
    from pask.runtime.models import LoadedModel

    seen = {}
    model = LoadedModel("qwen2.5-coder-0.5b", None, None, json.loads(QWEN_TABLE.read_text())["model"]["fingerprint"])
    monkeypatch.setattr(pask.api, "load", lambda name, dtype, weights=None: model)

    def generate(lm, messages, **kw):
        seen.update(kw)
        return pask.api.Result("<tool_call>", [], budget={"b_total": 0.33}, timings={"tpot_ms": 1.0})

    monkeypatch.setattr(pask.api, "generate", generate)
    req = _request(tmp_path, {"messages": MESSAGES, "tools": [WEATHER]})
    res = _run("generate", req, "--model", "qwen2.5-coder-0.5b", "--policy", "pask", "--budget", "0.33")
    assert res.exit_code == 0, res.output
    assert seen["policy"] == "pask" and seen["budget"] == 0.33 and Path(seen["table"]) == QWEN_TABLE
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["table"] == str(QWEN_TABLE) and out["budget"] == {"b_total": 0.33}


def test_pask_without_a_committed_table_is_a_clear_error(tmp_path, no_model):
    req = _request(tmp_path, {"messages": MESSAGES, "tools": [WEATHER]})
    res = _run("generate", req, *SMOL, "--policy", "pask", "--budget", "0.5")
    text = _output(res)
    assert res.exit_code == 2, res.output
    assert "--policy pask needs --table FILE" in text and "no committed PASK table for model 'smollm2-135m'" in text
    assert "qwen2.5-coder-0.5b at B 0.15, 0.2, 0.25, 0.33" in text and "pask calibrate" in text
    res = _run("generate", req, *SMOL, "--policy", "pask")
    assert res.exit_code == 2 and "needs --budget" in _output(res)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--table", str(TABLES / "qwen2.5-coder-0.5b-sql-b0.4.json"), "--budget", "0.4"],
            "for task 'sql', not 'bfcl'",
        ),
        (["--table", str(QWEN_TABLE), "--budget", "0.25"], "calibrated for B = 0.33, not --budget 0.25"),
        (["--table", "absent.json", "--budget", "0.33"], "absent.json does not exist"),
        (["--budget", "0.33", "--policy-config", '{"x": 1}'], "--policy-config does not apply"),
    ],
)
def test_pask_table_errors_before_the_model_loads(tmp_path, no_model, args, message):
    req = _request(tmp_path, {"messages": MESSAGES, "tools": [WEATHER]})
    res = _run("generate", req, *SMOL, "--policy", "pask", *args)
    assert res.exit_code == 2 and message in _output(res), res.output


def test_table_of_another_model_needs_allow_transfer(tmp_path, smol, monkeypatch):
    """The committed qwen table on smollm2-135m: the fingerprint check names both models and the flag."""
    import pask.api

    monkeypatch.setattr(pask.api, "load", lambda name, dtype, weights=None: smol)
    req = _request(tmp_path, {"messages": MESSAGES, "tools": [WEATHER]})
    pask_args = ["--policy", "pask", "--budget", "0.33", "--table", str(QWEN_TABLE), "--max-new-tokens", "8"]
    res = _run("generate", req, *SMOL, *pask_args)
    text = _output(res)
    assert res.exit_code == 2, res.output
    assert "calibrated on model qwen2.5-coder-0.5b" in text and "not on smollm2-135m" in text
    assert "--allow-transfer" in text
    res = _run("generate", req, *SMOL, *pask_args, "--allow-transfer")
    assert res.exit_code == 0, res.output
    assert "warning:" in res.stderr and "calibration transfer" in " ".join(res.stderr.split())
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["policy"] == "pask" and 0 < out["budget"]["b_total"] < 1


@pytest.mark.parametrize(
    "prop, words",
    [
        ({"type": "integer", "minimum": 10, "maximum": 1}, "minimum 10 > maximum 1"),
        ({"type": "string", "enum": []}, "enum is empty"),
    ],
)
def test_unsatisfiable_schema_fails_before_the_model_loads(tmp_path, no_model, prop, words):
    tool = _tool({"type": "object", "properties": {"days": prop}, "required": ["days"]})
    req = _request(tmp_path, {"messages": MESSAGES, "tools": [tool]})
    res = _run("generate", req, *SMOL)
    text = _output(res)
    assert res.exit_code == 2, res.output
    assert "tool 'get_weather', property 'days'" in text and words in text


def test_unsatisfiable_response_format_fails_before_the_model_loads(tmp_path, no_model):
    fmt = {"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 5, "maximum": 1}}}
    res = _run("generate", _request(tmp_path, {"messages": MESSAGES, "response_format": fmt}), *SMOL)
    assert res.exit_code == 2 and "response_format" in res.output and "minimum 5 > maximum 1" in _output(res)


@pytest.mark.parametrize(
    "body, message",
    [
        ("{not json", "is not valid JSON"),
        ("[]", "non-empty 'messages'"),
        ({"messages": [{"content": "x"}], "tools": [WEATHER]}, "messages[0] must be an object with a 'role'"),
        ({"messages": MESSAGES}, "non-empty 'tools'"),
        ({"messages": MESSAGES, "tools": [WEATHER], "response_format": {"type": "json_object"}}, "not both"),
        ({"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format must be"),
        ({"messages": MESSAGES, "tools": [WEATHER, WEATHER]}, "defined twice"),
    ],
)
def test_bad_request_files(tmp_path, no_model, body, message):
    res = _run("generate", _request(tmp_path, body), *SMOL)
    assert res.exit_code == 2 and message in _output(res), res.output


def test_missing_unreadable_or_binary_request_file(tmp_path, no_model):
    res = _run("generate", str(tmp_path / "absent.json"), *SMOL)
    assert res.exit_code == 2 and "absent.json" in res.output
    res = _run("generate", str(tmp_path), *SMOL)
    assert res.exit_code == 2 and "directory" in res.output.lower()
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    res = _run("generate", str(tmp_path / "bin.json"), *SMOL)
    assert res.exit_code == 2 and "not UTF-8" in res.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policy", "magic"], "unknown policy"),
        (["--policy", "kivi-4", "--budget", "1.5"], "(0, 1]"),
        (["--policy", "snapkv", "--budget", "0.5", "--policy-config", "{bad"], "not valid JSON"),
        (["--table", str(QWEN_TABLE)], "--table is for --policy pask"),
        (["--dtype", "int8"], "unknown dtype 'int8'"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ],
)
def test_bad_options_fail_before_the_model_loads(tmp_path, no_model, args, message):
    req = _request(tmp_path, {"messages": MESSAGES, "tools": [WEATHER]})
    res = _run("generate", req, *SMOL, *args)
    assert res.exit_code == 2 and message in _output(res), res.output


def test_every_option_has_help():
    command = typer.main.get_command(app).commands["generate"]
    missing = [p.name for p in command.params if not getattr(p, "help", None)]
    assert not missing, missing
    names = {p.name for p in command.params}
    assert {"policy", "budget", "table", "policy_config", "allow_transfer"} <= names
