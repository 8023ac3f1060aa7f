"""The AVX2 build's integer path for the INT4 tier (int8 query rows, u8 value weights, pmaddubsw).

Its numerics are not FP32-level: what these tests bound is its error against the exact kernel, as a
share of the error the INT4 tier itself makes against unquantised attention."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pask.kv import native_attention as na
from tests.test_native_attention import _layer, _reference


@pytest.fixture(scope="module")
def int8():
    if na.status() != "ok":
        pytest.skip(f"native attention kernel: {na.status()}")
    with na.int8_path(True) as on:
        if not on:
            pytest.skip(f"no integer INT4 path in the {na.isa()} build")
    return na


def _both(layer, q, d):
    """fp32 outputs of the exact kernel and of the integer path, with the switch restored."""
    with na.int8_path(False):
        exact = na.decode_layer(layer, q, d**-0.5, fp32=True)
    with na.int8_path(True) as on:
        assert on
        fast = na.decode_layer(layer, q, d**-0.5, fp32=True)
    return exact[:, 0], fast[:, 0]


def test_switch_reports_what_runs():
    """Only the AVX2 build can turn it on; off always works; isa() says which runs."""
    if na.status() != "ok":
        pytest.skip(f"native attention kernel: {na.status()}")
    before = na.use_int8()
    with na.int8_path(before):  # the switch turned below, restored after
        assert na.use_int8(False) is False and na.use_int8() is False
        base = na.isa()
        assert na.use_int8(True) is (base == "avx2")
        assert na.isa() == (base + "+int8" if base == "avx2" else base)  # what provenance records
        assert na.use_int8(False) is False and na.isa() == base
    assert na.use_int8() is before


def test_int8_path_restores_the_switch_even_after_an_error():
    if na.status() != "ok":
        pytest.skip(f"native attention kernel: {na.status()}")
    before = na.use_int8()
    with pytest.raises(RuntimeError, match="inside"), na.int8_path(not before) as on:
        assert on is na.use_int8()
        raise RuntimeError("inside")
    assert na.use_int8() is before
    with na.int8_path(False) as on:
        assert on is False and not na.isa().endswith("+int8")


@pytest.mark.parametrize("env", [None, "0", "1"])
def test_default_is_the_integer_path_on_the_avx2_build(env):
    """A fresh process: on unless PASK_INT8_ATTENTION=0 on the AVX2 build; off on every other build."""
    if na.status() != "ok":
        pytest.skip(f"native attention kernel: {na.status()}")
    base = na.isa().removesuffix("+int8")
    environ = {k: v for k, v in os.environ.items() if k != "PASK_INT8_ATTENTION"}
    if env is not None:
        environ["PASK_INT8_ATTENTION"] = env
    code = "from pask.kv import native_attention as na; print(na.use_int8(), na.isa())"
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True)
    on = base == "avx2" and env != "0"
    assert out.stdout.split() == [str(on), base + "+int8" if on else base]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=st.sampled_from([(2, 7, 64), (2, 6, 128), (1, 1, 64), (1, 8, 64), (3, 3, 128)]),
    lengths=st.lists(st.integers(1, 700), min_size=1, max_size=3),
    mix=st.sampled_from([(0.05, 0.9, 0.05), (0.34, 0.33, 0.33), (0.0, 1.0, 0.0), (0.2, 0.4, 0.3, 0.1)]),
    k4v2=st.booleans(),
    seed=st.integers(0, 2**16),
    q_scale=st.sampled_from([0.0, 1.0, 2.0, 6.0]),
)
@example(shape=(2, 7, 64), lengths=[64], mix=(0.0, 1.0, 0.0), k4v2=False, seed=0, q_scale=1.0)  # one whole block
@example(shape=(2, 7, 64), lengths=[5], mix=(0.0, 1.0, 0.0), k4v2=False, seed=1, q_scale=1.0)  # one INT4 slot
def test_error_is_small_beside_the_int4_error(int8, shape, lengths, mix, k4v2, seed, q_scale):
    """Against the exact kernel: within 5 % of the largest output, and its rms under 15 % of the rms
    error the quantised tiers make against the unquantised K / V (measured: 5-9 % at query scales 1-5,
    random K / V, 8k slots: adding it moves the total error by under 1 %)."""
    hkv, grp, d = shape
    _, layer = _layer(hkv, grp, d, lengths, [mix] * len(lengths), seed=seed, l2_key_bits=4 if k4v2 else 2)
    q = (torch.randn(len(lengths), hkv * grp, 1, d, generator=torch.Generator().manual_seed(seed)) * q_scale).to(
        torch.bfloat16
    )
    exact, fast = _both(layer, q, d)
    assert torch.isfinite(fast).all()
    want = _reference(layer, q.float(), d**-0.5)
    assert float((exact - want).abs().max()) <= 1e-3 * max(1e-3, float(want.abs().max()))  # the exact kernel
    scale = max(1e-3, float(exact.abs().max()))
    err = (fast - exact).abs()
    assert float(err.max()) <= 0.05 * scale, float(err.max()) / scale
    if q_scale == 0.0:
        # a zero query scores exactly (qstep 0): what is left is the u8 value weights' rounding
        assert float(err.max()) <= 1e-2 * scale, float(err.max()) / scale
    # the quantised tiers' own error: the same cache with every slot kept in BF16
    _, full_layer = _layer(hkv, grp, d, lengths, [(1.0, 0.0, 0.0)] * len(lengths), seed=seed)
    unq = _reference(full_layer, q.float(), d**-0.5)
    tier_err = float((exact - unq).pow(2).mean().sqrt())
    if tier_err > 1e-3 * scale:  # mostly H draws: the tiers barely err, bound by the max only
        assert float(err.pow(2).mean().sqrt()) <= 0.15 * tier_err


def test_partial_and_stale_block_slots_get_no_weight(int8):
    """A block's slots past the live count hold stale codes: the integer path must weigh them 0, as
    the exact one does (a live count of 65 leaves 63 stale slots in the second block). Poisoning
    them with large finite codes, scales and zeros changes no output bit."""
    _, layer = _layer(2, 7, 64, [65 + 4], [(0.0, 1.0, 0.0)], seed=5)
    low = layer.seqs[0].low(4)
    n = int(low.n)
    assert n == 65 and low.cap >= 128
    q = torch.randn(1, 14, 1, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    exact, before = _both(layer, q, 64)
    assert float((before - exact).abs().max()) <= 0.05 * float(exact.abs().max())
    low.t["vq"][:, :, n:] = 0xFF
    live = low.t["kq"][:, 1, :, 0] & 0x0F  # block 1: slot 64 is the low nibble of each row's byte 0
    low.t["kq"][:, 1:] = 0xFF
    low.t["kq"][:, 1, :, 0] = live | 0xF0  # (its high nibble is stale slot 96)
    for name in ("vs", "vz"):
        low.t[name][:, :, n:] = 1e4
    low.t["ksz"][:, :, n:] = 1e4
    _, after = _both(layer, q, 64)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_one_dominant_slot_is_read_to_the_values_precision(int8):
    """Scores in the hundreds put nearly all the weight on one slot: the u8 weights of the others
    round to 0, and the output is that slot's dequantised value to a few parts in a thousand."""
    _, layer = _layer(1, 1, 64, [300], [(0.0, 1.0, 0.0)], seed=7, key_scale=30.0)
    q = (torch.randn(1, 1, 1, 64, generator=torch.Generator().manual_seed(7)) * 4).to(torch.bfloat16)
    exact, fast = _both(layer, q, 64)
    assert float((fast - exact).abs().max()) <= 0.02 * float(exact.abs().max())


def test_batch_rows_are_independent(int8):
    """A row's output does not depend on the other rows of the call (per-row quantisation scales)."""
    _, layer = _layer(2, 7, 64, [400, 150, 700], [(0.05, 0.9, 0.05)] * 3, seed=9)
    q = torch.randn(3, 14, 1, 64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    _, fast = _both(layer, q, 64)
    q2 = q.clone()
    q2[0] *= 3  # another row's query changes
    _, fast2 = _both(layer, q2, 64)
    torch.testing.assert_close(fast2[1:], fast[1:], rtol=0, atol=0)


def test_step_weights_on_the_integer_path(int8):
    """Ranking policies read the step's softmax weights: on the integer path they still sum to one
    per kv head, follow its (int8-query) scores, stay near the exact path's, and the output is the
    plain call's."""
    _, layer = _layer(2, 7, 64, [300, 90], [(0.2, 0.7, 0.1)] * 2, seed=11)
    q = torch.randn(2, 14, 1, 64, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    with na.int8_path(False):
        _, exact = na.decode_layer(layer, q, 64**-0.5, weights=True)
    with na.int8_path(True):
        out, probs = na.decode_layer(layer, q, 64**-0.5, weights=True)
        assert torch.equal(out, na.decode_layer(layer, q, 64**-0.5))
    for p, e in zip(probs, exact, strict=True):
        assert p.shape == e.shape
        torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[0]), atol=1e-3, rtol=0)
        assert float((p - e).abs().max()) <= 0.05 * float(e.abs().max())


@pytest.mark.parametrize("mix", [(0.3, 0.6, 0.1), (1.0, 0.0, 0.0)])
def test_int2_and_bf16_tiers_are_untouched(int8, mix):
    """The switch changes only the INT4 tier (and K4V2's INT4 keys): a cache of BF16 and plain INT2
    slots (MiKV's low tier) decodes bit for bit the same either way."""
    _, layer = _layer(2, 7, 64, [400, 130], [mix] * 2, seed=13, bits=2)
    assert all(s.low(4).n == 0 for s in layer.seqs)
    q = torch.randn(2, 14, 1, 64, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    exact, fast = _both(layer, q, 64)
    assert torch.equal(exact, fast)
