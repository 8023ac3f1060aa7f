"""pask.kv.native_latent: BellowsKV's key scores (bias + RoPE + query product) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pask.cpu import native as native_build
from pask.kv import native_latent as nl


def _inputs(m: int, hkv: int, rows: int, d: int, cuts: list[int], dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    keys = (torch.randn(m, hkv * d, generator=gen) * 3).to(dtype)
    bias = torch.randn(hkv * d, generator=gen)
    ang = torch.rand(m, d // 2, generator=gen) * 100.0
    cos, sin = torch.cat([ang.cos()] * 2, dim=1), torch.cat([ang.sin()] * 2, dim=1)
    starts = [0, *sorted(cuts), m]
    q = torch.randn(len(starts) - 1, hkv, rows, d, generator=gen)
    return keys, bias, cos, sin, starts, q


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(0, 70),
    hkv=st.integers(1, 3),
    rows=st.integers(1, 9),
    d=st.sampled_from([2, 8, 64, 128]),
    cuts=st.lists(st.floats(0, 1), max_size=3),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kernel_equals_the_reference(m, hkv, rows, d, cuts, bf16, seed):
    dtype = torch.bfloat16 if bf16 else torch.float32
    keys, bias, cos, sin, starts, q = _inputs(m, hkv, rows, d, [int(c * m) for c in cuts], dtype, seed)
    want = nl.reference(keys, bias, cos, sin, starts, q, 0.3)
    got = nl.scores(keys, bias, cos, sin, starts, q, 0.3)
    assert got.shape == (hkv, rows, m)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_half_tables_are_read_in_place_or_copied():
    keys, bias, cos, sin, starts, q = _inputs(20, 2, 3, 64, [7], torch.bfloat16, 1)
    want = nl.reference(keys, bias, cos, sin, starts, q, 1.0)
    torch.testing.assert_close(nl.scores(keys, bias, cos, sin, starts, q, 1.0), want, rtol=1e-5, atol=1e-4)
    # bf16 tables (copied to fp32 halves) and a non-contiguous key view give the same scores
    got = nl.scores(keys.float()[:, :].t().contiguous().t(), bias, cos.double(), sin.double(), starts, q, 1.0)
    torch.testing.assert_close(got, nl.reference(keys.float(), bias, cos, sin, starts, q, 1.0), rtol=1e-5, atol=1e-4)


def test_bad_shapes_are_rejected():
    keys, bias, cos, sin, _, q = _inputs(10, 1, 2, 8, [], torch.float32, 2)
    with pytest.raises(RuntimeError, match="rejected the shape"):
        nl.scores(keys, bias, cos, sin, [0, 11], q, 1.0)  # a sequence past the keys
    with pytest.raises(RuntimeError, match="rejected the shape"):
        nl.scores(keys, bias, cos, sin, [5, 3], q, 1.0)  # a range backwards
    assert not nl.applies(keys, torch.zeros(1, 1, 2, 512))  # head size above the kernel's
    assert not nl.applies(keys.half(), q)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setattr(nl._PROBE, "state", None)
    monkeypatch.setattr(nl, "_LIB", None)
    monkeypatch.setenv("PASK_NATIVE", "0")
    assert not nl.available() and nl.status() == "disabled by PASK_NATIVE=0"
    keys, bias, cos, sin, starts, q = _inputs(4, 1, 1, 8, [], torch.float32, 3)
    assert not nl.applies(keys, q)
    with pytest.raises(RuntimeError, match="disabled"):
        nl.scores(keys, bias, cos, sin, starts, q, 1.0)


def test_missing_compiler_is_an_error_unless_fallback_is_allowed(monkeypatch, tmp_path):
    monkeypatch.setattr(nl._PROBE, "state", None)
    monkeypatch.setattr(nl, "_LIB", None)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PASK_CACHE", str(tmp_path))
    monkeypatch.delenv("PASK_ALLOW_FALLBACK", raising=False)
    with pytest.raises(native_build.NativeKernelError, match=r"native latent scores.*no C\+\+ compiler"):
        nl.available()
    monkeypatch.setenv("PASK_ALLOW_FALLBACK", "1")
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        assert not nl.available()
