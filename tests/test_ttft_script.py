"""benchmarks/ttft.py: its argument refusals (exit 2, no traceback, before the model loads) and its table."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks/ttft.py"
_SPEC = importlib.util.spec_from_file_location("ttft", SCRIPT)
ttft = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ttft)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--lengths", "8k"], "comma-separated integers"),
        (["--lengths", "16"], "--lengths >= 64"),
        (["--repeats", "0"], "--repeats >= 1"),
        (["--policies", " , "], "at least one policy"),
        (["--weights", "int3"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_before_the_model_loads(args, words):
    res = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert words in res.stderr


def test_a_prefill_store_in_the_environment_is_refused(tmp_path):
    """run_jobs would load the computed setting's prefills from $PASK_PREFILL_STORE."""
    env = {**os.environ, "PASK_PREFILL_STORE": str(tmp_path)}
    res = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "unset $PASK_PREFILL_STORE" in res.stderr


def test_markdown_gives_the_overhead_against_the_first_policy():
    rows = [
        {"input_len": 8192, "setting": "computed", "policy": "full", "ms": [100.0, 102.0], "median_ms": 101.0,
         "overhead": 0.0, "measured_b": 1.0},
        {"input_len": 8192, "setting": "computed", "policy": "pask@0.33", "ms": [104.0, 106.0], "median_ms": 105.0,
         "overhead": 105.0 / 101.0 - 1, "measured_b": 0.32},
    ]  # fmt: skip
    r = {"command": "python benchmarks/ttft.py", "model": "m", "weights": "bf16", "threads": 2, "repeats": 2,
         "rows": rows}  # fmt: skip
    md = ttft.markdown(r)
    assert "| 8192 | computed | pask@0.33 | 105.0 | +4.0 % | 0.320 | 104, 106 |" in md
    assert "| 8192 | computed | full | 101.0 | +0.0 % | 1.000 | 100, 102 |" in md
