"""`pask eval --out DIR`: a folder made with other settings is refused (exit 2) unless --force."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from pask.cli import app
from pask.errors import PaskError
from pask.evaluation.runner import SETTINGS_FILE, check_settings, run_task
from pask.tasks.base import Output, Task, TaskRequest

SMOL = ["--model", "smollm2-135m", "--dtype", "fp32", "--threads", "1", "--max-new-tokens", "4"]
BFCL = ["eval", "bfcl", "--categories", "simple", "--limit", "1", *SMOL]
BASE = {"task": "bfcl", "split": "test", "model": "m", "policy": "full", "budget": None, "options": {"x": [1]}}


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "cases.jsonl").read_text().splitlines()]


def _invoke(*args: str):
    res = CliRunner().invoke(app, list(args))
    assert "Traceback" not in res.output, res.output
    return res


def test_eval_refuses_a_folder_made_with_other_settings(tmp_path):
    """The defect: --policy snapkv on a folder made with --policy full reused the Full KV rows."""
    out = tmp_path / "run"
    first = _invoke(*BFCL, "--out", str(out))
    assert first.exit_code == 0, first.output
    recorded = json.loads((out / SETTINGS_FILE).read_text())
    assert recorded["policy"] == "full" and recorded["task"] == "bfcl" and recorded["max_new_tokens"] == 4
    assert recorded["options"] == {"categories": ["simple"]} and recorded["dtype"] == "float32"
    rows = _rows(out)

    again = _invoke(*BFCL, "--out", str(out))  # same settings: resumes, nothing to run
    assert again.exit_code == 0, again.output
    assert _rows(out) == rows

    refused = _invoke(*BFCL, "--policy", "snapkv", "--budget", "0.33", "--out", str(out))
    assert refused.exit_code == 2
    text = " ".join(refused.output.split())
    assert "holds results made with other settings" in text and "--force" in text
    assert 'policy: folder "full", now "snapkv"' in text and "budget: folder null, now 0.33" in text
    assert "max_new_tokens" not in text  # only the settings that differ
    assert _rows(out) == rows and json.loads((out / SETTINGS_FILE).read_text()) == recorded

    for flags in (["--max-new-tokens", "5"], ["--categories", "multiple"], ["--dtype", "bf16"]):
        res = _invoke(*BFCL, *flags, "--out", str(out))
        assert res.exit_code == 2 and "other settings" in res.output, flags

    forced = _invoke(*BFCL, "--policy", "snapkv", "--budget", "0.33", "--force", "--out", str(out))
    assert forced.exit_code == 0, forced.output
    new_rows = _rows(out)
    assert len(new_rows) == len(rows) and all(r["budget"] is not None for r in new_rows)  # rerun under SnapKV
    assert json.loads((out / "summary.json").read_text())["run"]["policy"] == "snapkv"
    assert json.loads((out / SETTINGS_FILE).read_text())["policy"] == "snapkv"


def test_eval_refuses_a_folder_from_before_settings(tmp_path):
    """Rows without settings.json (made before pask recorded settings): refused, --force starts over."""
    out = tmp_path / "old"
    out.mkdir()
    (out / "cases.jsonl").write_text(json.dumps({"id": "simple_0", "output": "stale"}) + "\n")
    (out / "notes.txt").write_text("mine")
    res = _invoke(*BFCL, "--out", str(out))
    assert res.exit_code == 2
    assert "without a record of their settings" in " ".join(res.output.split())
    assert not (out / SETTINGS_FILE).exists()
    check_settings(out, BASE, force=True)
    assert not (out / "cases.jsonl").exists() and (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / SETTINGS_FILE).read_text()) == BASE


def test_check_settings_without_rows_rewrites(tmp_path):
    """A folder with settings but no rows (e.g. the model failed to load) takes new settings silently."""
    check_settings(tmp_path, BASE)
    (tmp_path / "cases.jsonl").write_text('{"id": "a"')  # torn, no complete row
    other = {**BASE, "policy": "h2o", "budget": 0.5}
    check_settings(tmp_path, other)
    assert json.loads((tmp_path / SETTINGS_FILE).read_text()) == other
    assert not (tmp_path / "cases.jsonl").exists()


def test_unreadable_settings_are_a_difference(tmp_path):
    check_settings(tmp_path, BASE)
    (tmp_path / "cases.jsonl").write_text('{"id": "a"}\n')
    (tmp_path / SETTINGS_FILE).write_text("{not json")
    with pytest.raises(PaskError, match="other settings"):
        check_settings(tmp_path, BASE)


values = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from(["a", "b", 0.5, 0.33]))
setting_dicts = st.dictionaries(
    st.sampled_from(["task", "policy", "budget", "model", "dtype"]),
    st.one_of(values, st.dictionaries(st.sampled_from(["data_dir", "categories"]), values, max_size=2)),
    max_size=5,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(old=setting_dicts, new=setting_dicts)
def test_refused_iff_settings_differ(tmp_path_factory, old, new):
    out = tmp_path_factory.mktemp("out")
    check_settings(out, old)
    (out / "cases.jsonl").write_text('{"id": "a"}\n')
    if old == new:
        check_settings(out, new)  # resumes
        assert (out / "cases.jsonl").exists()
        return
    with pytest.raises(PaskError, match="other settings") as e:
        check_settings(out, new)
    listed = {line.strip().split(":")[0] for line in str(e.value).splitlines()[1:]}
    top = {k for k in set(old) | set(new) if old.get(k, "(absent)") != new.get(k, "(absent)")}
    assert {k.split(".")[0] for k in listed} == top
    check_settings(out, new, force=True)
    assert not (out / "cases.jsonl").exists()
    assert json.loads((out / SETTINGS_FILE).read_text()) == new


class Echo(Task):
    """A model-free task for the runner: every case is already finished or fails to prepare."""

    name = "echo"
    default_max_new_tokens = 4

    def cases(self, split, limit=None, **options):
        return []

    def request(self, case, tokenizer, tagging=False, **options):
        return TaskRequest([1, 2], error="schema_error: no model here")

    def case_fields(self, case):
        return {"id": case.id}

    def check(self, case, output: Output, **options):
        return {"correct": False, "error": output.error}

    def summarize(self, rows):
        return {"n": len(rows)}

    def markdown(self, summary, meta=None):
        return f"{summary['n']}\n"


class C:
    def __init__(self, id: str) -> None:
        self.id = id


def test_run_task_checks_settings_only_when_given(tmp_path):
    """The sweep and calibration call run_task without settings: resuming there is unchanged."""
    lm = type("LM", (), {"tokenizer": None})()
    run_task(Echo(), lm, [C("a")], tmp_path, settings=BASE)
    assert json.loads((tmp_path / SETTINGS_FILE).read_text()) == BASE
    other = {**BASE, "policy": "snapkv"}
    with pytest.raises(PaskError, match='policy: folder "full", now "snapkv"'):
        run_task(Echo(), lm, [C("a"), C("b")], tmp_path, settings=other)
    assert len(_rows(tmp_path)) == 1
    summary = run_task(Echo(), lm, [C("a"), C("b")], tmp_path)  # no settings: resumes as before
    assert summary["n"] == 2 and len(_rows(tmp_path)) == 2
    run_task(Echo(), lm, [C("a")], tmp_path, settings=other, force=True)
    assert len(_rows(tmp_path)) == 1 and json.loads((tmp_path / SETTINGS_FILE).read_text()) == other
