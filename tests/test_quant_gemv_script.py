"""benchmarks/quant_gemv.py: its argument refusals (exit 2, no traceback) and a tiny run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pask.cpu import native_gemv

SCRIPT = Path(__file__).parents[1] / "benchmarks/quant_gemv.py"


@pytest.mark.parametrize(
    "args, words",
    [
        (["--rows", "eight"], "comma-separated integers"),
        (["--rows", "17"], "--rows must lie in 1..16"),
        (["--bits", "3"], "--bits takes 4 and / or 8"),
        (["--passes", "0"], "must be >= 1"),
    ],
)
def test_bad_arguments_exit_2(args, words):
    res = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert words in res.stderr


def test_a_tiny_run_times_both_kernels(tmp_path):
    if native_gemv.status() != "ok" or not native_gemv.use_int8_linears(None):
        pytest.skip("no AVX2 int8-activation kernel here")
    out = tmp_path / "q"
    args = ["--model", "smollm2-135m", "--rows", "1,3", "--bits", "4", "--passes", "1", "--copies", "1"]
    res = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(out.with_suffix(".json").read_text())
    assert set(data["cases"]) == {"int4 x 1", "int4 x 3"}
    for case in data["cases"].values():
        assert set(case["ms"]) == {"avx2-int8", "dequant"} and case["speedup"] > 0
    assert "| int4 x 3 |" in out.with_suffix(".md").read_text()
