"""End to end on the embedded default model (slow: real model, real BFCL cases)."""

from __future__ import annotations

import json

import pytest

from pask.evaluation.runner import run_task
from pask.tasks import get_task

BFCL = get_task("bfcl")


@pytest.mark.slow
def test_qwen_simple_cases_mostly_correct(qwen, tmp_path):
    cases = BFCL.cases("test", limit=6, categories=["simple"])
    summary = run_task(BFCL, qwen, cases, tmp_path, batch_size=6, max_new_tokens=160)
    assert summary["overall"]["n"] == 6
    assert summary["overall"]["correct"] >= 4, summary
    rows = [json.loads(x) for x in (tmp_path / "cases.jsonl").read_text().splitlines()]
    assert all(r["valid"] for r in rows)


@pytest.mark.slow
def test_eval_resumes_without_duplicates(qwen, tmp_path):
    cases = BFCL.cases("test", limit=2, categories=["multiple"])
    run_task(BFCL, qwen, cases[:1], tmp_path, batch_size=2, max_new_tokens=160)
    run_task(BFCL, qwen, cases, tmp_path, batch_size=2, max_new_tokens=160)
    ids = [json.loads(x)["id"] for x in (tmp_path / "cases.jsonl").read_text().splitlines()]
    assert sorted(ids) == sorted(c.id for c in cases)
