"""The native bf16 RMSNorm: the same bits as transformers' RMSNorm, module swap, fallbacks and bad inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from pask.cpu import native_norm as nn_
from pask.cpu.native import NativeKernelError


@pytest.fixture(autouse=True)
def _native_ok():
    if nn_.status() != "ok":
        pytest.skip(f"native RMSNorm: {nn_.status()}")


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 70),  # 64+ rows take the OpenMP path
    n=st.integers(1, 2100),
    scale=st.sampled_from([1e-3, 1.0, 40.0, 3e3]),
    eps=st.sampled_from([1e-6, 1e-5]),
    seed=st.integers(0, 2**16),
)
@example(rows=8, n=896, scale=1.0, eps=1e-6, seed=0)  # qwen2.5-coder-0.5b at batch 8
@example(rows=1, n=8960, scale=40.0, eps=1e-6, seed=1)  # three cascade levels of PyTorch's sum
def test_same_bits_as_the_pytorch_formula(rows, n, scale, eps, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=gen) * torch.rand(rows, 1, generator=gen) * scale).bfloat16()
    w = (torch.randn(n, generator=gen) * 0.7 + 1).bfloat16()
    got = nn_.rms_norm(x, w, eps)
    want = nn_.reference(x, w, eps)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} values differ"


def test_zero_rows_and_the_transformers_modules():
    torch.manual_seed(0)
    for cls in (Qwen2RMSNorm, LlamaRMSNorm):
        m = cls(896, eps=1e-6).bfloat16()
        m.weight.data = torch.randn(896).bfloat16()
        x = torch.randn(2, 3, 896).bfloat16()
        x[1, 2] = 0  # variance 0: rsqrt(eps)
        native = nn_.NativeRMSNorm.from_module(m)
        assert native.weight is m.weight and native.variance_epsilon == m.variance_epsilon
        assert torch.equal(native(x), m(x))


def test_other_inputs_take_the_pytorch_formula():
    m = Qwen2RMSNorm(64).bfloat16()
    native = nn_.NativeRMSNorm.from_module(m)
    x = torch.randn(4, 128).bfloat16()[:, ::2]  # not contiguous
    assert not nn_.applies(x, m.weight) and torch.equal(native(x), m(x))
    xf = torch.randn(3, 64)
    assert not nn_.applies(xf, m.weight) and torch.equal(native(xf), m(xf))
    assert not nn_.applies(torch.randn(3, 32).bfloat16(), m.weight)  # wrong row length
    with pytest.raises(RuntimeError):  # as PyTorch's broadcast would
        native(torch.randn(3, 32).bfloat16())


def _model(dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(dtype).eval()


def test_apply_swaps_a_bf16_model_and_keeps_its_logits(monkeypatch):
    model = _model(torch.bfloat16)
    for m in model.modules():  # non-trivial norm weights
        if isinstance(m, Qwen2RMSNorm):
            m.weight.data = (torch.randn_like(m.weight, dtype=torch.float32) * 0.3 + 1).bfloat16()
    ids = torch.randint(0, 64, (2, 9))
    want = model(ids).logits
    monkeypatch.setenv("PASK_NATIVE_NORM", "0")
    assert nn_.apply(model) == 0
    monkeypatch.delenv("PASK_NATIVE_NORM")
    assert nn_.apply(model) == 2 * 2 + 1
    assert not any(isinstance(m, Qwen2RMSNorm) for m in model.modules())
    assert torch.equal(model(ids).logits, want)
    assert nn_.apply(model) == 0  # nothing left to swap


def test_apply_leaves_fp32_models_and_native_off(monkeypatch):
    assert nn_.apply(_model(torch.float32)) == 0
    monkeypatch.setenv("PASK_NATIVE", "0")
    assert nn_.apply(_model(torch.bfloat16)) == 0


def test_a_kernel_that_cannot_be_built_is_an_error_not_a_silent_fallback(monkeypatch, tmp_path):
    monkeypatch.setattr(nn_._PROBE, "state", None)
    monkeypatch.setattr(nn_, "_LIB", None)
    monkeypatch.setattr(nn_, "_VEC", nn_._VEC)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PASK_CACHE", str(tmp_path))
    monkeypatch.delenv("PASK_ALLOW_FALLBACK", raising=False)
    x, w = torch.ones(2, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(NativeKernelError, match=r"RMSNorm.*no C\+\+ compiler.*PASK_NATIVE=0"):
        nn_.rms_norm(x, w, 1e-6)
    with pytest.raises(NativeKernelError):
        nn_.apply(_model(torch.bfloat16))
    monkeypatch.setenv("PASK_ALLOW_FALLBACK", "1")
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        assert torch.equal(nn_.rms_norm(x, w, 1e-6), nn_.reference(x, w, 1e-6))
    assert nn_.apply(_model(torch.bfloat16)) == 0
    monkeypatch.setattr(nn_._PROBE, "state", None)  # probe again for the other tests


def test_a_probe_that_finds_no_matching_order_reports_it(monkeypatch):
    monkeypatch.setattr(nn_._PROBE, "state", None)
    monkeypatch.setattr(nn_, "_LIB", nn_._LIB)  # restored afterwards: the failed probe clears it
    monkeypatch.setattr(nn_, "_VEC", nn_._VEC)
    monkeypatch.setattr(nn_, "reference", lambda x, w, eps: w * x)  # a "PyTorch" whose norm differs
    assert nn_.status().startswith("probe mismatch")
    monkeypatch.setattr(nn_._PROBE, "state", None)
