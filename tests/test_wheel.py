"""Packaging: what a non-editable install ships (package data) and what it refuses to run without.

The slow test builds a wheel, installs it into a fresh venv (dependencies from this venv, not pask)
and checks that the native kernels compile from the shipped sources, the tuned configurations and
the frozen PASK tables are found, and ``pask generate`` runs. The fast tests check the pieces:
:func:`pask.policies.table.default_table` and the strictness of the tuned configurations.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import time
import tomllib
import warnings
from pathlib import Path

import pytest

from pask.errors import PaskError
from pask.policies import tuning
from pask.policies.table import INDEXED_DEFAULTS, TABLES_DIR, default_table, load

ROOT = Path(__file__).resolve().parents[1]
MODEL = "qwen2.5-coder-0.5b"


# -- default tables ---------------------------------------------------------------------------------
def test_default_table_finds_the_committed_tables():
    bfcl = default_table(MODEL, "bfcl", 0.33)
    assert bfcl == TABLES_DIR / f"{MODEL}-bfcl-b0.33.json" and bfcl.is_file()
    assert TABLES_DIR == ROOT / "pask" / "tables"
    for b in (0.275, 0.4, 0.5, 0.6):
        assert default_table(MODEL, "sql", b).name == f"{MODEL}-sql-b{b:g}.json"
    assert default_table(MODEL, "bfcl", 0.25).name == f"{MODEL}-bfcl-b0.25.json"
    assert default_table(MODEL, "bfcl", float("0.330")) == bfcl  # the budget's value, not its spelling
    # below INT4's floor: the K4V2 frontier tables (issue 29)
    assert default_table(MODEL, "bfcl", 0.2).name == f"{MODEL}-bfcl-k4v2-b0.2.json"
    assert default_table(MODEL, "bfcl", 0.150).name == f"{MODEL}-bfcl-k4v2-b0.15.json"
    assert default_table(MODEL, "sql", 0.2).name == f"{MODEL}-sql-cd-k4v2-b0.2.json"
    assert default_table(MODEL, "sql", 0.15).name == f"{MODEL}-sql-cd-k4v2-b0.15.json"
    assert default_table("smollm2-135m", "bfcl", 0.2) is None


@pytest.mark.parametrize(
    "model, task, budget",
    [
        (MODEL, "bfcl4", 0.33),  # an experiment's table (all four categories), not a default
        (MODEL, "bfcl", 0.3),  # no table at that budget
        (MODEL, "magic", 0.33),
        ("smollm2-135m", "bfcl", 0.33),  # no table for that model
        ("../tables/" + MODEL, "bfcl", 0.33),
        ("", "bfcl", 0.33),
    ],
)
def test_default_table_is_none_where_there_is_none(model, task, budget):
    assert default_table(model, task, budget) is None


def test_every_default_table_matches_its_name():
    """Each shipped ``{model}-{task}-b{budget}.json`` is that model's table for that task and budget."""
    found = 0
    for path in sorted(TABLES_DIR.glob("*.json")):
        with warnings.catch_warnings():  # an experiment's infeasible table loads with a warning
            warnings.simplefilter("ignore", UserWarning)
            table = load(path)
        got = default_table(table.model_name, table.task, table.target_b)
        # an experiment's table: calibrated on all four BFCL categories (-bfcl4-), or a four- / three-action
        # or K4V2 frontier calibration (-4a- / -3a- / -k4v2-), never a default unless INDEXED_DEFAULTS names it
        if path.name in INDEXED_DEFAULTS.values():
            assert got == path, path.name
            continue
        if any(mark in path.name for mark in ("-bfcl4-", "-4a-", "-3a-", "-k4v2-")):
            assert got != path
            continue
        assert got == path, path.name
        found += 1
    assert found >= 7


def test_package_data_declares_the_sources_configs_and_tables():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {
        p.relative_to(ROOT)
        for pkg, globs in data.items()
        for g in globs
        for p in ROOT.joinpath(*pkg.split(".")).glob(g)
    }
    needed = [*ROOT.glob("pask/cpu/*.cpp"), *ROOT.glob("pask/cpu/*.h"), tuning.CONFIGS_PATH, tuning.SQL_CONFIGS_PATH]
    needed += [default_table(MODEL, "bfcl", 0.33)]
    assert len(needed) >= 6 and all(p.relative_to(ROOT) in shipped for p in needed), sorted(map(str, shipped))


# -- tuned configurations ---------------------------------------------------------------------------
def test_a_missing_configs_file_is_an_error(tmp_path, monkeypatch):
    monkeypatch.delenv(tuning.ALLOW_UNTUNED_ENV, raising=False)
    monkeypatch.setattr(tuning, "CONFIGS_PATH", tmp_path / "configs.json")
    with pytest.raises(PaskError, match=r"configs\.json are missing.*reinstall.*PASK_ALLOW_UNTUNED=1"):
        tuning.effective_config("snapkv", 0.33)
    with pytest.raises(PaskError, match="are missing"):
        tuning.tuned_config("snapkv", 0.33, tmp_path / "configs.json")
    monkeypatch.setenv(tuning.ALLOW_UNTUNED_ENV, "1")
    assert tuning.effective_config("snapkv", 0.33) == {} and tuning.tuned_config("h2o", 0.5, tmp_path / "x") == {}


def test_a_tunable_policy_without_an_entry_is_an_error_unless_configured(tmp_path, monkeypatch):
    from pask.policies.factory import make_policy

    monkeypatch.delenv(tuning.ALLOW_UNTUNED_ENV, raising=False)
    configs = tmp_path / "configs.json"
    configs.write_text(json.dumps({"h2o": {"0.33": {"sink": 2, "recent": 32}}}))
    monkeypatch.setattr(tuning, "CONFIGS_PATH", configs)
    assert tuning.effective_config("h2o", 0.33) == {"sink": 2, "recent": 32}
    assert tuning.effective_config("h2o", 0.33, {"recent": 16}) == {"sink": 2, "recent": 16}
    with pytest.raises(PaskError, match=r"no tuned configuration of h2o at B=0\.5 for task bfcl.*PASK_ALLOW_UNTUNED"):
        tuning.effective_config("h2o", 0.5)
    with pytest.raises(PaskError, match=r"pask tune --task bfcl --policy snapkv --budget 0\.33"):
        make_policy("snapkv", 0.33)
    assert tuning.effective_config("h2o", 0.5, {"recent": 16}) == {"recent": 16}  # an explicit configuration
    assert make_policy("h2o", 0.5, '{"sink": 8}').sink == 8
    for name in ("mikv", "kivi-4", "kivi-2", "static_mix"):  # nothing to tune: their defaults are final
        assert tuning.effective_config(name, 0.5) == {}
    assert make_policy("full", None) is None
    monkeypatch.setenv(tuning.ALLOW_UNTUNED_ENV, "1")
    assert tuning.effective_config("h2o", 0.5) == {} and make_policy("h2o", 0.5).recent == 32  # the default


def test_the_committed_sweeps_run_their_tuned_configurations(monkeypatch):
    """Every baseline cell of benchmarks/*.toml has its tuned entry (no error) and gets it unchanged."""
    from pask.experiments import sweep

    monkeypatch.delenv(tuning.ALLOW_UNTUNED_ENV, raising=False)
    n = 0
    for path in sorted(ROOT.glob("benchmarks/*.toml")):
        for cell in sweep.load_config(path).cells:  # (resolves the PASK tables: they must exist)
            if cell.policy in sweep.ABLATIONS or cell.policy == "full":
                continue
            recorded = json.loads(tuning.configs_path_for(cell.task).read_text())
            want = recorded.get(cell.policy, {}).get(tuning.budget_key(cell.budget), {})
            assert tuning.effective_config(cell.policy, cell.budget, cell.policy_config, cell.task) == {
                **want,
                **cell.policy_config,
            }
            assert want or not tuning.TABLE8_GRIDS.get(cell.policy), cell.name
            n += 1
    assert n >= 40


# -- the wheel --------------------------------------------------------------------------------------
REQUEST = {
    "messages": [{"role": "user", "content": "Weather in Paris?"}],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The current weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ],
}

CHECK = """
import json, sysconfig
import pask, pask.kv
from pask.cpu import native_gemv
from pask.kv import native_attention
from pask.policies.table import default_table, load
from pask.policies.tuning import SQL_CONFIGS_PATH, tuned_config

table = default_table("qwen2.5-coder-0.5b", "bfcl", 0.33)
print(json.dumps({
    "pask": pask.__file__,
    "purelib": sysconfig.get_path("purelib"),
    "native_attention": native_attention.status(),
    "native_gemv": native_gemv.status(),
    "snapkv": tuned_config("snapkv", 0.33),
    "snapkv_sql": tuned_config("snapkv", 0.4, SQL_CONFIGS_PATH),
    "table": None if table is None else str(table),
    "table_task": None if table is None else load(table).task,
}))
"""


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd``; on failure, fail the test with its stdout and stderr."""
    t0 = time.monotonic()
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    took = time.monotonic() - t0
    if proc.returncode != 0:
        pytest.fail(
            f"{' '.join(map(str, cmd))} exited {proc.returncode} after {took:.0f} s\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}",
            pytrace=False,
        )
    return proc


def _source_copy(dest: Path) -> Path:
    """The files a wheel is built from (pyproject, README, the package) in ``dest``: building in
    the working tree would write build/ and *.egg-info there, and setuptools puts whatever stale
    modules build/lib still holds into the next wheel."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "*.calibration", "*.so")
    shutil.copytree(ROOT / "pask", dest / "pask", ignore=junk)
    return dest


@pytest.mark.slow
def test_wheel_ships_kernels_configs_and_tables(tmp_path):
    t0 = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PASK_NATIVE", "PASK_ALLOW_FALLBACK")}
    env.pop("PASK_ALLOW_UNTUNED", None)
    src = _source_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w", dist], cwd=src)
    (wheel,) = dist.glob("pask-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv])
    py = venv / "bin" / "python"
    purelib = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    # the dependencies (torch, transformers, llguidance, the model packages) from this venv; a plain
    # path line does not run that directory's own .pth files, so its editable pask is not picked up
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    assert deps
    (purelib / "_pask_test_deps.pth").write_text("".join(f"{p}\n" for p in deps))
    _run([py, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel], env=env)

    work = tmp_path / "work"  # not the repository: nothing importable from the working tree
    work.mkdir()
    fresh = {**env, "PASK_CACHE": str(tmp_path / "cache")}  # the kernels compile from the shipped sources
    res = json.loads(_run([py, "-c", CHECK], cwd=work, env=fresh).stdout.strip().splitlines()[-1])
    assert Path(res["pask"]).resolve().is_relative_to(purelib.resolve()), res  # the wheel's pask, not the repo's
    assert res["native_attention"] == "ok" and res["native_gemv"] == "ok", res
    assert res["snapkv"] and res["snapkv_sql"], res
    assert res["table"] and Path(res["table"]).resolve().is_relative_to(purelib.resolve()), res
    assert res["table_task"] == "bfcl"

    req = work / "req.json"
    req.write_text(json.dumps(REQUEST))
    cmd = [venv / "bin" / "pask", "generate", req, "--model", "smollm2-135m", "--dtype", "fp32"]
    out = _run([*cmd, "--max-new-tokens", "32"], cwd=work, env=env)  # the normal cache: the model converts once
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["calls"] and result["calls"][0]["name"] == "get_weather", out.stdout
    print(f"wheel built, installed and checked in {time.monotonic() - t0:.0f} s")
