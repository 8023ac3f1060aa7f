"""INT4 and INT2 packing: layout, bytes, round-trip error bound, bad widths."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pask.errors import PaskError
from pask.kv.quant import (
    dequantize_codes,
    dequantize_int4,
    int4_bytes_per_vector,
    lowbit_bytes_per_vector,
    pack_nibbles,
    pack_quads,
    quantize_codes,
    quantize_int4,
    unpack_nibbles,
    unpack_quads,
)


def test_shapes_dtypes_and_bytes():
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    q = quantize_int4(x)
    assert q.packed.shape == (3, 5, 32) and q.packed.dtype == torch.uint8
    assert q.scale.shape == (3, 5, 2) and q.scale.dtype == torch.float16
    assert q.zero.shape == (3, 5, 2) and q.zero.dtype == torch.float16
    assert int4_bytes_per_vector(64, 32) == 40
    assert q.nbytes() / (x.numel() * x.element_size()) == pytest.approx(0.3125)
    assert dequantize_int4(q, torch.bfloat16).dtype == torch.bfloat16


def test_pack_unpack_roundtrip_split_halves():
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert torch.equal(packed[:, 3] & 15, codes[:, 3]) and torch.equal(packed[:, 3] >> 4, codes[:, 35])
    assert torch.equal(unpack_nibbles(packed), codes)


def test_constant_group_is_exact_enough():
    x = torch.full((2, 64), 3.3)
    err = (dequantize_int4(quantize_int4(x)) - x).abs().max()
    assert err < 3.3 * 2**-10


@pytest.mark.parametrize("d,g", [(63, 32), (64, 24), (64, 0)])
def test_bad_group_raises(d, g):
    with pytest.raises(PaskError, match="divisible"):
        quantize_int4(torch.zeros(1, d), group=g)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.sampled_from([(64, 32), (64, 64), (128, 32), (32, 16)]),
    rows=st.integers(1, 6),
    spread=st.sampled_from([1e-6, 1e-2, 1.0, 50.0, 3000.0]),
    offset=st.floats(-100, 100),
    seed=st.integers(0, 2**31 - 1),
)
def test_roundtrip_error_bounded_per_group(shape, rows, spread, offset, seed):
    d, g = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=gen) * spread + offset
    q = quantize_int4(x, group=g)
    err = (x - dequantize_int4(q)).abs().reshape(rows, d // g, g)
    scale, zero = q.scale.float(), q.zero.float()
    eps = 1e-6 * (zero.abs() + 15 * scale) + 1e-12
    assert bool((err <= (scale / 2 + eps)[..., None]).all()), float((err - scale[..., None] / 2).max())


# -- INT2 ----------------------------------------------------------------------------------------
def test_int2_bytes_and_quad_layout():
    assert lowbit_bytes_per_vector(64, 32, 2) == 24  # 16 code bytes + 2 groups x (scale, zero) x 2 bytes
    assert lowbit_bytes_per_vector(64, 32, 4) == int4_bytes_per_vector(64, 32) == 40
    assert lowbit_bytes_per_vector(64, 32, 2) / (64 * 2) == pytest.approx(0.1875)  # of BF16
    codes = torch.randint(0, 4, (5, 64), dtype=torch.uint8)
    packed = pack_quads(codes)
    assert packed.shape == (5, 16)
    assert torch.equal((packed[:, 2] >> 4) & 3, codes[:, 10])  # byte j holds codes 4j..4j+3, low bits first
    assert torch.equal(unpack_quads(packed), codes)


@pytest.mark.parametrize("bits", [0, 1, 3, 8])
def test_bad_code_width_raises(bits):
    if bits != 8:  # 8-bit codes quantise (BellowsKV's INT8 latent), but no K/V tier holds them
        with pytest.raises(PaskError, match="2 or 4 bits"):
            quantize_codes(torch.zeros(1, 64), bits=bits)
    with pytest.raises(PaskError, match="2 or 4 bits"):
        lowbit_bytes_per_vector(64, 32, bits)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.sampled_from([(64, 32), (128, 32), (32, 16)]),
    rows=st.integers(1, 6),
    spread=st.sampled_from([1e-6, 1e-2, 1.0, 50.0, 3000.0]),
    offset=st.floats(-100, 100),
    zero_point=st.sampled_from([0, 2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_int2_roundtrip_error_bounded_per_group(shape, rows, spread, offset, zero_point, seed):
    d, g = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=gen) * spread + offset
    codes, scale, zero = quantize_codes(x, g, zero_point, torch.bfloat16, bits=2)
    assert int(codes.max()) <= 3
    y = dequantize_codes(unpack_quads(pack_quads(codes)), scale, zero, zero_point=zero_point)
    err = (x - y).abs().reshape(rows, d // g, g)
    s, z = scale.float(), zero.float()
    eps = 1e-6 * (z.abs() + 3 * s) + 1e-12
    assert bool((err <= (s / 2 + eps)[..., None]).all()), float((err - s[..., None] / 2).max())
