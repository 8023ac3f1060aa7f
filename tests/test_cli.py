"""CLI: bad input gives one clear message and a non-zero exit, never a traceback."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pask.cli import app
from pask.runtime import models

runner = CliRunner()
MINIMAL = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"function": {"name": "f"}}]}


def _run(*args: str):
    res = runner.invoke(app, list(args))
    assert "Traceback" not in res.output
    return res


def test_unknown_model(tmp_path):
    req = tmp_path / "r.json"
    req.write_text(json.dumps(MINIMAL))
    res = _run("generate", str(req), "--model", "no-such-model")
    assert res.exit_code == 2 and "unknown model 'no-such-model'" in res.output


def test_unknown_category():
    res = _run("eval", "bfcl", "--categories", "simple,bogus", "--limit", "1")
    assert res.exit_code == 2 and "unknown BFCL category 'bogus'" in res.output


def test_unknown_policy_and_bad_budget():
    res = _run("eval", "bfcl", "--policy", "magic", "--limit", "1")
    assert res.exit_code == 2 and "unknown policy" in res.output
    res = _run("eval", "bfcl", "--budget", "1.5", "--limit", "1")
    assert res.exit_code == 2 and "(0, 1]" in res.output


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        ('{"messages": []}', "non-empty 'messages'"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "non-empty 'tools'"),
        ('{"messages": [{"role": "user", "content": "x"}], "tools": [{"x": 1}]}', "every tool needs"),
    ],
)
def test_malformed_request_file(tmp_path, content, message):
    req = tmp_path / "r.json"
    req.write_text(content)
    res = _run("generate", str(req))
    assert res.exit_code == 2 and message in res.output


def test_missing_request_file(tmp_path):
    res = _run("generate", str(tmp_path / "absent.json"))
    assert res.exit_code == 2 and "absent.json" in res.output


def test_corrupt_model_part(tmp_path, monkeypatch):
    from tests.test_models import _fake_parts

    _fake_parts(tmp_path, monkeypatch, [b"abc", b"def"])
    (tmp_path / "pask_fake_part1" / "data" / "part01.bin").write_bytes(b"XXX")
    req = tmp_path / "r.json"
    req.write_text(json.dumps(MINIMAL))
    res = _run("generate", str(req), "--model", "fake")
    assert res.exit_code == 2 and "corrupt" in res.output and "pip install" in res.output
    assert isinstance(models.EMBEDDED["fake"], models.EmbeddedModel)


def test_unsatisfiable_schema(tmp_path):
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {}, "required": ["x"], "additionalProperties": False},
        },
    }
    req = tmp_path / "r.json"
    req.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": [tool]}))
    res = _run("generate", str(req), "--model", "smollm2-135m")
    assert res.exit_code == 2 and "nsatisfiable" in res.output


def test_bench_kv_bad_mix():
    res = _run("bench", "kv", "--mix", "0.5:0.6:0.1")
    assert res.exit_code == 2 and "summing to 1" in res.output
    for bad in ("0.2:0.2:0.2:0.2:0.2", "0.5:0.5:0.1:-0.1", "0.3:0.3:0.3:nan"):
        res = _run("bench", "kv", "--mix", bad)
        assert res.exit_code == 2 and "summing to 1" in res.output, bad
    res = _run("bench", "kv", "--contexts", "abc")
    assert res.exit_code == 2 and "--contexts" in res.output


def test_policy_config_errors():
    res = _run("eval", "bfcl", "--policy", "static_mix", "--policy-config", "{bad", "--limit", "1")
    assert res.exit_code == 2 and "not valid JSON" in res.output
    res = _run("eval", "bfcl", "--policy", "static_mix", "--policy-config", '{"h": 1, "zz": 2}', "--limit", "1")
    assert res.exit_code == 2 and "bad configuration" in res.output


def test_pask_policy_needs_a_table(tmp_path):
    res = _run("eval", "bfcl", "--policy", "pask", "--limit", "1")
    assert res.exit_code == 2 and "--table" in res.output


@pytest.mark.parametrize(
    "task, extra, header, record",
    [
        (
            "bfcl",
            ["--categories", "simple,parallel"],
            "| simple | parallel | Overall |",
            {"categories": ["simple", "parallel"]},
        ),
        ("sql", [], "| Easy EX | Medium EX | Hard EX | Extra EX | Overall EX |", {"limit": 1}),
    ],
)
def test_eval_task_runs(tmp_path, task, extra, header, record):
    """`pask eval bfcl|sql`: one command; each task's table, rows and run record (its task options)."""
    out = tmp_path / "run"
    args = ["--model", "smollm2-135m", "--dtype", "fp32", "--threads", "1", "--limit", "1", "--max-new-tokens", "8"]
    res = _run("eval", task, *args, *extra, "--out", str(out))
    assert res.exit_code == 0, res.output
    assert header in res.output and "| smollm2-135m | full | 1.000 |" in res.output
    rows = [json.loads(x) for x in (out / "cases.jsonl").read_text().splitlines()]
    assert len(rows) == (2 if task == "bfcl" else 1) and all(0 < r["n_generated"] <= 8 for r in rows)
    run = json.loads((out / "summary.json").read_text())["run"]
    assert {k: run[k] for k in ("model", "policy", "budget", "split", *record)} == {
        "model": "smollm2-135m",
        "policy": "full",
        "budget": None,
        "split": "test",
        **record,
    }
    assert (out / "summary.md").read_text().count(header) == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["eval", "sql", "--categories", "x"],
            "--categories is not an option of task sql (it takes: --data-dir, --sql-scope)",
        ),
        (["eval", "bfcl", "--sql-scope", "on"], "--sql-scope is not an option of task bfcl"),
        (["eval", "sql", "--sql-scope", "maybe"], "sql_scope must be on or off, got 'maybe'"),
        (["eval", "bfcl", "--data-dir", "."], "--data-dir is not an option of task bfcl (it takes: --categories)"),
        (["eval", "bfcl", "--option", "colour=red"], "task bfcl has no option 'colour'"),
        (["eval", "bfcl", "--option", "categories=simple", "--categories", "simple"], "given twice"),
        (["eval", "nosuchtask"], "unknown task 'nosuchtask'; known tasks: bfcl, ruler, sql"),
        (["eval", "ruler", "--tasks", "nope"], "unknown ruler sub-task(s) nope; known: niah_single, niah_multikey,"),
        (["eval", "ruler", "--length", "100"], "ruler length must be an integer number of tokens in [256, 131072]"),
        (["eval", "ruler", "--option", "answer_format=xml"], "ruler answer_format must be one of auto, text, json"),
        (["eval", "bfcl", "--length", "4096"], "--length is not an option of task bfcl"),
        (["eval", "sql", "--tasks", "vt"], "--tasks is not an option of task sql"),
        (["eval", "bfcl", "--limit", "0"], "--limit must be >= 1, got 0"),
        (["eval", "sql", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["eval", "sql", "--budget", "nan", "--policy", "h2o"], "--budget must be in (0, 1], got nan"),
        (["eval", "bfcl", "--categories", "live_simple", "--split", "dev"], "no bfcl cases in split 'dev'"),
    ],
)
def test_eval_bad_task_options(args, message):
    """Options of another task, unknown tasks and bad numbers: exit 2 before any model loads."""
    res = _run(*args, "--model", "no-model-needed")
    assert res.exit_code == 2 and message in " ".join(res.output.split()), res.output


def test_eval_needs_a_task():
    res = _run("eval")
    assert res.exit_code == 2 and "Missing argument 'TASK'" in res.output


def test_serving_pask_needs_a_function_calling_table():
    """``pask serve --policy pask`` fails before the model loads without a table; an SQL table is refused."""
    from pathlib import Path

    from pask.cli import serving_policy_factory
    from pask.errors import PaskError
    from pask.policies import PaskPolicy

    res = _run("serve", "--policy", "pask")
    assert res.exit_code == 2 and "--table" in res.output
    tables = Path(__file__).resolve().parents[1] / "pask" / "tables"
    with pytest.raises(PaskError, match="calibrated for task 'sql', not 'bfcl'"):
        serving_policy_factory("pask", None, None, tables / "qwen2.5-coder-0.5b-sql-b0.4.json")
    factory = serving_policy_factory("pask", 0.33, None, tables / "qwen2.5-coder-0.5b-bfcl-b0.33.json")
    assert isinstance(factory(), PaskPolicy) and factory() is not factory()  # one instance per request


def test_calibrate_refuses_test_split_and_bad_budget(tmp_path):
    res = _run("calibrate", "--split", "test", "--out", str(tmp_path / "t.json"))
    assert res.exit_code == 2
    res = _run("calibrate", "--budget", "0", "--out", str(tmp_path / "t.json"))
    assert res.exit_code == 2 and "(0, 1]" in res.output
    res = _run("calibrate", "--alpha-p", "1.5", "--out", str(tmp_path / "t.json"))
    assert res.exit_code == 2 and "--alpha-p must be in [0, 1)" in res.output
    res = _run("calibrate", "--alpha-d", "-0.1", "--out", str(tmp_path / "t.json"))
    assert res.exit_code == 2 and "--alpha-d must be in [0, 1)" in res.output
    res = _run("calibrate", "--distortion-scope", "some", "--out", str(tmp_path / "t.json"))
    assert res.exit_code == 2 and "--distortion-scope must be 'all' or 'allowed'" in res.output
    res = _run("calibrate", "--fit", "budget", "--out", str(tmp_path / "t.json"))
    assert res.exit_code == 2 and "--fit must be 'floors' or 'sensitivity'" in res.output
    res = _run("calibrate", "--envelope", "tree", "--out", str(tmp_path / "t.json"))
    assert res.exit_code == 2 and "--envelope must be 'chain' or 'branch'" in res.output
    res = _run("calibrate", "--budget", "0.2", "--b-offset", "0.25", "--out", str(tmp_path / "t.json"))
    assert res.exit_code == 2 and "outside (0, 1]" in res.output


def test_tune_bad_input():
    res = _run("tune", "--policy", "h2o", "--split", "test")
    assert res.exit_code == 2 and "leak" in res.output
    res = _run("tune", "--policy", "h2o", "--categories", "live_simple")
    assert res.exit_code == 2 and "evaluation-only" in res.output
    res = _run("tune", "--policy", "magic")
    assert res.exit_code == 2 and "unknown policy" in res.output
    res = _run("tune", "--policy", "h2o", "--budget", "0")
    assert res.exit_code == 2 and "(0, 1]" in res.output
    res = _run("tune", "--policy", "h2o", "--search", "random", "--limit", "1")
    assert res.exit_code == 2
    res = _run("tune", "--policy", "h2o", "--task", "magic")
    assert res.exit_code == 2 and "unknown task" in res.output
    res = _run("tune", "--policy", "h2o", "--task", "sql", "--split", "calibration")
    assert res.exit_code == 2 and "dev split" in res.output


def test_calibrate_task_errors(tmp_path):
    out = str(tmp_path / "t.json")
    res = _run("calibrate", "--task", "sql", "--split", "test", "--out", out)
    assert res.exit_code == 2 and "leak" in res.output
    res = _run("calibrate", "--task", "sql", "--categories", "simple", "--out", out)
    assert res.exit_code == 2 and "no categories" in res.output
    res = _run("calibrate", "--task", "magic", "--out", out)
    assert res.exit_code == 2 and "bfcl, ruler, sql" in res.output
