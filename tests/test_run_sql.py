"""Text-to-SQL evaluation: per-case JSONL, resume, Table 12 summary, measured B, CLI and bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pask.cli import app, make_policy
from pask.errors import PaskError
from pask.evaluation.runner import run_task
from pask.policies.pask import make_pask_policy
from pask.policies.table import FrozenTable
from pask.tasks import Output, get_task
from pask.tasks.sql import database, select_cases, summarize, table_markdown
from pask.tasks.sql_exec import execution_match
from pask.tasks.text_to_sql import DEFAULT_DATA_DIR

runner = CliRunner()
HEADER = "| Model | Method | B | Easy EX | Medium EX | Hard EX | Extra EX | Overall EX |"
FIELDS = {"id", "db_id", "difficulty", "prompt_len", "output", "correct", "error", "stop_reason", "n_generated"}
FIELDS |= {"prefill_ms", "tpot_ms", "budget"}
MAX_NEW = 16
SQL = get_task("sql")


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "cases.jsonl").read_text().splitlines()]


def _check_rows(rows: list[dict], cases) -> None:
    by_id = {c.id: c for c in cases}
    assert sorted(r["id"] for r in rows) == sorted(by_id)
    for r in rows:
        c = by_id[r["id"]]
        assert set(r) >= FIELDS and (r["db_id"], r["difficulty"]) == (c.db_id, c.difficulty)
        assert r["prompt_len"] > 100 and 0 < r["n_generated"] <= MAX_NEW
        assert r["stop_reason"] in ("grammar", "eos", "length")
        assert r["output"].lstrip().upper().startswith("SELECT")  # the grammar held
        res = execution_match(database(c.db_id).path, r["output"].strip(), c.gold_sql)
        assert (r["correct"], r["error"]) == (res.correct, res.error)


@pytest.fixture(scope="module")
def cases():
    """Three test-split questions on the database with the shortest prompt (2 easy, 1 medium)."""
    return [c for c in select_cases("test") if c.db_id == "poker_player"][:6:2]


def test_full_kv_rows_resume_and_summary(smol, cases, tmp_path):
    first = run_task(SQL, smol, cases[:2], tmp_path, batch_size=3, max_new_tokens=MAX_NEW)
    assert first["run"]["cases_this_run"] == 2 and first["overall"]["n"] == 2
    seen: list[int] = []
    summary = run_task(SQL, smol, cases, tmp_path, batch_size=3, max_new_tokens=MAX_NEW, progress=seen.append)
    assert summary["run"]["cases_this_run"] == 1 and seen == [2, 1]  # only the new case ran
    rows = _rows(tmp_path)
    _check_rows(rows, cases)
    assert all(r["budget"]["b_total"] == 1.0 for r in rows)  # Full KV runs on the tiered cache: B measured, 1
    again = run_task(
        SQL, smol, cases, tmp_path, batch_size=3, max_new_tokens=MAX_NEW, meta={"model": "m", "policy": "full"}
    )
    assert again["run"]["cases_this_run"] == 0 and len(_rows(tmp_path)) == 3  # nothing new, no duplicates
    assert summary["measured_b"] == 1.0
    levels = summary["difficulties"]
    assert list(levels) == ["easy", "medium", "hard", "extra"]
    assert {d: b["n"] for d, b in levels.items()} == {"easy": 2, "medium": 1, "hard": 0, "extra": 0}
    assert summary["overall"]["correct"] == sum(r["correct"] for r in rows)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["difficulties"] == levels and saved["run"]["model"] == "m"
    md = (tmp_path / "summary.md").read_text()
    assert HEADER in md and "| m | full | 1.000 |" in md and "|  |  | n | 2 | 1 | 0 | 0 | 3 |" in md


def test_tiered_policy_measured_budget_and_tags(smol, cases, tmp_path):
    cases = cases[:2]
    policy = make_policy("kivi-4", 0.5)
    summary = run_task(SQL, smol, cases, tmp_path, batch_size=2, max_new_tokens=MAX_NEW, policy=policy, save_tags=True)
    rows = _rows(tmp_path)
    _check_rows(rows, cases)
    b = [r["budget"]["b_total"] for r in rows]
    assert all(0 < x < 1 for x in b)
    assert summary["measured_b"] == pytest.approx(sum(b) / len(b), abs=1e-4)
    assert abs(summary["measured_b"] - 0.5) < 0.1
    for r in rows:
        assert len(r["tags"]) == r["n_generated"] and len(r["prompt_labels"]) == r["prompt_len"]
        assert {"function_name", "parameter_key", "type_constraint", "protected_content"} <= set(r["prompt_labels"])
        assert r["tags"][0].startswith("pure_scaffold|projection|boundary")  # SELECT opens the projection


def test_pask_policy_reads_sql_prompt_labels(smol, cases, tmp_path):
    actions = {"P|schema_scaffold|g0": "R", "P|parameter_key|g1": "L"}
    policy = make_pask_policy(FrozenTable(actions, smol.fingerprint, task="sql"))
    summary = run_task(SQL, smol, cases[:1], tmp_path / "run", max_new_tokens=MAX_NEW, policy=policy)
    (row,) = _rows(tmp_path / "run")
    assert row["tags"] is None and 0.5 < row["budget"]["b_prompt"] < 1  # labels reached the policy
    assert summary["measured_b"] == round(row["budget"]["b_total"], 4)
    bfcl = FrozenTable(actions, smol.fingerprint, task="bfcl").save(tmp_path / "bfcl.json")
    args = ["--model", "smollm2-135m", "--dtype", "fp32", "--threads", "1", "--limit", "1", "--out", str(tmp_path)]
    res = runner.invoke(app, ["eval", "sql", "--policy", "pask", "--table", str(bfcl), *args])
    assert res.exit_code == 2 and "calibrated for task 'bfcl', not 'sql'" in res.output


def test_check_and_summary_layout():
    case = select_cases("test", limit=1)[0]

    def check(text: str, stop: str = "grammar") -> dict:
        return SQL.check(case, Output(text, stop))

    assert check(case.gold_sql)["correct"]
    assert check("SELECT count(*) FROM stadium")["error"] is None
    bad = check("SELECT nope FROM singer", "length")
    assert not bad["correct"] and "no such column" in bad["error"]
    assert check("  ")["error"] == "empty output"
    assert SQL.check(case, Output("", "schema_error", error="schema_error: x")) == {
        "correct": False,
        "error": "schema_error: x",
        "gold_empty": False,
    }
    rows = [
        {
            "difficulty": "easy",
            "correct": True,
            "error": None,
            "stop_reason": "grammar",
            "budget": {"b_total": 0.4, "b_prompt": 0.3, "b_decode": 0.9},
        },
        {"difficulty": "easy", "correct": False, "error": "x", "stop_reason": "length", "budget": {"b_total": 0.6}},
        {"difficulty": "extra", "correct": True, "error": None, "stop_reason": "eos", "budget": None},
    ]
    s = summarize(rows)
    assert s["difficulties"]["easy"] == {"n": 2, "correct": 1, "ex": 50.0}
    assert s["difficulties"]["hard"] == {"n": 0, "correct": 0, "ex": None}
    assert s["overall"]["ex"] == 66.67 and s["overall"]["exec_errors"] == 1 and s["overall"]["truncated"] == 1
    assert s["measured_b"] == 0.5  # mean over the cases that ran a policy
    assert s["measured_b_prompt"] == 0.3 and s["measured_b_decode"] == 0.9  # over the cases that report them
    md = table_markdown(s, {"model": "q", "policy": "h2o", "command": "pask eval sql"})
    assert "| q | h2o | 0.500 | 50.00 | – | – | 100.00 | 66.67 |" in md and md.startswith("Command: `pask eval sql`")


def test_cli_eval_sql(tmp_path):
    out = tmp_path / "run"
    args = ["eval", "sql", "--model", "smollm2-135m", "--dtype", "fp32", "--limit", "1", "--max-new-tokens", "8"]
    res = runner.invoke(app, [*args, "--threads", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert HEADER in res.output and "smollm2-135m" in res.output
    assert len(_rows(out)) == 1 and (out / "summary.md").read_text().count(HEADER) == 1
    assert json.loads((out / "summary.json").read_text())["run"]["split"] == "test"


def test_cli_tune_sql_records_in_the_sql_file_only(tmp_path, monkeypatch):
    """`pask tune --task sql` scores configurations by EX on the dev split; BFCL's choices do not reach SQL."""
    from pask.policies import tuning

    bfcl, sql = tmp_path / "configs.json", tmp_path / "configs_sql.json"
    bfcl.write_text(json.dumps({"lazyeviction": {"0.4": {"window": 64, "alpha": 0.001}}}))
    monkeypatch.setattr(tuning, "CONFIGS_PATH", bfcl)
    monkeypatch.setattr(tuning, "SQL_CONFIGS_PATH", sql)
    with pytest.raises(PaskError, match=r"configs_sql\.json are missing"):  # nothing tuned on SQL yet: no file
        tuning.effective_config("lazyeviction", 0.4, task="sql")
    args = ["tune", "--task", "sql", "--policy", "lazyeviction", "--budget", "0.4", "--search", "coordinate"]
    args += ["--model", "smollm2-135m", "--dtype", "fp32", "--limit", "1", "--max-new-tokens", "4"]
    res = runner.invoke(app, [*args, "--threads", "1", "--out", str(tmp_path / "tune")])
    assert res.exit_code == 0, res.output
    log = [json.loads(x) for x in (tmp_path / "tune" / "tuning.jsonl").read_text().splitlines()]
    assert len(log) == 7 and all(r["n"] == 1 and 0 <= r["score"] <= 100 for r in log)  # 4 + 4 values, base shared
    chosen = json.loads(sql.read_text())["lazyeviction"]["0.4"]
    assert chosen in [r["params"] for r in log]
    assert tuning.effective_config("lazyeviction", 0.4, task="sql") == chosen
    assert tuning.effective_config("lazyeviction", 0.4) == {"window": 64, "alpha": 0.001}  # BFCL's, untouched
    assert make_policy("lazyeviction", 0.4, task="sql").window == chosen["window"]
    rows = _rows(tmp_path / "tune" / next(p.name for p in (tmp_path / "tune").iterdir() if p.is_dir()))
    assert len(rows) == 1 and rows[0]["id"] in {c.id for c in select_cases("dev")}


def test_cli_tune_sql_custom_grid_continuous(tmp_path, monkeypatch):
    """`--grid` replaces the Table 8 grid (here: two candidates); runs take --batching continuous."""
    from pask.policies import tuning

    monkeypatch.setattr(tuning, "SQL_CONFIGS_PATH", tmp_path / "configs_sql.json")
    args = ["tune", "--task", "sql", "--policy", "h2o", "--budget", "0.5", "--grid", '{"recent": [16, 64]}']
    args += ["--model", "smollm2-135m", "--dtype", "fp32", "--limit", "2", "--max-new-tokens", "4"]
    res = runner.invoke(app, [*args, "--batching", "continuous", "--threads", "1", "--out", str(tmp_path / "t")])
    assert res.exit_code == 0, res.output
    log = [json.loads(x) for x in (tmp_path / "t" / "tuning.jsonl").read_text().splitlines()]
    assert [r["params"] for r in log] == [{"recent": 16}, {"recent": 64}] and all(r["n"] == 2 for r in log)
    chosen = json.loads((tmp_path / "configs_sql.json").read_text())["h2o"]["0.5"]
    assert chosen in ({"recent": 16}, {"recent": 64})
    assert make_policy("h2o", 0.5, task="sql").recent == chosen["recent"]


@pytest.mark.parametrize(
    "grid, message",
    [
        ("nope", "--grid is not valid JSON"),
        ("[16]", "--grid must be a non-empty JSON object"),
        ('{"recent": []}', "'recent' needs a non-empty list of values"),
        ('{"colour": [1]}', "h2o rejects {'colour': 1}"),
        ('{"recent": [-5]}', "recent must be an integer >= 0"),
    ],
)
def test_cli_tune_bad_grid(grid, message, tmp_path):
    args = ["tune", "--task", "sql", "--policy", "h2o", "--budget", "0.5", "--grid", grid, "--out", str(tmp_path)]
    res = runner.invoke(app, [*args, "--model", "no-model-needed"])
    assert res.exit_code == 2 and message in " ".join(res.output.split()), res.output


# -- bad input -------------------------------------------------------------------------------------


@pytest.fixture
def data_dir(tmp_path) -> Path:
    """A two-database copy of the Spider dev layout (3 questions each)."""
    d = tmp_path / "data"
    dbs = ("concert_singer", "pets_1")
    dev = json.loads((DEFAULT_DATA_DIR / "dev.json").read_text())
    questions = [e for db in dbs for e in [x for x in dev if x["db_id"] == db][:3]]
    tables = [t for t in json.loads((DEFAULT_DATA_DIR / "tables.json").read_text()) if t["db_id"] in dbs]
    d.mkdir()
    (d / "dev.json").write_text(json.dumps(questions))
    (d / "tables.json").write_text(json.dumps(tables))
    for db in dbs:
        (d / "database" / db).mkdir(parents=True)
        shutil.copyfile(DEFAULT_DATA_DIR / "database" / db / f"{db}.sqlite", d / "database" / db / f"{db}.sqlite")
    return d


def _cli_error(*args: str) -> str:
    res = runner.invoke(app, ["eval", "sql", "--model", "no-model-needed", *args])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    return " ".join(res.output.split())  # rich wraps long lines


def test_custom_data_dir_loads(data_dir):
    cases = [c for s in ("calibration", "dev", "test") for c in select_cases(s, data_dir=data_dir)]
    assert len(cases) == 6 and {c.db_id for c in cases} == {"concert_singer", "pets_1"}


def test_missing_database_file(data_dir):
    (data_dir / "database" / "pets_1" / "pets_1.sqlite").unlink()
    with pytest.raises(PaskError, match=r"database file not found: .*pets_1\.sqlite"):
        select_cases("test", data_dir=data_dir)
    assert "database file not found" in _cli_error("--data-dir", str(data_dir))


def test_file_that_is_not_sqlite(data_dir):
    (data_dir / "database" / "pets_1" / "pets_1.sqlite").write_text("CREATE TABLE t (x);\n")
    assert "not a SQLite database" in _cli_error("--data-dir", str(data_dir))


def test_question_on_unknown_database(data_dir):
    dev = json.loads((data_dir / "dev.json").read_text())
    dev[4]["db_id"] = "no_such_db"
    (data_dir / "dev.json").write_text(json.dumps(dev))
    assert "question dev-0004: unknown db_id 'no_such_db'" in _cli_error("--data-dir", str(data_dir))


@pytest.mark.parametrize("name", ["dev.json", "tables.json"])
def test_data_dir_lacking_a_file(data_dir, name):
    (data_dir / name).unlink()
    msg = _cli_error("--data-dir", str(data_dir))
    assert "missing text-to-SQL data file" in msg and name in msg


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budget", "1.5"], "--budget must be in (0, 1], got 1.5"),
        (["--budget", "0"], "--budget must be in (0, 1], got 0.0"),
        (["--policy", "magic", "--budget", "0.5"], "unknown policy 'magic'"),
        (["--policy", "pask"], "--policy pask needs --table"),
        (["--split", "train"], "unknown split 'train'"),
        (["--limit", "0"], "--limit must be >= 1"),
    ],
)
def test_bad_options(args, message):
    assert message in _cli_error("--limit", "2", *args)
