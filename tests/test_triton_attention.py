"""The Triton decode kernel against the torch reference (Triton's interpreter on CPU).

Triton reads ``TRITON_INTERPRET`` when it is first imported, and importing transformers already
imports it (through torch._dynamo), so the comparison runs in a child process started with
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton); the Triton kernel is optional", allow_module_level=True)

CHILD = textwrap.dedent(
    """
    import json
    import torch
    from transformers import LlamaConfig
    from pask.kv import Action, CacheConfig, TieredCache
    from pask.kv.attention import tiered_attention_reference
    from pask.kv.triton_attention import triton_decode_attention
    from pask.policies import StaticMixPolicy

    torch.set_num_threads(1)

    def store(hq, hkv, n, mix, dtype):
        cfg = LlamaConfig(hidden_size=hq * 64, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=64,
                          num_hidden_layers=1, intermediate_size=32, vocab_size=16)
        g = torch.Generator().manual_seed(0)
        cache = TieredCache(cfg, CacheConfig(num_groups=1, recent_window=4), 1)
        k = torch.randn(1, hkv, n, 64, generator=g) * 2
        cache.update(k.to(dtype), torch.randn(1, hkv, n, 64, generator=g).to(dtype), 0)
        acts = StaticMixPolicy(*mix).assign(torch.arange(n - 4))
        for a in (Action.L, Action.R):
            cache.apply(0, 0, torch.nonzero(acts == int(a)).flatten(), a)
        return cache.layers[0].seqs[0]

    out = []
    for hq, hkv, n, mix, dtype in CASES:
        dtype = getattr(torch, dtype)
        st = store(hq, hkv, n, mix, dtype)
        q = torch.randn(hq, 1, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
        ref = tiered_attention_reference(q, st, 0.125).float()
        got = triton_decode_attention(q, st, 0.125).float()
        out.append([list(got.shape), float((got - ref).abs().max())])
    print("RESULT " + json.dumps(out))
    """
)

CASES = [
    (6, 2, 150, (0.4, 0.3, 0.3), "float32"),  # GQA 3, all three tiers
    (3, 3, 90, (0.0, 1.0, 0.0), "float32"),  # MHA, INT4 only (+ window)
    (4, 1, 70, (1.0, 0.0, 0.0), "float32"),  # GQA 4, H only
    (6, 2, 40, (0.2, 0.4, 0.4), "float32"),  # short
    (6, 2, 100, (0.34, 0.33, 0.33), "bfloat16"),
]


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = f"CASES = {CASES!r}\n" + CHILD
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300, check=False
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}q{c[1]}kv-n{c[2]}-{c[4]}" for c in CASES])
def test_triton_matches_reference(results, case):
    hq, _, _, _, dtype = CASES[case]
    shape, diff = results[case]
    assert shape == [1, hq, 64]
    assert diff <= (1e-4 if dtype == "float32" else 2e-2)


def test_triton_kernel_refuses_cpu_without_interpreter(monkeypatch):
    import torch

    from pask.errors import PaskError
    from pask.kv.triton_attention import triton_decode_attention

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(PaskError, match="TRITON_INTERPRET"):
        triton_decode_attention(torch.zeros(2, 1, 64), object(), 0.125)
