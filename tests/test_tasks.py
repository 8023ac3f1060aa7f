"""The task interface: registry, a third (toy) task run by the runner, the sweep, calibration and
`pask eval` without changing them; row layout of the built-in tasks; the one budget check."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from typer.testing import CliRunner

from pask.errors import PaskError
from pask.evaluation.runner import error_row, prepare, run_task
from pask.kv.budget import check_budget
from pask.tasks import TASKS, Output, Task, TaskRequest, get_task, register_task, task_names
from pask.tasks.base import table_lines

TIMING = ("prefill_ms", "tpot_ms")


# -- a toy task: "is N even?" answered yes / no under a two-word grammar --------------------------------
@dataclass(frozen=True)
class Question:
    id: str
    n: int


class ParityTask(Task):
    name = "parity"
    splits = ("calibration", "test")
    options: ClassVar[dict[str, Any]] = {"count": 3, "words": ["yes", "no"], "broken": False}
    default_max_new_tokens = 4
    score_key = "accuracy"

    def cases(self, split, limit=None, count=3, words=None, broken=False):
        if split not in self.splits:
            raise PaskError(f"unknown split '{split}'")
        start = 0 if split == "test" else 100
        return [Question(f"q{n}", n) for n in range(start, start + count)][:limit]

    def request(self, case, tokenizer, tagging=False, count=3, words=("yes", "no"), broken=False):
        messages = [{"role": "user", "content": f"Is {case.n} an even number? Answer yes or no."}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if broken and case.n == 0:
            return TaskRequest(ids, "start: undefined_rule")  # does not compile: a schema_error row
        grammar = "start: " + " | ".join(json.dumps(w) for w in words)
        return TaskRequest(ids, grammar, parse=str.strip, prompt_labels=["p"] * len(ids) if tagging else None)

    def case_fields(self, case):
        return {"id": case.id, "even": case.n % 2 == 0}

    def check(self, case, output, **options):
        if output.error is not None:
            return {"correct": False, "error": output.error}
        expected = "yes" if case.n % 2 == 0 else "no"
        return {"correct": output.parsed == expected, "error": None}

    def summarize(self, rows):
        n, correct = len(rows), sum(r["correct"] for r in rows)
        return {"overall": {"n": n, "correct": correct, "accuracy": round(100 * correct / n, 2) if n else 0.0}}

    def markdown(self, summary, meta=None):
        o = summary["overall"]
        cells = [(meta or {}).get("model", "?"), f"{summary['measured_b']:.3f}", f"{o['accuracy']:.2f}"]
        return "\n".join(table_lines(["Model", "B", "Accuracy"], cells, ["", "n", str(o["n"])], meta)) + "\n"

    def group(self, case):
        return "even" if case.n % 2 == 0 else "odd"


@pytest.fixture
def parity(monkeypatch):
    task = ParityTask()
    monkeypatch.setitem(TASKS, "parity", task)
    return task


def _rows(path) -> list[dict]:
    return [json.loads(x) for x in (path / "cases.jsonl").read_text().splitlines()]


# -- registry --------------------------------------------------------------------------------------------
def test_registry_names_and_defaults(parity):
    assert {"bfcl", "sql", "parity"} <= set(task_names()) and get_task("parity") is parity
    assert get_task("bfcl").default_max_new_tokens == 384 and get_task("sql").default_max_new_tokens == 256
    assert get_task("sql").score_key == "ex" and get_task("bfcl").splits == ("calibration", "dev", "test", "all")
    with pytest.raises(PaskError, match="unknown task 'nosuchtask'; known tasks: bfcl, parity, ruler, sql"):
        get_task("nosuchtask")
    with pytest.raises(TypeError):
        TASKS["x"] = object()
    with pytest.raises(ValueError, match="another name"):
        TASKS["x"] = parity
    with pytest.raises(PaskError, match="has no option"):
        parity.resolve_options({"colour": "red"})
    assert parity.resolve_options({"count": 2, "broken": None}) == {"count": 2, "words": ["yes", "no"], "broken": False}


def test_register_task_replaces_and_returns(monkeypatch):
    monkeypatch.setattr(TASKS, "_entries", dict(TASKS._entries))  # leave the real registry as it was
    task = register_task(ParityTask())
    assert TASKS["parity"] is task and "parity" in task_names()


def test_calibration_and_sweep_take_tasks_from_the_registry(parity):
    from pask.calibration.tasks import default_max_new_tokens
    from pask.calibration.tasks import get_task as calibration_task
    from pask.experiments.sweep import TASKS as SWEEP_TASKS

    hooks = calibration_task("parity")
    cases, cats = hooks.load("calibration", None, 2)
    assert [c.id for c in cases] == ["q100", "q101"] and cats == [] and hooks.group(cases[1]) == "odd"
    with pytest.raises(PaskError, match="leak"):
        hooks.load("test", None, 2)
    assert default_max_new_tokens("parity") == 4 and default_max_new_tokens("sql") == 256
    with pytest.raises(PaskError, match="task parity has no categories"):
        hooks.load("test", ["simple"], None)
    with pytest.raises(PaskError, match="leak"):
        calibration_task("sql").load("test", None, 1)
    with pytest.raises(PaskError, match="evaluation-only"):
        calibration_task("bfcl").load("dev", ["live_simple"], 1)
    spec = SWEEP_TASKS["parity"]
    assert "parity" in SWEEP_TASKS and spec.splits == ParityTask.splits and spec.defaults["max_new_tokens"] == 4
    assert {"count", "words", "broken", "limit", "max_new_tokens"} <= set(spec.hashed)
    assert (
        SWEEP_TASKS["bfcl"].defaults["max_new_tokens"] == 384 and SWEEP_TASKS["sql"].defaults["max_new_tokens"] == 256
    )


# -- the runner on the tiny model -------------------------------------------------------------------------
def test_runner_runs_a_registered_task(parity, smol, tmp_path):
    """Static and continuous batching give the same rows; the row layout is the task's fields then the run's."""
    cases = parity.cases("test", count=4)
    seen: list[int] = []
    static = run_task(parity, smol, cases, tmp_path / "s", 3, None, None, seen.append, {"model": "smol"}, True)
    cont = run_task(parity, smol, cases, tmp_path / "c", 2, batching="continuous", save_tags=True)
    assert seen == [0, 3, 1] and static["overall"]["n"] == 4 and static["measured_b"] == 1.0
    assert cont["overall"] == static["overall"]
    a, b = _rows(tmp_path / "s"), _rows(tmp_path / "c")
    head = ["id", "even", "prompt_len", "output", "correct", "error", "stop_reason", "n_generated"]
    assert list(a[0]) == [*head, *TIMING, "budget", "tags", "prompt_labels"]
    same = ("id", "even", "prompt_len", "output", "correct", "error", "n_generated", "prompt_labels")
    assert sorted([r[k] for k in same] for r in a) == sorted([r[k] for k in same] for r in b)
    for r in a:
        assert r["output"] in ("yes", "no") and r["correct"] == ((r["output"] == "yes") == r["even"])
        assert r["tags"] == [] and r["prompt_labels"] == ["p"] * r["prompt_len"]  # the task has no tagger
    md = (tmp_path / "s" / "summary.md").read_text()
    assert (
        "| smol | 1.000 |" in md and json.loads((tmp_path / "s" / "summary.json").read_text())["run"]["model"] == "smol"
    )
    again = run_task(parity, None, cases, tmp_path / "s", 3)  # finished: summarised without a model
    assert again["run"]["cases_this_run"] == 0 and again["overall"] == static["overall"]


def test_runner_scores_a_grammar_that_does_not_compile_as_a_schema_error(parity, smol, tmp_path):
    cases = parity.cases("test", count=2)
    req, err = prepare(parity, smol, cases[0], tagging=True, broken=True)
    assert err.startswith("schema_error: ") and "undefined_rule" in err and req.constraint is None
    summary = run_task(parity, smol, cases, tmp_path, broken=True)
    rows = {r["id"]: r for r in _rows(tmp_path)}
    assert rows["q0"]["stop_reason"] == "schema_error" and rows["q0"]["error"] == err and not rows["q0"]["correct"]
    assert (rows["q0"]["n_generated"], rows["q0"]["prefill_ms"], rows["q0"]["output"]) == (0, 0, "")
    assert rows["q1"]["stop_reason"] != "schema_error" and summary["run"]["cases_this_run"] == 1
    with pytest.raises(PaskError, match="has no option"):
        run_task(parity, smol, cases, tmp_path, colour="red")
    with pytest.raises(PaskError, match="--max-new-tokens must be >= 1"):
        run_task(parity, smol, cases, tmp_path, max_new_tokens=0)


def test_sweep_plans_and_runs_a_registered_task(parity, smol, tmp_path):
    from pask.experiments.sweep import code_version as version
    from pask.experiments.sweep import parse_config, plan, run_sweep

    data = {
        "results_dir": str(tmp_path / "res"),
        "dtype": "fp32",
        "models": ["smollm2-135m"],
        "tasks": ["parity"],
        "splits": ["test"],
        "policies": ["full", "kivi-4"],
        "budgets": [0.5],
        "parity": {"count": 2, "words": ["yes", "no", "maybe"]},
    }
    cfg = parse_config(data, tmp_path)
    assert [c.name for c in cfg.cells] == ["smollm2-135m/parity/test/full-b1", "smollm2-135m/parity/test/kivi-4-b0.5"]
    assert cfg.cells[0].options["max_new_tokens"] == 4 and cfg.cells[0].options["count"] == 2
    assert [(p.state, len(p.cases)) for p in plan(cfg, version(), dry_run=True)] == [("new", 2), ("new", 2)]
    other = parse_config({**data, "parity": {"count": 2}}, tmp_path).cells[0]
    assert other.config_hash() != cfg.cells[0].config_hash()  # a task option changes the results
    for bad, message in [({"colour": 1}, "unknown option"), ({"words": "yes"}, "'words' must be a non-empty list")]:
        with pytest.raises(PaskError, match=message):
            parse_config({**data, "parity": bad}, tmp_path)
    record = run_sweep(cfg, load=lambda m, d: smol)
    assert {c["state"] for c in record["cells"].values()} == {"new"}
    for cell in cfg.cells:
        rows = _rows(cfg.results_dir / cell.rel_dir)
        assert sorted(r["id"] for r in rows) == ["q0", "q1"] and all(
            r["output"] in ("yes", "no", "maybe") for r in rows
        )
        summary = json.loads((cfg.results_dir / cell.rel_dir / "summary.json").read_text())
        assert summary["run"]["cell"] == cell.name and summary["overall"]["n"] == 2
    assert all(0 < r["budget"]["b_total"] < 1 for r in _rows(cfg.results_dir / cfg.cells[1].rel_dir))


def test_pask_eval_runs_a_registered_task(parity, tmp_path):
    from pask.cli import app

    args = ["eval", "parity", "--model", "smollm2-135m", "--dtype", "fp32", "--threads", "1", "--limit", "2"]
    res = CliRunner().invoke(app, [*args, "--option", "count=5", "-o", "words=yes,no", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "| Model | B | Accuracy |" in res.output and len(_rows(tmp_path)) == 2
    run = json.loads((tmp_path / "summary.json").read_text())["run"]
    assert run["limit"] == 2 and run["count"] == 5 and "words" not in run  # options given that differ from defaults
    for extra, message in [
        (["--categories", "simple"], "--categories is not an option of task parity"),
        (["--option", "colour=red"], "task parity has no option 'colour'"),
        (["--option", "count"], "--option takes KEY=VALUE"),
    ]:
        res = CliRunner().invoke(app, [*args, *extra, "--out", str(tmp_path / "x")])
        assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output, res.output


# -- built-in tasks: rows of cases that cannot run keep their layout --------------------------------------
def test_error_rows_of_the_builtin_tasks():
    req = SimpleNamespace(prompt_ids=[1, 2, 3])
    bfcl_case = SimpleNamespace(id="simple_python_0", category="simple")
    row = error_row(get_task("bfcl"), bfcl_case, req, "schema_error: x")
    assert row == {
        "id": "simple_python_0",
        "category": "simple",
        "prompt_len": 3,
        "output": "",
        "calls": None,
        "correct": False,
        "valid": False,
        "error": "schema_error: x",
        "stop_reason": "schema_error",
        "n_generated": 0,
        "prefill_ms": 0,
        "tpot_ms": 0,
        "budget": None,
        "tags": None,
        "prompt_labels": None,
    }
    assert list(row) == list(row.keys())  # key order is the JSONL's
    sql_case = SimpleNamespace(
        id="dev-0001", db_id="concert_singer", difficulty="easy", gold_sql="SELECT count(*) FROM singer"
    )
    row = error_row(get_task("sql"), sql_case, req, "schema_error: y")
    assert list(row) == [
        "id",
        "db_id",
        "difficulty",
        "prompt_len",
        "output",
        "correct",
        "error",
        "gold_empty",
        "stop_reason",
        "n_generated",
        *TIMING,
        "budget",
        "tags",
        "prompt_labels",
    ]
    assert (row["correct"], row["error"], row["stop_reason"]) == (False, "schema_error: y", "schema_error")
    assert row["gold_empty"] is False  # the gold query returns a row: an error row still records it


def test_bfcl_check_of_outputs():
    bfcl = get_task("bfcl")
    case = bfcl.cases("test", limit=1, categories=["simple"])[0]
    truncated = bfcl.check(case, Output("<tool_call>", "length", parse_error="tool call is not valid JSON"))
    assert truncated == {"calls": None, "correct": False, "valid": False, "error": "tool call is not valid JSON"}
    assert bfcl.check(case, Output("", "eos", parsed=[]))["error"] == "no tool call"
    assert bfcl.run_record(3, bfcl.resolve_options({})) == {
        "categories": ["simple", "multiple", "parallel", "parallel_multiple"]
    }


# -- the budget check --------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, 0.0, 1.5, -0.2, math.nan, math.inf])
def test_check_budget_rejects(bad):
    with pytest.raises(PaskError, match=r"--budget must be in \(0, 1\], got "):
        check_budget(bad, "--budget")


@pytest.mark.parametrize("bad", ["x", None, True, [0.5]])
def test_check_budget_rejects_non_numbers(bad):
    with pytest.raises(PaskError, match=r"budget must be a number in \(0, 1\]"):
        check_budget(bad)


def test_check_budget_accepts_and_is_used_everywhere(tmp_path):
    from pask.cli import app
    from pask.experiments.sweep import parse_config
    from pask.policies.factory import make_policy

    assert check_budget(1) == 1.0 and check_budget(0.33) == 0.33 and check_budget("0.5") == 0.5
    with pytest.raises(PaskError, match=r"h2o: budget must be in \(0, 1\], got nan"):
        make_policy("h2o", math.nan)
    base = {"results_dir": "r", "models": ["smollm2-135m"], "tasks": ["sql"], "splits": ["test"]}
    with pytest.raises(PaskError, match=r"config: budgets must be in \(0, 1\], got nan"):
        parse_config({**base, "policies": ["h2o"], "budgets": [math.nan]}, tmp_path)
    for budget in ("0", "1.5", "nan"):
        res = CliRunner().invoke(app, ["eval", "sql", "--policy", "h2o", "--budget", budget, "--limit", "1"])
        assert res.exit_code == 2 and "--budget must be in (0, 1], got" in res.output, res.output
