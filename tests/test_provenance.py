"""Provenance: code version of a (tmp) git tree, refusal of dirty writes into committed results,
PASK_* capture, the markdown footer, sweep runs and adopted cells."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import pask.experiments.provenance as prov
import pask.experiments.sweep as sweep
from pask.errors import PaskError

MACHINE = {"cpu": "x86_64", "cpu_model": "Test CPU", "cpu_flags": ["avx2", "fma"], "cores": 2, "cores_usable": 2}


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A committed tree shaped like pask's (package, benchmark scripts, results); pask's root points at it."""
    root = tmp_path / "repo"
    for rel, text in {
        "pask/__init__.py": "",
        "data/x.txt": "data\n",
        "benchmarks/b.py": "print(1)\n",
        "benchmarks/results/r.json": "{}\n",
        "pyproject.toml": "[project]\n",
        "README.md": "readme\n",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    monkeypatch.setattr(prov, "source_root", lambda: root)
    monkeypatch.setattr(prov, "machine", lambda: dict(MACHINE))
    return root


def test_code_version_dirty_means_code_changes_only(repo):
    clean = prov.code_version()
    assert clean["commit"] == git(repo, "rev-parse", "HEAD").strip() and clean["dirty"] is False
    assert not clean["key"].endswith("+dirty")
    # results, docs and new results files do not make the tree dirty
    (repo / "benchmarks/results/r.json").write_text('{"a": 1}\n')
    (repo / "benchmarks/results/new.md").write_text("x\n")
    (repo / "benchmarks/results/sub").mkdir()
    (repo / "benchmarks/results/sub/run.py").write_text("x\n")  # a script inside results: not code
    (repo / "README.md").write_text("changed\n")
    v = prov.code_version()
    assert v["dirty"] is False and v["key"] == clean["key"] and v["describe"].endswith("-dirty")
    # a benchmark script or pyproject.toml: dirty, but the sweep's key (package + data) stays
    (repo / "benchmarks/b.py").write_text("print(2)\n")
    v = prov.code_version()
    assert v["dirty"] is True and v["dirty_files"] == ["benchmarks/b.py"] and v["n_dirty_files"] == 1
    assert v["key"] == clean["key"]
    # a new file in the package: dirty and a new key
    (repo / "pask/new.py").write_text("x = 1\n")
    v = prov.code_version()
    assert v["key"] == clean["key"] + "+dirty" and set(v["dirty_files"]) == {"benchmarks/b.py", "pask/new.py"}


def test_code_version_outside_git(tmp_path):
    (tmp_path / "pask").mkdir()
    v = prov.code_version(tmp_path)
    assert v["key"].startswith("pask-") and "commit" not in v


def test_write_result_refuses_dirty_code_into_committed_results(repo, tmp_path):
    (repo / "pask/__init__.py").write_text("x = 1\n")  # uncommitted code
    stem = repo / "benchmarks/results/bench"
    with pytest.raises(PaskError, match=r"(?s)refusing.*pask/__init__.py.*--allow-dirty"):
        prov.write_result(stem, {"v": 1}, "# body\n")
    assert not stem.with_suffix(".json").exists() and not stem.with_suffix(".md").exists()
    with pytest.raises(PaskError):
        prov.check_clean(repo / "benchmarks/results/sub/deeper", False)
    # elsewhere is fine, and --allow-dirty writes with the record saying so
    js, md = prov.write_result(tmp_path / "elsewhere" / "bench", {"v": 1}, "# body\n", command="cmd")
    assert json.loads(js.read_text())["provenance"]["code_version"]["dirty"] is True
    js, md = prov.write_result(stem, {"v": 1}, "# body\n", command="cmd", allow_dirty=True)
    data = json.loads(js.read_text())
    assert data["v"] == 1 and data["provenance"]["allow_dirty"] is True
    assert "written with --allow-dirty" in md.read_text()
    # committed code: no refusal (the results file itself being new does not count)
    git(repo, "add", "pask")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "code")
    js, _ = prov.write_result(repo / "benchmarks/results/bench2.json", {"v": 2}, None, command="cmd")
    assert js.name == "bench2.json" and not (repo / "benchmarks/results/bench2.md").exists()
    assert json.loads(js.read_text())["provenance"]["code_version"]["dirty"] is False


def test_provenance_record_and_pask_env(repo, monkeypatch):
    for k in [k for k in __import__("os").environ if k.startswith("PASK_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("PASK_BF16_MATMUL", "gemv")
    monkeypatch.setenv("PASK_NATIVE", "0")
    monkeypatch.setenv("NOT_PASK", "x")
    p = prov.provenance("pask bench serve --out x")
    assert p["command"] == "pask bench serve --out x"
    assert p["env"] == {"PASK_BF16_MATMUL": "gemv", "PASK_NATIVE": "0"}
    assert p["machine"] == MACHINE and p["code_version"]["commit"] and p["time"].endswith("Z")
    assert set(p["versions"]) >= {"python", "torch", "transformers"} and p["versions"]["torch"]


def test_markdown_footer(repo, tmp_path, monkeypatch):
    monkeypatch.setenv("PASK_BF16_MATMUL", "gemv")
    body = "# Title\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    _, md = prov.write_result(tmp_path / "r", {"x": 1}, body, command="python benchmarks/b.py --threads 2")
    text = md.read_text()
    assert text.startswith(body + "\n---\n")  # the body unchanged, then the footer
    commit = git(repo, "rev-parse", "HEAD").strip()
    assert "- command: `python benchmarks/b.py --threads 2`" in text
    assert f"- code: commit {commit[:12]}, clean" in text
    assert "- machine: Test CPU, 2/2 cores, avx2 fma" in text
    assert "`PASK_BF16_MATMUL=gemv`" in text


def test_machine_line_and_cpu_info():
    info = prov.cpu_info("processor : 0\nmodel name : Xeon X\nflags : fpu avx2 fma avx512f amx_tile amx_bf16\n")
    assert info == {"model": "Xeon X", "flags": ["avx2", "fma", "avx512f", "amx_tile", "amx_bf16"]}
    assert prov.cpu_info("")["flags"] is None
    line = prov.machine_line({**MACHINE, "cpu_bf16": False, "amx": False, "bf16_matmul": "auto"})
    assert "BF16 arithmetic no" in line and "AMX no" in line and "bf16 matmul auto" in line
    assert prov.machine_line("unknown") == "unknown"


def test_machine_record_on_this_machine():
    m = prov.machine()
    for key in ("cpu_model", "cpu_flags", "cores", "torch_threads", "cpu_bf16", "amx", "bf16_matmul"):
        assert key in m
    assert m["native_attention"] and m["native_gemv"]


@pytest.mark.parametrize(
    "argv, orig, want",
    [
        (["/x/.venv/bin/pask", "sweep", "--config", "a b.toml"], None, "pask sweep --config 'a b.toml'"),
        (["benchmarks/kv_bench.py", "--threads", "2"], None, "python benchmarks/kv_bench.py --threads 2"),
        (["/y/pask/cli.py", "bench"], ["python3", "-m", "pask.cli", "bench"], "python -m pask.cli bench"),
        (["-c"], ["python", "-c", "print()"], "python -c"),
    ],
)
def test_default_command(argv, orig, want):
    assert prov.default_command(argv, orig) == want


# -- the sweep: per-run provenance, adopted cells keep the producing code version ---------------------
@pytest.fixture
def fake(monkeypatch):
    from tests.test_sweep import FAKE, _fake_run

    monkeypatch.setitem(sweep.TASKS, "fake", FAKE)
    monkeypatch.setattr(sweep, "machine", lambda: dict(MACHINE))
    _fake_run.calls = []
    return _fake_run.calls


def test_sweep_records_each_runs_provenance(tmp_path, fake, monkeypatch):
    from tests.test_sweep import fake_config, no_model

    monkeypatch.setenv("PASK_BF16_MATMUL", "fp32")
    cfg = sweep.parse_config(fake_config(tmp_path, policies=["full"]), tmp_path)
    record = sweep.run_sweep(cfg, load=no_model)
    man = json.loads((cfg.results_dir / cfg.cells[0].rel_dir / "cell.json").read_text())
    (run,) = man["runs"]
    assert run["code_version"] == man["code_version"] and run["machine"] == MACHINE
    assert run["env"]["PASK_BF16_MATMUL"] == "fp32" and run["command"] and run["versions"]["python"]
    assert record["command"] == run["command"] and record["machine"] == MACHINE and record["env"] == run["env"]


def test_adopted_cell_keeps_the_producing_code_version(tmp_path, fake, monkeypatch):
    from tests.test_sweep import _eval_results, fake_config, no_model

    cfg = sweep.parse_config(fake_config(tmp_path, policies=["kivi-4", "kivi-2"]), tmp_path)
    kivi, kivi2 = cfg.cells
    base = {"model": kivi.model, "budget": 0.5, "split": "test", "command": "pask eval ..."}
    made = {"key": "0123", "commit": "a" * 40, "describe": "aaaa", "dirty": False}
    _eval_results(cfg.results_dir / kivi.rel_dir, [f"case{i}" for i in range(6)], policy="kivi-4", **base,
                  code_version=made, machine={"cpu": "old"})  # fmt: skip
    _eval_results(cfg.results_dir / kivi2.rel_dir, [f"case{i}" for i in range(4)], policy="kivi-2", **base)
    now = sweep.code_version()
    sweep.run_sweep(cfg, load=lambda *a: pytest.fail("adopted cells must not run"), adopt=True)
    mk, mh = (json.loads((cfg.results_dir / c.rel_dir / "cell.json").read_text()) for c in (kivi, kivi2))
    assert mk["code_version"] == made and mk["adopted"]["machine"] == {"cpu": "old"}
    assert mk["adopted"]["by_code_version"] == now and mk["adopted"]["rows_not_counted"] == 2
    assert mh["code_version"] == {"commit": "unknown"} and mh["adopted"]["machine"] == "unknown"
    assert "rows_not_counted" not in mh["adopted"]
    # later sweeps of the same code keep them; another code version refuses them
    assert {c["state"] for c in sweep.run_sweep(cfg, load=no_model)["cells"].values()} == {"done"}
    monkeypatch.setattr(sweep, "code_version", lambda: {**now, "key": "other"})
    with pytest.raises(PaskError, match="made by code version"):
        sweep.run_sweep(cfg, load=no_model)


# -- the bench commands check before they run -------------------------------------------------------
def test_bench_commands_refuse_dirty_writes_before_loading_a_model(repo, monkeypatch):
    from typer.testing import CliRunner

    from pask.cli import app

    (repo / "pask/__init__.py").write_text("x = 1\n")
    monkeypatch.setattr("pask.runtime.models.load_model", lambda *a, **k: pytest.fail("refused before loading"))
    runner = CliRunner()
    out = repo / "benchmarks/results/serving/x"
    res = runner.invoke(app, ["bench", "serve", "--policies", "full", "--out", str(out)])
    assert res.exit_code == 2 and "refusing" in res.output and "--allow-dirty" in res.output
    res = runner.invoke(app, ["bench", "kv", "--policy", "h2o", "--out", str(repo / "benchmarks/results/po")])
    assert res.exit_code == 2 and "refusing" in res.output


def test_benchmark_scripts_write_through_write_result():
    """Every script under benchmarks/ that writes results does it through write_result, with --allow-dirty."""
    scripts = sorted(Path(__file__).resolve().parents[1].glob("benchmarks/*.py"))
    assert scripts
    for s in scripts:
        src = s.read_text()
        if "write_result(" not in src:
            assert ".write_text(" not in src and "json.dump(" not in src, s.name
            continue
        assert "add_allow_dirty(" in src and "check_clean(" in src, s.name
