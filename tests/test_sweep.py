"""Sweeps: config expansion and checks, resume after a kill, refusal of foreign cells, Ray == in-process."""

from __future__ import annotations

import io
import itertools
import json
import re
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

import pask.experiments.sweep as sweep
from pask.errors import PaskError
from pask.evaluation.case_rows import read_done
from pask.experiments.sweep import TASKS, TaskSpec, load_config, parse_config, run_sweep
from pask.tasks.bfcl import summarize

TIMING = ("prefill_ms", "tpot_ms")


# -- a model-free task for the bookkeeping tests ----------------------------------------------------
def _fake_cases(split: str, options: dict) -> list:
    return [SimpleNamespace(id=f"case{i}", category="simple") for i in range(options["n"])]


def _fake_run(lm, cases, out_dir, batch_size, max_new_tokens, policy, progress, meta, save_tags):
    """Resumable like the real runners: one JSONL row per case, summary at the end."""
    out_dir.mkdir(parents=True, exist_ok=True)
    jsonl = out_dir / "cases.jsonl"
    done = read_done(jsonl)
    todo = [c for c in cases if c.id not in done]
    if progress:
        progress(len(cases) - len(todo))
    with open(jsonl, "a") as f:
        for c in todo:
            assert lm is not None, "the runner was asked to generate without a model"
            _fake_run.calls.append(c.id)
            row = {"id": c.id, "category": "simple", "correct": c.id.endswith(("0", "2")), "valid": True}
            f.write(json.dumps({**row, "stop_reason": "eos", "budget": None}) + "\n")
            f.flush()
            if progress:
                progress(1)
    rows = [r for r in read_done(jsonl).values() if r["id"] in {c.id for c in cases}]
    summary = summarize(rows)
    (out_dir / "summary.json").write_text(json.dumps(summary) + "\n")
    return summary


_fake_run.calls = []
FAKE = TaskSpec(
    name="fake",
    runner=_fake_run,
    loader=_fake_cases,
    splits=("test",),
    defaults={"n": 4, "limit": None, "batch_size": 1, "max_new_tokens": 8, "save_tags": False, "allow_transfer": False},
    hashed=("n", "max_new_tokens"),
)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(TASKS, "fake", FAKE)
    _fake_run.calls = []
    return _fake_run.calls


def fake_config(tmp_path: Path, **over) -> dict:
    cfg = {
        "results_dir": str(tmp_path / "res"),
        "models": ["smollm2-135m"],
        "tasks": ["fake"],
        "splits": ["test"],
        "policies": ["full", "kivi-4"],
        "budgets": [0.5],
        "fake": {"n": 4},
    }
    cfg.update(over)
    return cfg


def no_model(model: str, dtype: str):
    return SimpleNamespace(name=model, fingerprint="none")


# -- config --------------------------------------------------------------------------------------------
def test_config_expands_products_and_grids(tmp_path, fake, monkeypatch):
    monkeypatch.setenv("PASK_ALLOW_UNTUNED", "1")  # h2o at budgets with no tuned entry: its defaults
    data = fake_config(
        tmp_path,
        models=["smollm2-135m", "qwen2.5-coder-0.5b"],
        policies=["full", "h2o"],
        budgets=[0.5, 0.25],
        grid=[{"models": ["smollm2-135m"], "policies": ["kivi-4", "full"], "budgets": [0.33]}],
        threads=3,
    )
    cfg = parse_config(data, tmp_path)
    names = [c.name for c in cfg.cells]
    assert names == [
        "smollm2-135m/fake/test/full-b1",  # full once per (model, task, split), whatever the budgets
        "smollm2-135m/fake/test/h2o-b0.5",
        "smollm2-135m/fake/test/h2o-b0.25",
        "smollm2-135m/fake/test/kivi-4-b0.33",  # grid cells join their model's group (loaded once)
        "qwen2.5-coder-0.5b/fake/test/full-b1",
        "qwen2.5-coder-0.5b/fake/test/h2o-b0.5",
        "qwen2.5-coder-0.5b/fake/test/h2o-b0.25",
    ]
    assert {c.threads for c in cfg.cells} == {3}
    assert parse_config(data, tmp_path, threads=1).cells[0].threads == 1  # --threads wins
    assert cfg.results_dir == tmp_path / "res"
    a, b = parse_config(data, tmp_path).cells[1], parse_config({**data, "fake": {"n": 5}}, tmp_path).cells[1]
    assert a.config_hash() != b.config_hash()  # result-changing option
    c = parse_config({**data, "fake": {"n": 4, "batch_size": 4}}, tmp_path).cells[1]
    assert a.config_hash() == c.config_hash()  # batch size does not change results


def test_config_file_relative_paths(tmp_path, fake):
    (tmp_path / "s.toml").write_text(
        'results_dir = "out"\nmodels = ["smollm2-135m"]\ntasks = ["fake"]\nsplits = ["test"]\npolicies = ["full"]\n'
    )
    cfg = load_config(tmp_path / "s.toml")
    assert cfg.results_dir == tmp_path / "out" and len(cfg.cells) == 1 and cfg.sha256


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"results_dir": None}, "missing 'results_dir'"),
        ({"models": None}, "missing key 'models'"),
        ({"budgets": None}, "missing key 'budgets'"),
        ({"tasks": ["nope"]}, "unknown task 'nope'"),
        ({"policies": ["full", "nope"]}, "unknown policy 'nope'"),
        ({"models": ["no-such-model"]}, "unknown model 'no-such-model'"),
        ({"budgets": [0.0]}, "budgets must be in (0, 1]"),
        ({"budgets": [1.5]}, "budgets must be in (0, 1]"),
        ({"splits": ["train"]}, "unknown split"),
        ({"policies": []}, "'policies' must be a non-empty list"),
        ({"colour": "red"}, "unknown config key"),
        ({"fake": {"n": 4, "limt": 3}}, "unknown option"),
        ({"fake": {"n": 4, "batch_size": 0}}, "batch_size must be an integer >= 1"),
        ({"dtype": "fp8"}, "unknown dtype"),
        ({"policies": ["pask"]}, "needs a table"),
        ({"grid": [{"models": ["smollm2-135m"], "budget": [0.5]}]}, "unknown key"),
    ],
)
def test_config_errors(tmp_path, fake, change, message):
    data = fake_config(tmp_path)
    for k, v in change.items():
        if v is None:
            data.pop(k)
        else:
            data[k] = v
    with pytest.raises(PaskError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config(data, tmp_path)


def test_config_file_errors(tmp_path):
    with pytest.raises(PaskError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("models = [")
    with pytest.raises(PaskError, match="not valid TOML"):
        load_config(tmp_path / "bad.toml")


def test_pask_table_lookup(tmp_path, fake):
    data = fake_config(tmp_path, policies=["pask"], budgets=[0.33])
    data["fake"] = {"n": 4, "tables": {"smollm2-135m": {"0.33": "missing.json"}}}
    with pytest.raises(PaskError, match=r"missing\.json .* does not exist"):
        parse_config(data, tmp_path)


def test_pask_cells_build_the_table_policy(tmp_path, fake, smol):
    """pask / pask-prefill / pask-decode take the table of their (model, budget); a new table is a new config."""
    from pask.policies.pask import PaskPolicy
    from pask.policies.table import FrozenTable

    table = FrozenTable(actions={}, fingerprint=smol.fingerprint, model_name="smollm2-135m", target_b=0.4, task="fake")
    table.save(tmp_path / "t.json")
    data = fake_config(tmp_path, policies=["pask", "pask-prefill", "pask-decode"], budgets=[0.4])
    data["fake"] = {"n": 4, "tables": {"smollm2-135m": {"0.4": "t.json"}}}
    cells = parse_config(data, tmp_path).cells
    policies = [sweep.make_cell_policy(c, smol) for c in cells]
    assert all(isinstance(p, PaskPolicy) for p in policies)
    assert [(p.prefill, p.decode) for p in policies] == [(True, True), (True, False), (False, True)]
    before = cells[0].config_hash()
    FrozenTable(actions={}, fingerprint=smol.fingerprint, target_b=0.4, default_action="L", task="fake").save(
        tmp_path / "t.json"
    )
    assert parse_config(data, tmp_path).cells[0].config_hash() != before
    FrozenTable(actions={}, fingerprint=smol.fingerprint, target_b=0.4, task="bfcl").save(tmp_path / "t.json")
    with pytest.raises(PaskError, match="calibrated for task 'bfcl', not 'fake'"):  # a table of another task
        parse_config(data, tmp_path)
    data["fake"]["allow_transfer"] = True  # ... unless the config asks for a transfer
    assert isinstance(sweep.make_cell_policy(parse_config(data, tmp_path).cells[0], smol), PaskPolicy)
    del data["fake"]["allow_transfer"]
    table.save(tmp_path / "t.json")
    data["budgets"] = [0.5]
    data["fake"]["tables"]["smollm2-135m"]["0.5"] = "t.json"
    with pytest.raises(PaskError, match=r"calibrated for B = 0\.4"):
        parse_config(data, tmp_path)


def test_pask_3a_cells_take_their_own_three_action_table(tmp_path, fake):
    """pask-3a reads "pask-3a@<budget>" (never the pask table) and refuses a table that uses INT2."""
    from pask.policies.table import FrozenTable

    four = FrozenTable(actions={"P|schema_scaffold|g0": "L2"}, fingerprint="x", target_b=0.2, task="fake")
    three = FrozenTable(actions={"P|schema_scaffold|g0": "L"}, fingerprint="x", target_b=0.2, task="fake")
    four.save(tmp_path / "t4.json")
    three.save(tmp_path / "t3.json")
    data = fake_config(tmp_path, policies=["pask", "pask-3a"], budgets=[0.2])
    data["fake"] = {"n": 4, "tables": {"smollm2-135m": {"0.2": "t4.json", "pask-3a@0.2": "t3.json"}}}
    cells = {c.policy: c for c in parse_config(data, tmp_path).cells}
    assert Path(cells["pask"].table).name == "t4.json" and Path(cells["pask-3a"].table).name == "t3.json"
    data["fake"]["tables"]["smollm2-135m"]["pask-3a@0.2"] = "t4.json"
    with pytest.raises(PaskError, match="pask-3a needs a three-action table"):
        parse_config(data, tmp_path)
    del data["fake"]["tables"]["smollm2-135m"]["pask-3a@0.2"]
    with pytest.raises(PaskError, match=r'"pask-3a@0\.2" = "FILE"'):
        parse_config(data, tmp_path)
    data["fake"]["tables"]["smollm2-135m"]["h2o@0.2"] = "t3.json"
    with pytest.raises(PaskError, match="only pask-3a, pask-k4v2, fetch-pask take"):
        parse_config(data, tmp_path)


def test_pask_k4v2_cells_take_a_k4v2_table(tmp_path, fake):
    """pask-k4v2 reads "pask-k4v2@<budget>" and refuses a table whose L2 action has INT2 keys."""
    from pask.policies.table import FrozenTable

    int2 = FrozenTable(actions={"P|schema_scaffold|g0": "L2"}, fingerprint="x", target_b=0.2, task="fake")
    k4v2 = FrozenTable(
        actions={"P|schema_scaffold|g0": "L2"}, fingerprint="x", target_b=0.2, l2_key_bits=4, task="fake"
    )
    int2.save(tmp_path / "t2.json")
    k4v2.save(tmp_path / "tk.json")
    data = fake_config(tmp_path, policies=["pask", "pask-k4v2"], budgets=[0.2])
    data["fake"] = {"n": 4, "tables": {"smollm2-135m": {"0.2": "t2.json", "pask-k4v2@0.2": "tk.json"}}}
    cells = {c.policy: c for c in parse_config(data, tmp_path).cells}
    assert Path(cells["pask-k4v2"].table).name == "tk.json"
    data["fake"]["tables"]["smollm2-135m"]["pask-k4v2@0.2"] = "t2.json"
    with pytest.raises(PaskError, match="pask-k4v2 needs a K4V2 table"):
        parse_config(data, tmp_path)


def test_fetch_cells_wrap_their_inner_policy(tmp_path, fake):
    """fetch-<baseline> builds KVFetch around the baseline (its own options in policy_config, the
    rest to the baseline); fetch-pask reads "fetch-pask@<budget>" and takes only KVFetch's options."""
    from pask.experiments.sweep import make_cell_policy
    from pask.policies.kvfetch import FetchPolicy
    from pask.policies.table import FrozenTable

    FrozenTable(actions={"P|schema_scaffold|g0": "R"}, fingerprint="x", target_b=0.1, task="fake").save(
        tmp_path / "tf.json"
    )
    data = fake_config(tmp_path, policies=["fetch-snapkv", "fetch-pask"], budgets=[0.2])
    data["fake"] = {
        "n": 4,
        "tables": {"smollm2-135m": {"fetch-pask@0.2": "tf.json"}},
        "policy_config": {"fetch-snapkv": {"window": 16, "slots": 8}, "fetch-pask": {"grace": 0}},
    }
    cells = {c.policy: c for c in parse_config(data, tmp_path).cells}
    snap = make_cell_policy(cells["fetch-snapkv"], None)
    assert isinstance(snap, FetchPolicy) and snap.slots == 8 and snap.inner.window == 16
    pask = make_cell_policy(cells["fetch-pask"], None)
    assert isinstance(pask, FetchPolicy) and pask.grace == 0 and pask.inner.name == "pask"
    data["fake"]["policy_config"]["fetch-pask"] = {"window": 3}
    with pytest.raises(PaskError, match=r"unknown option\(s\) window"):
        parse_config(data, tmp_path)
    data["fake"]["policy_config"]["fetch-pask"] = {}
    del data["fake"]["tables"]["smollm2-135m"]["fetch-pask@0.2"]
    with pytest.raises(PaskError, match=r'"fetch-pask@0\.2" = "FILE"'):
        parse_config(data, tmp_path)


# -- running: resume, skip, refuse ------------------------------------------------------------------
def rows_of(cell_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (cell_dir / "cases.jsonl").read_text().splitlines()]


def test_sweep_runs_skips_and_records(tmp_path, fake):
    cfg = parse_config(fake_config(tmp_path), tmp_path)
    seen = []
    record = run_sweep(cfg, load=no_model, progress=lambda d, t, c: seen.append((d, t)))
    assert sorted(fake) == sorted([f"case{i}" for i in range(4)] * 2)
    assert seen[-1] == (8, 8) and all(d <= t for d, t in seen)
    assert set(record["cells"]) == {"smollm2-135m/fake/test/full-b1", "smollm2-135m/fake/test/kivi-4-b0.5"}
    assert json.loads((cfg.results_dir / "sweep.json").read_text())["cells"] == record["cells"]
    man = json.loads((cfg.results_dir / "smollm2-135m/fake/test/kivi-4-b0.5/cell.json").read_text())
    assert man["status"] == "done" and man["code_version"]["key"] and man["config_hash"] == cfg.cells[1].config_hash()
    assert man["runs"][0]["cases_run"] == 4 and man["wall_s"] >= 0
    fake.clear()
    record = run_sweep(cfg, load=lambda *a: pytest.fail("a finished sweep must not load a model"))
    assert fake == [] and {c["state"] for c in record["cells"].values()} == {"done"}


def test_refuses_other_config_or_code_version(tmp_path, fake, monkeypatch):
    run_sweep(parse_config(fake_config(tmp_path), tmp_path), load=no_model)
    changed = parse_config(fake_config(tmp_path, fake={"n": 4, "max_new_tokens": 9}), tmp_path)
    with pytest.raises(PaskError, match=r"(?s)2 cell.*another configuration.*--force"):
        run_sweep(changed, load=no_model)
    version = sweep.code_version()
    monkeypatch.setattr(sweep, "code_version", lambda: {**version, "key": "0" * 40})
    same = parse_config(fake_config(tmp_path), tmp_path)
    with pytest.raises(PaskError, match="code version"):
        run_sweep(same, load=no_model)
    fake.clear()
    record = run_sweep(same, load=no_model, overwrite=True)  # --force: delete and rerun
    assert len(fake) == 8 and {c["state"] for c in record["cells"].values()} == {"new"}
    man = json.loads((same.results_dir / same.cells[0].rel_dir / "cell.json").read_text())
    assert man["code_version"]["key"] == "0" * 40 and len(man["runs"]) == 1


def test_dry_run_lists_states(tmp_path, fake):
    cfg = parse_config(fake_config(tmp_path), tmp_path)
    assert [p.state for p in sweep.plan(cfg, sweep.code_version(), dry_run=True)] == ["new", "new"]
    run_sweep(cfg, load=no_model)
    changed = parse_config(fake_config(tmp_path, policies=["full", "kivi-4"], fake={"n": 3}), tmp_path)
    plans = sweep.plan(changed, sweep.code_version(), dry_run=True)
    assert [p.state for p in plans] == ["refused", "refused"]
    assert all((p.dir / "cell.json").exists() for p in plans)  # a dry run deletes nothing
    assert sweep.code_version() == sweep.code_version() and sweep.code_version()["key"]


def test_cli_sweep(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from pask.cli import app

    monkeypatch.setenv("PASK_ALLOW_UNTUNED", "1")  # h2o at a budget with no tuned entry: its defaults
    (tmp_path / "s.toml").write_text(
        'results_dir = "out"\nmodels = ["smollm2-135m"]\ntasks = ["bfcl"]\nsplits = ["test"]\n'
        'policies = ["full", "h2o"]\nbudgets = [0.5]\n[bfcl]\ncategories = ["simple"]\nlimit = 2\n'
    )
    res = CliRunner().invoke(app, ["sweep", "--config", str(tmp_path / "s.toml"), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "new" in res.output and "smollm2-135m/bfcl/test/h2o-b0.5" in res.output and "0/2" in res.output
    (tmp_path / "s.toml").write_text('results_dir = "out"\nmodels = ["smollm2-135m"]\n')
    res = CliRunner().invoke(app, ["sweep", "--config", str(tmp_path / "s.toml")])
    assert res.exit_code == 2 and "missing key 'tasks'" in res.output and "Traceback" not in res.output


def test_refuses_results_not_made_by_a_sweep(tmp_path, fake):
    cfg = parse_config(fake_config(tmp_path), tmp_path)
    cell_dir = cfg.results_dir / cfg.cells[0].rel_dir
    cell_dir.mkdir(parents=True)
    (cell_dir / "cases.jsonl").write_text('{"id": "case0"}\n')
    with pytest.raises(PaskError, match=r"without cell\.json"):
        run_sweep(cfg, load=no_model)
    assert (cell_dir / "cases.jsonl").exists()  # nothing deleted without --force


def test_folds_in_rows_of_an_interrupted_ray_run(tmp_path, fake):
    """Rows a killed Ray run left in shard dirs count; the shards are removed; no case runs twice."""
    cfg = parse_config(fake_config(tmp_path, policies=["full"]), tmp_path)
    (p,) = sweep.plan(cfg, sweep.code_version())
    sweep.start_cell(p, sweep.code_version(), "ray")
    shard = p.dir / sweep.SHARDS_DIR / "0001"
    shard.mkdir(parents=True)
    row = {"id": "case3", "category": "simple", "correct": False, "valid": True, "stop_reason": "eos", "budget": None}
    (shard / "cases.jsonl").write_text(json.dumps(row) + "\n" + '{"id": "case1", "cat')  # torn last line
    (p,) = sweep.plan(cfg, sweep.code_version())
    assert (p.state, p.n_done) == ("resume", 1)
    run_sweep(cfg, load=no_model)
    assert sorted(fake) == ["case0", "case1", "case2"]
    assert sorted(r["id"] for r in rows_of(p.dir)) == [f"case{i}" for i in range(4)]
    assert not (p.dir / sweep.SHARDS_DIR).exists()


# -- real model: killed mid-cell, then resumed ------------------------------------------------------
def smol_config(tmp_path: Path, **over) -> dict:
    cfg = {
        "results_dir": str(tmp_path / "res"),
        "dtype": "fp32",
        "threads": 1,
        "models": ["smollm2-135m"],
        "tasks": ["bfcl"],
        "splits": ["test"],
        "policies": ["full"],
        "bfcl": {"categories": ["simple"], "limit": 3, "batch_size": 1, "max_new_tokens": 8},
    }
    cfg.update(over)
    return cfg


def test_resume_after_kill_mid_cell(tmp_path, smol):
    """A sweep killed after k cases keeps them; the rerun adds the rest: every case exactly once."""
    k = 1
    run_bfcl = TASKS["bfcl"].run_fn()  # the registry's task through the evaluation runner

    def killed_after_k(lm, cases, out_dir, *args, **kwargs):
        progress, done = args[3], {"n": 0, "first": True}

        def advance(n: int) -> None:
            progress(n)
            if done.pop("first", False):
                return  # the runner's first call reports cases already done
            done["n"] += n
            if done["n"] >= k:
                raise KeyboardInterrupt("killed")

        return run_bfcl(lm, cases, out_dir, *args[:3], advance, *args[4:], **kwargs)

    TASKS["bfcl"] = replace(TASKS["bfcl"], runner=killed_after_k)  # a spec of its own, until deleted
    cfg = parse_config(smol_config(tmp_path), tmp_path)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_sweep(cfg, load=lambda m, d: smol)
    finally:
        del TASKS["bfcl"]  # back to the registry's task
    cell_dir = cfg.results_dir / cfg.cells[0].rel_dir
    assert json.loads((cell_dir / "cell.json").read_text())["status"] == "running"
    assert json.loads((cfg.results_dir / "sweep.json").read_text())["cells"][cfg.cells[0].name]["state"] == "unfinished"
    assert len(rows_of(cell_dir)) == k
    with open(cell_dir / "cases.jsonl", "a") as f:
        f.write('{"id": "simple_python_9", "category": "sim')  # killed mid-write
    record = run_sweep(cfg, load=lambda m, d: smol)
    ids = [r["id"] for r in rows_of(cell_dir)]
    expected = [c.id for c in cfg.cells[0].load_cases()]
    assert sorted(ids) == sorted(expected) and len(ids) == len(set(ids)) == 3
    summary = json.loads((cell_dir / "summary.json").read_text())
    assert summary["overall"]["n"] == 3
    cell = record["cells"][cfg.cells[0].name]
    assert cell["state"] == "resume" and cell["cases_run"] == 3 - k
    man = json.loads((cell_dir / "cell.json").read_text())
    assert man["status"] == "done" and [r["cases_before"] for r in man["runs"]] == [0, k]


# -- Ray ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ray_matches_in_process(tmp_path, smol):
    """Cells run as sharded Ray tasks on a local 2-CPU Ray instance give the in-process rows."""
    ray = pytest.importorskip("ray")
    from pask.experiments.ray_shards import run_cells_ray

    data = smol_config(tmp_path, policies=["kivi-4"], budgets=[0.5])  # one cell, two shards: the merge is the point
    data["bfcl"] = {"categories": ["simple", "multiple"], "limit": 1, "batch_size": 2, "max_new_tokens": 12}
    local = parse_config(data, tmp_path)
    run_sweep(local, load=lambda m, d: smol)
    remote = parse_config(data, tmp_path, results_dir=tmp_path / "ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        record = run_sweep(remote, ray_address="auto", shard_size=1, ray_runner=run_cells_ray)
    finally:
        ray.shutdown()
    assert record["mode"] == "ray"
    for cell in local.cells:
        a, b = (read_done(cfg.results_dir / cell.rel_dir / "cases.jsonl") for cfg in (local, remote))
        strip = lambda rows: {i: {k: v for k, v in r.items() if k not in TIMING} for i, r in rows.items()}  # noqa: E731
        assert len(a) == 2 and strip(a) == strip(b), cell.name
        sa, sb = (json.loads((cfg.results_dir / cell.rel_dir / "summary.json").read_text()) for cfg in (local, remote))
        keys = ("overall", "categories", "measured_b")
        assert [sa[k] for k in keys] == [sb[k] for k in keys]
        man = json.loads((remote.results_dir / cell.rel_dir / "cell.json").read_text())
        assert man["status"] == "done" and man["runs"][-1]["mode"] == "ray" and man["runs"][-1]["shards"] == 2
        assert not (remote.results_dir / cell.rel_dir / "shards").exists()


def _eval_results(cell_dir: Path, ids: list[str], **run) -> None:
    """What `pask eval` leaves: cases.jsonl and a summary whose run record names the cell."""
    cell_dir.mkdir(parents=True)
    rows = [{"id": i, "category": "simple", "correct": True, "valid": True, "stop_reason": "eos"} for i in ids]
    (cell_dir / "cases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (cell_dir / "summary.json").write_text(json.dumps({**summarize(rows), "run": run}) + "\n")


def test_adopts_finished_eval_results_of_the_same_cell(tmp_path, fake):
    cfg = parse_config(fake_config(tmp_path, policies=["kivi-4"]), tmp_path)
    (cell,) = cfg.cells
    cell_dir = cfg.results_dir / cell.rel_dir
    run = {"model": cell.model, "policy": "kivi-4", "budget": 0.5, "split": "test", "command": "pask eval ..."}
    _eval_results(cell_dir, [f"case{i}" for i in range(5)], **run)  # a superset: case4 is not the cell's
    with pytest.raises(PaskError, match=r"without cell\.json"):
        run_sweep(cfg, load=no_model)
    (p,) = sweep.plan(cfg, sweep.code_version(), dry_run=True, adopt=True)
    assert p.state == "adopt" and not (cell_dir / "cell.json").exists()  # a dry run writes nothing
    record = run_sweep(cfg, load=lambda *a: pytest.fail("an adopted cell must not run"), adopt=True)
    assert fake == [] and record["cells"][cell.name]["state"] == "done"
    man = json.loads((cell_dir / "cell.json").read_text())
    assert man["adopted"]["command"] == "pask eval ..." and man["config_hash"] == cell.config_hash()
    assert run_sweep(cfg, load=no_model)["cells"][cell.name]["state"] == "done"  # a plain rerun keeps it
    summary = json.loads((cell_dir / "summary.json").read_text())
    assert summary["overall"]["n"] == 4  # the cell's cases only
    assert len(read_done(cell_dir / "cases.jsonl")) == 5  # no row deleted


@pytest.mark.parametrize(
    "ids, run_over, why",
    [
        ([f"case{i}" for i in range(3)], {}, "3/4"),  # a case missing
        ([f"case{i}" for i in range(4)], {"budget": 0.4}, "budget 0.4 != 0.5"),
        ([f"case{i}" for i in range(4)], {"policy": "h2o"}, "policy 'h2o'"),
    ],
)
def test_adopt_refuses_other_runs(tmp_path, fake, ids, run_over, why):
    cfg = parse_config(fake_config(tmp_path, policies=["kivi-4"]), tmp_path)
    (cell,) = cfg.cells
    run = {"model": cell.model, "policy": "kivi-4", "budget": 0.5, "split": "test", **run_over}
    _eval_results(cfg.results_dir / cell.rel_dir, ids, **run)
    with pytest.raises(PaskError, match=f"not adopted: .*{why}"):
        run_sweep(cfg, load=no_model, adopt=True)
    assert not (cfg.results_dir / cell.rel_dir / "cell.json").exists()


def test_adopt_checks_the_pask_table(tmp_path, fake):
    from pask.policies.table import FrozenTable

    table = tmp_path / "t.json"
    FrozenTable(actions={}, fingerprint="none", model_name="smollm2-135m", target_b=0.33, task="fake").save(table)
    data = fake_config(tmp_path, policies=["pask"], budgets=[0.33])
    data["fake"] = {"n": 2, "tables": {"smollm2-135m": {"0.33": str(table)}}}
    cfg = parse_config(data, tmp_path)
    (cell,) = cfg.cells
    run = {"model": cell.model, "policy": "pask", "budget": 0.33, "split": "test"}
    cell_dir = cfg.results_dir / cell.rel_dir
    _eval_results(cell_dir, ["case0", "case1"], **run, table_sha256="0" * 64)
    with pytest.raises(PaskError, match="not adopted: it was not made with the table"):
        run_sweep(cfg, load=no_model, adopt=True)
    (cell_dir / "summary.json").unlink()
    (cell_dir / "cases.jsonl").unlink()
    cell_dir.rmdir()
    _eval_results(cell_dir, ["case0", "case1"], **run, command=f"pask eval bfcl --table {table}")
    assert run_sweep(cfg, load=no_model, adopt=True)["cells"][cell.name]["state"] == "done"


def test_only_runs_the_selected_cells_and_merges_the_config_record(tmp_path, fake):
    cfg = parse_config(fake_config(tmp_path), tmp_path)
    cfg.source, cfg.sha256 = str(tmp_path / "grid.toml"), "sha-of-grid"
    full, kivi = (c.name for c in cfg.cells)
    run_sweep(cfg, load=no_model)
    assert sweep.record_path(cfg).name == "sweep-grid.json" and sweep.record_path(cfg).exists()
    fake.clear()
    shutil.rmtree(cfg.results_dir / cfg.cells[1].rel_dir)
    part = sweep.select_cells(cfg, ["policy=kivi-4", "budget=0.5"])
    assert [c.name for c in part.cells] == [kivi]
    record = run_sweep(part, load=no_model)
    assert sorted(fake) == sorted(f"case{i}" for i in range(4))  # only the selected cell ran
    assert set(record["cells"]) == {full, kivi} and record["only"] == ["policy=kivi-4", "budget=0.5"]
    assert record["cells"][kivi]["cases_run"] == 4 and record["cells"][full]["cases_run"] == 4
    assert json.loads(sweep.record_path(cfg).read_text())["cells"] == record["cells"]


@pytest.mark.parametrize("bad", ["policy", "colour=red", "policy=", "=pask"])
def test_bad_cell_filter_is_refused(tmp_path, fake, bad):
    cfg = parse_config(fake_config(tmp_path), tmp_path)
    with pytest.raises(PaskError, match="bad cell filter"):
        sweep.select_cells(cfg, [bad])


def test_filter_matching_nothing_is_refused(tmp_path, fake):
    cfg = parse_config(fake_config(tmp_path), tmp_path)
    with pytest.raises(PaskError, match="no cell"):
        sweep.select_cells(cfg, ["policy=h2o"])


def test_records_the_policy_parameters_a_cell_ran_with(tmp_path, fake, monkeypatch):
    """Tuned configuration (configs.json) under the cell's own policy_config: both land in cell.json."""
    from pask.policies import tuning

    configs = tmp_path / "configs.json"
    configs.write_text(json.dumps({"h2o": {"0.5": {"sink": 2, "recent": 32}}}))
    monkeypatch.setattr(tuning, "CONFIGS_PATH", configs)
    real = tuning.tuned_config
    monkeypatch.setattr(tuning, "tuned_config", lambda p, b, path=configs: real(p, b, path))
    cfg = parse_config(
        fake_config(tmp_path, policies=["full", "h2o"], fake={"n": 2, "policy_config": {"h2o": {"recent": 16}}}),
        tmp_path,
    )
    run_sweep(cfg, load=no_model)
    res = cfg.results_dir / "smollm2-135m/fake/test"
    h2o = json.loads((res / "h2o-b0.5/cell.json").read_text())["runs"][0]
    full = json.loads((res / "full-b1/cell.json").read_text())["runs"][0]
    assert h2o["policy_params"] == {"sink": 2, "recent": 16} and "policy_params" not in full


# -- progress without a terminal --------------------------------------------------------------------
def test_prints_a_line_per_finished_cell_without_a_tty(tmp_path, fake, capsys):
    cfg = parse_config(fake_config(tmp_path), tmp_path)
    run_sweep(cfg, load=no_model)  # capsys: stdout is not a terminal (a log file, CI)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "sweep: 2 of 2 cells to run (8 cases)"
    cells = [line for line in lines if line.startswith("[")]
    assert [line.split(": ")[0] for line in cells] == [
        "[1/2] smollm2-135m/fake/test/full-b1",
        "[2/2] smollm2-135m/fake/test/kivi-4-b0.5",
    ]
    for line in cells:
        assert re.search(r": 4 cases \(4 run now\), accuracy 50\.00, B (\d\.\d{3}|–), \d+\.\d s$", line), line
    run_sweep(cfg, load=no_model)  # nothing left to run: the opening line only
    assert capsys.readouterr().out.splitlines() == ["sweep: 0 of 2 cells to run (0 cases)"]


def test_a_long_cell_reports_its_progress_without_a_tty(tmp_path, fake, capsys, monkeypatch):
    """Between the opening line and the cell lines: a running cell's count, rate and time left, at
    most once a minute (each monotonic() call here is 61 s later)."""
    clock = itertools.count(0, 61)
    monkeypatch.setattr(sweep, "_now", lambda: float(next(clock)))
    run_sweep(parse_config(fake_config(tmp_path), tmp_path), load=no_model)
    lines = capsys.readouterr().out.splitlines()
    running = [line for line in lines if line.startswith("  ")]
    assert running, lines
    for line in running:
        m = re.fullmatch(
            r"  smollm2-135m/fake/test/(full-b1|kivi-4-b0\.5): (\d) / 4 cases, (\d+\.\d) a minute(.*)", line
        )
        assert m and int(m.group(2)) < 4, line
        assert m.group(4) == "" or re.fullmatch(r", ~\d+ min left", m.group(4)), line
    assert lines[0].startswith("sweep: ") and lines[-1].startswith("[2/2] ")


def test_keeps_quiet_on_a_terminal(tmp_path, fake, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out, err = Terminal(), Terminal()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    seen = []
    run_sweep(parse_config(fake_config(tmp_path), tmp_path), load=no_model, progress=lambda *a: seen.append(a))
    assert out.getvalue() == "" and seen[-1][:2] == (8, 8)  # the progress bar (callback) only


def test_cell_line():
    summary = {"overall": {"n": 40, "ex": 32.5}, "measured_b": 0.3314}
    assert sweep.cell_line("m/sql/dev/pask-b0.33", 40, 12, summary, 81.25, "2/5") == (
        "[2/5] m/sql/dev/pask-b0.33: 40 cases (12 run now), EX 32.50, B 0.331, 81.2 s"
    )
    assert sweep.cell_line("c", 3, 0, {}, 0.0) == "c: 3 cases (0 run now), no score, B –, 0.0 s"


def test_policy_config_per_budget_overrides_the_policy_s(tmp_path, fake, monkeypatch):
    """``[task.policy_config."<policy>@<budget>"]`` applies to that cell only, over the policy's own."""
    monkeypatch.setenv("PASK_ALLOW_UNTUNED", "1")
    pc = {"h2o": {"recent": 16, "sink": 2}, "h2o@0.25": {"recent": 8}}
    cfg = parse_config(
        fake_config(tmp_path, policies=["h2o"], budgets=[0.5, 0.25], fake={"n": 2, "policy_config": pc}), tmp_path
    )
    got = {c.budget: c.policy_config for c in cfg.cells}
    assert got == {0.5: {"recent": 16, "sink": 2}, 0.25: {"recent": 8, "sink": 2}}


def test_a_policy_variant_is_a_cell_of_its_own(tmp_path, fake):
    """``<policy>~<variant>``: the policy's options with the variant's on top, its own directory,
    manifest and hash; the plain cell's hash stays what it was without the variant."""
    from pask.experiments.sweep import make_cell_policy

    pc = {"fetch-snapkv": {"slots": 8}, "fetch-snapkv~grammar": {"trigger": "grammar"}}
    data = fake_config(tmp_path, policies=["fetch-snapkv", "fetch-snapkv~grammar"], budgets=[0.2])
    data["fake"] = {"n": 2, "policy_config": pc}
    cfg = parse_config(data, tmp_path)
    plain, var = cfg.cells
    assert (plain.name, var.name) == (
        "smollm2-135m/fake/test/fetch-snapkv-b0.2",
        "smollm2-135m/fake/test/fetch-snapkv~grammar-b0.2",
    )
    assert var.policy == "fetch-snapkv" and var.variant == "grammar" and var.method == "fetch-snapkv~grammar"
    assert var.policy_config == {"slots": 8, "trigger": "grammar"} and plain.policy_config == {"slots": 8}
    assert make_cell_policy(var, None).trigger == "grammar" and make_cell_policy(plain, None).trigger == "match"
    alone = parse_config({**data, "policies": ["fetch-snapkv"]}, tmp_path).cells[0]
    assert alone.config_hash() == plain.config_hash() and "variant" not in plain.spec()
    assert var.config_hash() != plain.config_hash()
    assert [c.name for c in sweep.select_cells(cfg, ["policy=fetch-snapkv~grammar"]).cells] == [var.name]
    assert [c.name for c in sweep.select_cells(cfg, ["policy=fetch-snapkv"]).cells] == [plain.name]
    run_sweep(cfg, load=no_model)
    man = json.loads((cfg.results_dir / var.rel_dir / "cell.json").read_text())
    assert man["cell"]["policy"] == "fetch-snapkv" and man["cell"]["variant"] == "grammar"
    assert man["runs"][0]["policy_params"]["trigger"] == "grammar"
    assert "variant" not in json.loads((cfg.results_dir / plain.rel_dir / "cell.json").read_text())["cell"]


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("fetch-snapkv~Grammar", "bad policy variant"),
        ("fetch-snapkv~", "bad policy variant"),
        ("full~x", "bad policy variant"),
        ("nosuch~x", "unknown policy 'nosuch'"),
        ("snapkv~bare", "has no options of its own"),
    ],
)
def test_bad_policy_variants_are_refused(tmp_path, fake, policy, message):
    data = fake_config(tmp_path, policies=[policy], budgets=[0.2])
    data["fake"] = {"n": 2, "policy_config": {"full~x": {"a": 1}, "nosuch~x": {"a": 1}}}
    with pytest.raises(PaskError, match=message):
        parse_config(data, tmp_path)
