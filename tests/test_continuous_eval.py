"""Continuous batching in the task runners: same outputs as static batches, rows as they finish."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pask.cli import app, make_policy
from pask.errors import PaskError
from pask.evaluation.continuous import decode_continuous
from pask.evaluation.run_sql import prepare, run_sql, select_cases
from pask.experiments.sweep import parse_config
from pask.policies.pask import make_pask_policy
from pask.policies.table import FrozenTable

MAX_NEW = 12


def _rows(out: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, (out / "cases.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def cases():
    """Four test-split questions on the database with the shortest prompt."""
    return [c for c in select_cases("test") if c.db_id == "poker_player"][:4]


def _policy(name: str, smol):
    if name == "pask":
        table = FrozenTable({"P|schema_scaffold|g0": "R", "P|parameter_key|g1": "L"}, smol.fingerprint, task="sql")
        return make_pask_policy(table)
    return make_policy(name, None if name == "full" else 0.5, task="sql")


@pytest.mark.parametrize(
    "name", ["full", "pask", "kivi-4", "mikv", "snapkv", "h2o", "criticalkv", "rocketkv", "lazyeviction"]
)
def test_continuous_matches_static(smol, cases, tmp_path, name):
    """Batch 2 over 4 cases: rows leave and join mid-run; outputs and measured B equal static batches'."""
    static = run_sql(smol, cases, tmp_path / "s", batch_size=4, max_new_tokens=MAX_NEW, policy=_policy(name, smol))
    seen: list[int] = []
    cont = run_sql(smol, cases, tmp_path / "c", 2, MAX_NEW, _policy(name, smol), seen.append, batching="continuous")
    a, b = _rows(tmp_path / "s"), _rows(tmp_path / "c")
    assert sorted(a) == sorted(b) == sorted(c.id for c in cases) and seen == [0, 1, 1, 1, 1]
    for i in a:
        same = ("output", "n_generated", "stop_reason", "correct", "prompt_len")
        assert {k: a[i][k] for k in same} == {k: b[i][k] for k in same}, i
        if name != "full":  # static Full KV runs on DynamicCache (no budget); continuous on the tiered cache
            assert b[i]["budget"]["b_total"] == pytest.approx(a[i]["budget"]["b_total"], abs=0.02)
    assert cont["overall"] == static["overall"]
    assert cont["measured_b"] == pytest.approx(static["measured_b"], abs=0.02)


def test_continuous_resumes_and_keeps_the_batch_bound(smol, cases, tmp_path, monkeypatch):
    from pask.runtime import scheduler

    peaks: list[int] = []
    close = scheduler.Scheduler.close

    def record(self):
        peaks.append(self.peak_running)
        close(self)

    monkeypatch.setattr(scheduler.Scheduler, "close", record)
    run_sql(smol, cases[:1], tmp_path, 2, MAX_NEW, batching="continuous")
    summary = run_sql(smol, cases, tmp_path, 2, MAX_NEW, batching="continuous")
    assert summary["run"]["cases_this_run"] == 3 and len(_rows(tmp_path)) == 4  # only the new cases ran
    assert peaks == [1, 2]


def test_decode_continuous_returns_every_key_once(smol, cases):
    reqs = [prepare(smol, c, MAX_NEW)[0] for c in cases[:3]]
    order: list[str] = []
    out = decode_continuous(smol, [(c.id, r) for c, r in zip(cases, reqs, strict=False)], 1, None,
                            lambda k, g: order.append(k))  # fmt: skip
    assert sorted(out) == sorted(order) == sorted(c.id for c in cases[:3])
    assert order == [c.id for c in cases[:3]]  # one at a time: first in, first out
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        decode_continuous(smol, [], 0)


def test_bad_batching(smol, cases, tmp_path):
    with pytest.raises(PaskError, match="unknown batching 'magic'"):
        run_sql(smol, cases[:1], tmp_path, batching="magic")
    res = CliRunner().invoke(app, ["eval", "sql", "--batching", "magic", "--limit", "1", "--out", str(tmp_path)])
    assert res.exit_code != 0 and "unknown --batching 'magic'" in res.output
    base = {"results_dir": "r", "models": ["smollm2-135m"], "tasks": ["sql"], "policies": ["full", "h2o"]}
    base |= {"budgets": [0.5], "splits": ["test"]}
    with pytest.raises(PaskError, match="batching must be one of"):
        parse_config({**base, "sql": {"batching": "magic"}}, tmp_path)
    static = parse_config(base, tmp_path).cells[1]
    cont = parse_config({**base, "sql": {"batching": "continuous"}}, tmp_path).cells[1]
    assert cont.options["batching"] == "continuous" and static.config_hash() == cont.config_hash()
