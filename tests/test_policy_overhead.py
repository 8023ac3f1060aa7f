"""Policy overhead per decode step (``pask bench kv --policy``): timings split and references present."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from pask.bench.policy_overhead import TimedPolicy, _Clock, bench_policy_overhead, overhead_markdown
from pask.cli import app
from pask.policies import get_policy


def test_timed_policy_passes_attributes_through_and_times_decisions():
    clock = _Clock()
    inner = get_policy("h2o", budget=0.5)
    timed = TimedPolicy(inner, clock)
    assert timed.step_attention is True and timed.name == "h2o" and timed.budget == 0.5
    with pytest.raises(AttributeError):
        timed.no_such_attribute  # noqa: B018


@pytest.mark.slow
def test_overhead_rows_on_the_tiny_model(smol, monkeypatch):
    from pask.tasks.function_calling import load_cases

    monkeypatch.setenv("PASK_ALLOW_UNTUNED", "1")  # h2o at B 0.5 (nothing tuned there on BFCL): its defaults
    torch.set_num_threads(1)
    cases = load_cases(["simple"], split="test", limit=2)
    res = bench_policy_overhead(smol, ["kivi-4", "h2o"], 0.5, cases, batch_size=2, max_new_tokens=24)
    rows = {r["policy"]: r for r in res["rows"]}
    assert list(rows) == ["full", "tiered-all-h", "kivi-4", "h2o"]
    assert rows["full"]["decide_ms"] == 0 and rows["full"]["apply_ms"] == 0 and rows["full"]["measured_b"] == 1.0
    assert rows["tiered-all-h"]["apply_ms"] == 0  # all-H: nothing to pack or release
    for name in ("kivi-4", "h2o"):
        r = rows[name]
        assert r["steps"] > 0 and r["decide_ms"] > 0 and r["apply_ms"] > 0 and r["measured_b"] < 1
        assert r["rest_ms"] == pytest.approx(r["step_ms"] - r["decide_ms"] - r["apply_ms"], abs=2e-3)
    assert "| kivi-4 |" in overhead_markdown(res)


def test_bench_policy_bad_input():
    runner = CliRunner()
    for args, msg in (
        (["--policy", "magic"], "unknown policy"),
        (["--policy", "h2o", "--budget", "1.5"], "(0, 1]"),
        (["--policy", "pask"], "--table"),
        (["--policy", "h2o", "--cases", "0"], ">= 1"),
    ):
        res = runner.invoke(app, ["bench", "kv", *args])
        assert res.exit_code == 2 and msg in res.output, (args, res.output)
