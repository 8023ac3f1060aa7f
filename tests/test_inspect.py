"""`pask inspect` and --save-tags on the tiny model (structure only: the tagger follows the grammar)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from pask.cli import app
from pask.evaluation.run_bfcl import run_bfcl
from pask.structure.tags import Tag
from pask.tasks.function_calling import find_case, load_cases

runner = CliRunner()


def test_inspect_writes_html(tmp_path):
    page = tmp_path / "case.html"
    args = ["inspect", "--case", "simple_python_0", "--model", "smollm2-135m", "--max-new-tokens", "40"]
    res = runner.invoke(app, [*args, "--html", str(page)])
    assert res.exit_code == 0, res.output
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>") and "dispatch_key" in html
    assert "function_name" in html  # legend / labels present


def test_inspect_bad_case():
    res = runner.invoke(app, ["inspect", "--case", "nope_1", "--model", "smollm2-135m"])
    assert res.exit_code == 2 and "unknown BFCL case id" in res.output


def test_eval_save_tags(smol, tmp_path):
    cases = load_cases(["simple"], split="test", limit=2)
    run_bfcl(smol, cases, tmp_path, batch_size=2, max_new_tokens=48, save_tags=True)
    rows = [json.loads(x) for x in (tmp_path / "cases.jsonl").read_text().splitlines()]
    for r in rows:
        assert len(r["tags"]) == r["n_generated"]
        assert len(r["prompt_labels"]) == r["prompt_len"]
        assert all(Tag.parse(t) for t in r["tags"])
        assert "function_name" in r["prompt_labels"]


def test_find_case():
    assert find_case("multiple_3").category == "multiple"
    assert find_case("simple_python_0").category == "simple"
