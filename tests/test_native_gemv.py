"""The native bf16-weight gemv (decode-sized linear layers): agreement with F.linear, shapes, fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pask.cpu import native_gemv as ng
from pask.cpu.native import NativeKernelError


@pytest.fixture(scope="module")
def gemv():
    if ng.status() != "ok":
        pytest.skip(f"native gemv: {ng.status()}")
    return ng


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, ng.MAX_ROWS),
    k8=st.integers(1, 80),
    n=st.integers(1, 70),
    bias=st.booleans(),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_matches_the_fp32_product_of_the_bf16_values(m, k8, n, bias, scale, seed):
    if ng.status() != "ok":
        pytest.skip(ng.status())
    gen = torch.Generator().manual_seed(seed)
    k = 8 * k8  # 8 .. 640: the sliced reduction (x over 64 KB) appears from 16 rows x 1024
    x = (torch.randn(m, k, generator=gen) * scale).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = ng.linear(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    tol = 1e-5 * (x.float().abs() @ w.float().abs().T).max() + 1e-6  # summation order only
    assert (got - want).abs().max() <= tol


def test_sliced_reduction_and_leading_dims(gemv):
    gen = torch.Generator().manual_seed(1)
    for m, k, n in ((16, 4864, 70), (8, 4864, 129), (3, 1032, 5)):  # x of 8 rows x 4864 is sliced
        x = torch.randn(m, k, generator=gen).bfloat16()
        w = torch.randn(n, k, generator=gen).bfloat16()
        want = F.linear(x.float(), w.float())
        assert (gemv.linear(x, w) - want).abs().max() <= 1e-4 * want.abs().max()
    x3 = torch.randn(2, 1, 64, generator=gen).bfloat16()  # [batch, 1, K]: rows over all leading dims
    w = torch.randn(24, 64, generator=gen).bfloat16()
    assert gemv.linear(x3, w).shape == (2, 1, 24)
    assert torch.allclose(gemv.linear(x3, w), F.linear(x3.float(), w.float()), atol=1e-4)


def test_applies_only_to_decode_sized_bf16_inputs(gemv):
    w = torch.zeros(16, 64, dtype=torch.bfloat16)
    assert gemv.applies(torch.zeros(4, 64, dtype=torch.bfloat16), w)
    assert gemv.applies(torch.zeros(ng.MAX_ROWS, 64, dtype=torch.bfloat16), w)
    assert not gemv.applies(torch.zeros(ng.MAX_ROWS + 1, 64, dtype=torch.bfloat16), w)  # a GEMM
    assert not gemv.applies(torch.zeros(4, 64, dtype=torch.bfloat16), w.float())  # fp32 weight
    assert not gemv.applies(torch.zeros(4, 60, dtype=torch.bfloat16), torch.zeros(16, 60, dtype=torch.bfloat16))
    assert not gemv.applies(torch.zeros(4, 32, dtype=torch.bfloat16), w)  # K mismatch
    assert not gemv.applies(torch.zeros(0, 64, dtype=torch.bfloat16), w)  # empty
    assert not gemv.applies(torch.zeros(4, 64, dtype=torch.bfloat16), w.T.contiguous().T)  # not contiguous


def test_disabled_by_environment_and_missing_compiler(monkeypatch, tmp_path):
    monkeypatch.setattr(ng._PROBE, "state", None)
    monkeypatch.setattr(ng, "_LIB", None)
    monkeypatch.setenv("PASK_NATIVE", "0")
    assert not ng.available() and ng.status() == "disabled by PASK_NATIVE=0"
    assert not ng.applies(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16))
    monkeypatch.setattr(ng._PROBE, "state", None)
    monkeypatch.delenv("PASK_NATIVE")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PASK_CACHE", str(tmp_path))
    monkeypatch.delenv("PASK_ALLOW_FALLBACK", raising=False)
    x, w = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(NativeKernelError, match=r"no C\+\+ compiler.*PASK_NATIVE=0"):
        ng.applies(x, w)  # wanted (a bf16 decode input) but not buildable: an error, not a silent fallback
    assert "no C++ compiler" in ng.status()  # reported without raising
    assert not ng.applies(x.float(), w.float())  # where the kernel does not apply, no probe and no error
    monkeypatch.setenv("PASK_ALLOW_FALLBACK", "1")  # the opt-out: a warning (once), then PyTorch's linear
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        assert not ng.available()
    assert not ng.applies(x, w) and ng.isa() is None
    with pytest.raises(RuntimeError, match="unavailable"):
        ng.linear(x, w)


def _linear_bf16(x, w, b, amx: bool):
    """ng.linear_bf16 with the AMX tiles on or off, on again afterwards."""
    ng.use_amx(amx)
    try:
        return ng.linear_bf16(x, w, b)
    finally:
        ng.use_amx(True)


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, ng.MAX_ROWS),
    k8=st.integers(1, 80),
    n=st.integers(1, 90),
    bias=st.booleans(),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    amx=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_bf16_io_rounds_the_fp32_sum_once(m, k8, n, bias, scale, amx, seed):
    """bf16 in / out (CPUs with AVX512-BF16), tiles on or off: the fp32 product of the bf16 values,
    rounded once to bf16 (summation order aside); K % 32 and N % 16 tails take the dot-product path."""
    if not ng.has_bf16_io():
        pytest.skip("no AVX512-BF16 gemv here")
    gen = torch.Generator().manual_seed(seed)
    k = 8 * k8
    x = (torch.randn(m, 1, k, generator=gen) * scale).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = _linear_bf16(x, w, b, amx)
    assert got.dtype == torch.bfloat16 and got.shape == (m, 1, n)
    sums = (x.float().abs() @ w.float().abs().T).amax() * 1e-5 + 1e-6  # summation order
    assert ((got.float() - want).abs() <= want.abs() * 2**-8 + sums).all()  # + one bf16 rounding


def test_bf16_io_decode_step_routing(gemv, monkeypatch):
    """apply_gemv ('gemv' mode, and 'auto' on a CPU with BF16 arithmetic): decode-sized bf16 inputs
    take the native kernel, prefills PyTorch's linear; other modes and CPUs without BF16 arithmetic
    change nothing."""
    from pask.cpu import bf16_matmul

    if not ng.has_bf16_io():
        pytest.skip("no AVX512-BF16 gemv here")
    lin = torch.nn.Linear(64, 48).bfloat16()
    model = torch.nn.Sequential(lin)
    assert bf16_matmul.apply_gemv(model, "native") == 0
    monkeypatch.setattr(bf16_matmul, "cpu_has_bf16", lambda cpuinfo=None: False)
    assert bf16_matmul.apply_gemv(model, "gemv") == 0
    assert bf16_matmul.apply_gemv(model, "auto") == 0  # auto is fp32 there (apply)
    monkeypatch.setattr(bf16_matmul, "cpu_has_bf16", lambda cpuinfo=None: True)
    assert bf16_matmul.apply(model, "gemv") == 0  # no fp32 products in this mode
    assert bf16_matmul.apply_gemv(model, "auto") == 1  # auto means gemv on a CPU with BF16 arithmetic
    assert bf16_matmul.apply_gemv(model, "gemv") == 1
    calls = []
    real = ng.linear_bf16
    monkeypatch.setattr(ng, "linear_bf16", lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.randn(3, 1, 64).bfloat16()
    torch.testing.assert_close(
        lin(x).float(), F.linear(x.float(), lin.weight.float(), lin.bias.float()), rtol=2**-7, atol=1e-3
    )
    lin(torch.randn(2, 40, 64).bfloat16())  # 80 rows: a prefill
    assert calls == [(3, 1, 64)]


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, ng.MAX_ROWS),
    k32=st.integers(1, 6),
    n16=st.integers(1, 9),
    bias=st.booleans(),
    amx=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(m=16, k32=1, n16=4, bias=True, amx=True, seed=0)
def test_bf16_io_rounds_to_nearest_even_on_both_paths(m, k32, n16, bias, amx, seed):
    """Small integers make every sum exact in fp32, so the only rounding is the final one: the output
    must equal the exact sum rounded to nearest even, bit for bit (tiles' vector epilogue and the dot
    products' scalar one alike); an infinite bias stays infinite, a NaN one NaN."""
    if not ng.has_bf16_io():
        pytest.skip("no AVX512-BF16 gemv here")
    gen = torch.Generator().manual_seed(seed)
    k, n = 32 * k32, 16 * n16
    x = torch.randint(-16, 17, (m, k), generator=gen).bfloat16()
    w = torch.randint(-16, 17, (n, k), generator=gen).bfloat16()
    b = torch.randint(-300, 301, (n,), generator=gen).bfloat16() if bias else None
    if bias:
        b[0], b[-1] = float("inf"), float("nan")
    want = F.linear(x.double(), w.double(), None if b is None else b.double()).bfloat16()
    got = _linear_bf16(x, w, b, amx)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
