"""fp32 products for bf16 linear layers on CPUs without BF16 arithmetic (pask.cpu.bf16_matmul)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from pask.cpu import bf16_matmul, native_gemv
from pask.errors import PaskError


def _close_to_fp32_product(got: torch.Tensor, x: torch.Tensor, lin: torch.nn.Linear) -> bool:
    """The native gemv's result: the fp32 product up to summation order, rounded to bf16 (1 ulp)."""
    bias = None if lin.bias is None else lin.bias.float()
    want = F.linear(x.float(), lin.weight.float(), bias)
    return got.dtype == torch.bfloat16 and bool(((got.float() - want).abs() <= want.abs() / 128 + 1e-4).all())


def _mlp(dtype=torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32, bias=False)).to(dtype)


def test_cpu_flags_decide_auto_mode():
    assert bf16_matmul.cpu_has_bf16("processor : 0\nflags : fpu avx2 avx512f avx512_bf16\n")
    assert bf16_matmul.cpu_has_bf16("flags : fpu avx2 amx_bf16 amx_tile\n")
    assert not bf16_matmul.cpu_has_bf16("flags : fpu sse4_2 avx2 fma f16c\n")
    assert bf16_matmul.cpu_has_bf16("Processor : AArch64\n")  # no x86 flags line: change nothing


def test_fp32_mode_computes_in_fp32_on_bf16_values_and_keeps_small_inputs_native():
    m = _mlp()
    lin = m[0]
    x = torch.randn(40, 64).bfloat16()
    small = x[:4]
    native_small = lin(small)
    assert bf16_matmul.apply(m, "fp32") == 2
    assert bf16_matmul.apply(m, "fp32") == 2  # idempotent: the same forward again
    want = F.linear(x.float(), lin.weight.float(), lin.bias.float()).bfloat16()
    got = lin(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    if native_gemv.available():  # decode-sized inputs: the native gemv (the fp32 product)
        assert _close_to_fp32_product(lin(small), small, lin)
    else:  # under MIN_ROWS rows: PyTorch's bf16 GEMM
        assert torch.equal(lin(small), native_small)
    assert (m(x).float() - _mlp()(x).float()).abs().max() <= 0.05  # same bf16 model, other rounding
    batched = torch.randn(2, 20, 64).bfloat16()  # rows counted over all leading dims
    assert torch.equal(lin(batched), F.linear(batched.float(), lin.weight.float(), lin.bias.float()).bfloat16())


def test_fp32_weights_mode_keeps_an_fp32_copy_and_uses_it_for_every_input():
    m = _mlp()
    lin = m[0]
    x = torch.randn(40, 64).bfloat16()
    assert bf16_matmul.apply(m, "fp32-weights") == 2
    assert lin.pask_weight_fp32.dtype == torch.float32 and torch.equal(lin.pask_weight_fp32, lin.weight.float())
    assert "pask_weight_fp32" not in lin.state_dict()  # not persistent: checkpoints unchanged
    want = F.linear(x.float(), lin.weight.float(), lin.bias.float()).bfloat16()
    assert torch.equal(lin(x), want)
    small = x[:3]  # decode-sized: the native gemv where it is built, else the fp32 copy
    if native_gemv.available():
        assert _close_to_fp32_product(lin(small), small, lin)
    else:
        assert torch.equal(lin(small), F.linear(small.float(), lin.weight.float(), lin.bias.float()).bfloat16())
    assert bf16_matmul.apply(m, "fp32-weights") == 2  # idempotent: one copy


def test_native_mode_fp32_models_and_auto_on_bf16_cpus_change_nothing(monkeypatch):
    assert bf16_matmul.apply(_mlp(), "native") == 0
    assert bf16_matmul.apply(_mlp(torch.float32), "fp32") == 0
    monkeypatch.setattr(bf16_matmul, "cpu_has_bf16", lambda cpuinfo=None: True)
    assert bf16_matmul.apply(_mlp(), "auto") == 0
    monkeypatch.setattr(bf16_matmul, "cpu_has_bf16", lambda cpuinfo=None: False)
    assert bf16_matmul.apply(_mlp(), "auto") == 2


def test_mode_comes_from_the_environment_and_bad_values_are_clear_errors(monkeypatch):
    monkeypatch.setenv("PASK_BF16_MATMUL", "FP32")
    assert bf16_matmul.mode() == "fp32"
    monkeypatch.delenv("PASK_BF16_MATMUL")
    assert bf16_matmul.mode() == "auto"
    monkeypatch.setenv("PASK_BF16_MATMUL", "fast")
    with pytest.raises(PaskError, match="PASK_BF16_MATMUL must be one of auto, fp32, fp32-weights, native, gemv"):
        bf16_matmul.mode()
    with pytest.raises(PaskError, match="mode must be one of"):
        bf16_matmul.apply(_mlp(), "fast")


def test_the_server_takes_the_native_gemv_in_auto_mode_and_keeps_an_explicit_mode(monkeypatch):
    monkeypatch.delenv("PASK_BF16_MATMUL", raising=False)
    assert bf16_matmul.mode() == "auto" and bf16_matmul.serving_mode() == "gemv"
    for explicit in ("native", "fp32", "gemv"):
        monkeypatch.setenv("PASK_BF16_MATMUL", explicit)
        assert bf16_matmul.serving_mode() == explicit
    monkeypatch.setenv("PASK_BF16_MATMUL", "fast")
    with pytest.raises(PaskError, match="PASK_BF16_MATMUL must be one of"):
        bf16_matmul.serving_mode()


def test_bench_names_what_computed_the_decode_linears(monkeypatch):
    from pask.bench.serving import decode_linears

    model = _mlp()
    assert decode_linears(model) == "PyTorch"
    monkeypatch.setattr(bf16_matmul, "cpu_has_bf16", lambda cpuinfo=None: True)
    model.pask_bf16_gemv_linears = bf16_matmul.apply_gemv(model, "gemv")
    if native_gemv.has_bf16_io():
        assert decode_linears(model) == f"native bf16 GEMV ({native_gemv.isa()}, 2 layers)"
        x = torch.randn(3, 64).to(torch.bfloat16)
        assert _close_to_fp32_product(model[0](x), x, model[0])
    else:
        assert decode_linears(model) == "PyTorch"


def test_tiny_model_in_bf16_decodes_the_same_tokens_with_fp32_products(smol):
    """smollm2 in bf16: greedy tokens of a prompt agree with and without the fp32 products."""
    from pask.runtime.models import load_model

    tok = smol.tokenizer
    ids = tok("def fibonacci(n):\n    " * 6, return_tensors="pt")["input_ids"]
    assert ids.shape[1] >= bf16_matmul.MIN_ROWS
    runs = []
    for how in ("native", "fp32"):
        lm = load_model("smollm2-135m", dtype=torch.bfloat16)
        if how == "native":
            for mod in lm.model.modules():  # undo what load_model did on a CPU without BF16 arithmetic
                mod.__dict__.pop("forward", None)
        else:
            bf16_matmul.apply(lm.model, "fp32")
        with torch.inference_mode():
            out = lm.model.generate(ids, max_new_tokens=8, do_sample=False)
        runs.append(out[0, ids.shape[1] :].tolist())
    assert runs[0][:4] == runs[1][:4], runs


# -- bounded GEMM shapes -----------------------------------------------------------------------------
@given(st.integers(0, 1 << 20))
def test_row_buckets_round_up_a_little_to_few_counts(m):
    r = bf16_matmul.row_bucket(m)
    assert m <= r <= max(m + 15, m + m // 8) and bf16_matmul.row_bucket(r) == r
    if m >= 16:  # at most ROW_BUCKETS counts between m and 2m
        counts = {bf16_matmul.row_bucket(k) for k in range(m, 2 * m, max(m // 64, 1))}
        assert len(counts) <= bf16_matmul.ROW_BUCKETS + 1


def test_bounded_linear_equals_linear_over_few_shapes(monkeypatch):
    """Prefill-sized bf16 inputs run over bucketed row counts (zero rows appended, output cut back):
    the same values as one F.linear, and 200 prompt lengths give the GEMM only a few shapes
    (PyTorch's bf16 GEMM keeps memory per shape)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=gen).to(torch.bfloat16)
    b = torch.randn(48, generator=gen).to(torch.bfloat16)
    x = torch.randn(1, 137, 40, generator=gen).to(torch.bfloat16)
    got = bf16_matmul.bounded_linear(x, w, b)
    assert got.shape == (1, 137, 48)
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), b.float()), rtol=2e-2, atol=2e-2)
    seen = set()
    real = F.linear
    monkeypatch.setattr(bf16_matmul.F, "linear", lambda a, *r: seen.add(tuple(a.shape)) or real(a, *r))
    for t in range(100, 300):
        bf16_matmul.bounded_linear(torch.zeros(1, t, 40, dtype=torch.bfloat16), w, None)
    assert len(seen) <= 2 * bf16_matmul.ROW_BUCKETS + 1  # 100..299 spans two doublings


def test_prefill_inputs_of_gemv_mode_linears_take_the_bounded_gemm(monkeypatch):
    if not (bf16_matmul.cpu_has_bf16() and native_gemv.has_bf16_io()):
        pytest.skip("gemv mode needs a CPU with BF16 arithmetic and the native GEMV")
    lin = torch.nn.Linear(40, 24).to(torch.bfloat16)
    assert bf16_matmul.apply_gemv(lin, "gemv") == 1
    calls = []
    real = bf16_matmul.bounded_linear
    monkeypatch.setattr(bf16_matmul, "bounded_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.randn(1, 70, 40).to(torch.bfloat16)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    lin(torch.randn(1, 3, 40).to(torch.bfloat16))  # decode-sized: the native GEMV
    assert calls == [(1, 70, 40)]
