"""The native rotary embedding: transformers' apply_rotary_pos_emb bit for bit, or not at all."""

from __future__ import annotations

import pytest
import torch
import transformers.models.qwen2.modeling_qwen2 as mq
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pask.cpu import native_rotary as nr
from pask.cpu.native import NativeKernelError
from tests.test_native_norm import _model  # a two-layer Qwen2

ORIGINAL = nr._ORIGINAL.get(mq.__name__, mq.apply_rotary_pos_emb)  # transformers' own function


@pytest.fixture(autouse=True)
def _native_ok():
    if nr.status() != "ok":
        pytest.skip(f"native rotary: {nr.status()}")


def _inputs(b, hq, hk, s, d, shared, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, s, hq, d, generator=gen) * scale).to(torch.bfloat16).transpose(1, 2)  # as the model's views
    k = (torch.randn(b, s, hk, d, generator=gen) * scale).to(torch.bfloat16).transpose(1, 2)
    ang = torch.rand(1 if shared else b, s, d, generator=gen) * 1000
    return q, k, ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 17),
    hq=st.integers(1, 16),
    hk=st.integers(1, 4),
    s=st.integers(1, 9),
    d=st.sampled_from([2, 8, 32, 64, 128]),
    shared=st.booleans(),
    scale=st.sampled_from([1e-3, 1.0, 300.0, 3e38]),  # 3e38: products overflow to inf as PyTorch's do
    seed=st.integers(0, 2**16),
)
@example(b=8, hq=14, hk=2, s=1, d=64, shared=False, scale=1.0, seed=0)  # qwen2.5-coder-0.5b at batch 8
def test_same_bits_as_transformers(b, hq, hk, s, d, shared, scale, seed):
    q, k, cos, sin = _inputs(b, hq, hk, s, d, shared, scale, seed)
    assert nr.applies(q, k, cos, sin)
    got, want = nr._call(q, k, cos, sin), ORIGINAL(q, k, cos, sin)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        _same(g, w)


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same bits, except a NaN's payload (PyTorch's vectorised bf16 conversion writes 0xFFFF for
    a NaN, its scalar one 0x7FC0, as the kernel does): NaN where PyTorch has NaN."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_nan_and_infinity_keep_pytorchs_bits():
    q, k, cos, sin = _inputs(2, 3, 1, 2, 8, False, 1.0, 1)
    q[0, 0, 0, 0], q[1, 2, 1, 5], k[0, 0, 1, 3] = float("nan"), float("inf"), float("-inf")
    got = nr._call(q, k, cos, sin)
    for g, w in zip(got, ORIGINAL(q, k, cos, sin), strict=True):
        _same(g, w)
    assert bool(torch.isnan(got[0]).any()) and bool(torch.isinf(got[1]).any())


def test_other_inputs_take_the_replaced_function():
    q, k, cos, sin = _inputs(2, 4, 2, 3, 16, False, 1.0, 2)
    rotary = nr._rotary_for(ORIGINAL)
    assert not nr.applies(q.float(), k.float(), cos.float(), sin.float())
    assert not nr.applies(q, k, cos, sin, unsqueeze_dim=2)
    assert not nr.applies(q[..., :15], k[..., :15], cos[..., :15], sin[..., :15])  # odd D
    assert not nr.applies(q, k, cos.transpose(1, 2).contiguous().transpose(1, 2), sin)  # cos not contiguous
    assert not nr.applies(q, k[:1], cos, sin)  # batch sizes differ
    assert not nr.applies(q.transpose(2, 3), k.transpose(2, 3), cos, sin)  # last dim not contiguous
    for args in ((q.float(), k.float(), cos.float(), sin.float()), (q, k, cos[:, :2], sin[:, :2], 1)):
        try:
            want = ORIGINAL(*args)
        except RuntimeError:  # a shape PyTorch refuses is refused the same way
            with pytest.raises(RuntimeError):
                rotary(*args)
            continue
        for g, w in zip(rotary(*args), want, strict=True):
            assert torch.equal(g, w)


def test_install_keeps_a_models_logits_and_is_undone_by_uninstall(monkeypatch):
    was = dict(nr._ORIGINAL)
    nr.uninstall()
    try:
        assert mq.apply_rotary_pos_emb is ORIGINAL
        model = _model(torch.bfloat16)
        ids = torch.randint(0, 64, (3, 11))
        want = model(ids).logits
        monkeypatch.setenv("PASK_NATIVE_ROTARY", "0")
        assert nr.install() == 0 and mq.apply_rotary_pos_emb is ORIGINAL
        monkeypatch.delenv("PASK_NATIVE_ROTARY")
        assert nr.install() == 2 and getattr(mq.apply_rotary_pos_emb, "pask_native_rotary", False)
        patched = mq.apply_rotary_pos_emb
        assert nr.install() == 2 and mq.apply_rotary_pos_emb is patched  # once per module
        assert torch.equal(model(ids).logits, want)
        assert torch.equal(_model(torch.float32)(ids).logits, _model(torch.float32)(ids).logits)
        nr.uninstall()
        assert mq.apply_rotary_pos_emb is ORIGINAL
    finally:
        nr.uninstall()
        if was:
            nr.install()


def test_a_kernel_that_cannot_be_built_is_an_error_not_a_silent_fallback(monkeypatch, tmp_path):
    was = dict(nr._ORIGINAL)
    nr.uninstall()
    monkeypatch.setattr(nr._PROBE, "state", None)
    monkeypatch.setattr(nr, "_LIB", None)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PASK_CACHE", str(tmp_path))
    monkeypatch.delenv("PASK_ALLOW_FALLBACK", raising=False)
    try:
        with pytest.raises(NativeKernelError, match=r"rotary.*no C\+\+ compiler.*PASK_NATIVE=0"):
            nr.install()
        monkeypatch.setenv("PASK_ALLOW_FALLBACK", "1")
        with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
            assert nr.install() == 0
        assert mq.apply_rotary_pos_emb is ORIGINAL
    finally:
        monkeypatch.setattr(nr._PROBE, "state", None)  # probe again for the other tests
        monkeypatch.undo()
        nr.uninstall()
        if was:
            nr.install()


def test_a_probe_that_differs_from_pytorch_reports_it(monkeypatch):
    monkeypatch.setattr(nr._PROBE, "state", None)
    monkeypatch.setattr(nr, "_LIB", nr._LIB)  # restored afterwards: the failed probe clears it
    monkeypatch.setattr(nr, "reference", lambda q, k, cos, sin: (q * cos.unsqueeze(1), k * cos.unsqueeze(1)))
    assert nr.status().startswith("probe mismatch")
    monkeypatch.setattr(nr._PROBE, "state", None)
