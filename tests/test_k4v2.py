"""K4V2: the L2 action with INT4 keys and INT2 values (``CacheConfig.l2_key_bits = 4``).

Exactness in fp32 against the two existing tiers (its keys are the INT4 tier's keys, its values the
INT2 tier's values, bit for bit), bytes and cost model, the table / policy / decode-core route that
builds a K4V2 cache for a K4V2 table, and bad inputs.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from pask.errors import PaskError
from pask.kv import Action, CacheConfig, CostModel, KVCacheError, TieredCache
from pask.kv.cache import attention_config
from pask.policies.base import with_key_bits
from pask.policies.full import FullPolicy
from pask.policies.pask import PaskPolicy
from pask.policies.table import FrozenTable

HKV, GRP, D = 2, 3, 64


def _cache(l2_key_bits: int, k, v, window: int = 4) -> TieredCache:
    cfg = CacheConfig(num_groups=1, recent_window=window, l2_key_bits=l2_key_bits, native=False)
    cache = TieredCache(attention_config(HKV, GRP, D), cfg, 1)
    cache.update(k, v, 0)
    return cache


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([1e-2, 1.0, 30.0]), n=st.integers(12, 200))
def test_k4v2_keys_are_the_int4_keys_and_values_the_int2_values(seed, scale, n):
    """The same positions moved to L (INT4), to L2 (INT2) and to L2 on a K4V2 cache: K4V2's dequantised
    keys equal INT4's and its values equal INT2's exactly (fp32; same balance, same quantiser)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(1, HKV, n, D, generator=gen) * scale
    v = torch.randn(1, HKV, n, D, generator=gen) * scale
    pos = torch.arange(n - 4)
    got = {}
    for name, kb, act in (("int4", 2, Action.L), ("int2", 2, Action.L2), ("k4v2", 4, Action.L2)):
        cache = _cache(kb, k, v)
        cache.apply(0, 0, pos, act)
        st_ = cache.layers[0].seqs[0]
        got[name] = st_.low_kv(bits=4 if act == Action.L else 2)
    assert torch.equal(got["k4v2"][0], got["int4"][0])
    assert torch.equal(got["k4v2"][1], got["int2"][1])
    assert not torch.equal(got["k4v2"][0], got["int2"][0])  # (the two key widths do differ)


def test_k4v2_bytes_and_cost_model():
    """An L2 slot holds an INT4 key (32 + 8 bytes at D 64) and an INT2 value (16 + 8) per kv head; the
    measured B of an all-L2 prompt is the cost model's 0.25 (bf16), against 0.1875 for INT2."""
    n = 260
    k = torch.randn(1, HKV, n, D).to(torch.bfloat16)
    v = torch.randn(1, HKV, n, D).to(torch.bfloat16)
    ratio = {}
    for kb in (2, 4):
        cache = _cache(kb, k, v, window=0)
        cache.apply(0, 0, torch.arange(n), Action.L2)
        store = cache.layers[0].seqs[0]
        assert store.l2.slot_bytes() == HKV * ((D * kb // 8 + 8) + (D * 2 // 8 + 8))
        held, full = cache.budget_bytes()
        balance = store.balance_bytes()
        ratio[kb] = (sum(held) - balance) / sum(full)
        assert ratio[kb] == pytest.approx(CostModel(D, 32, torch.bfloat16, kb).l2_ratio)
    assert ratio == {2: 0.1875, 4: 0.25}


def test_bad_key_widths_are_refused():
    with pytest.raises(KVCacheError, match="l2_key_bits"):
        CacheConfig(l2_key_bits=3)
    with pytest.raises(PaskError, match="l2_key_bits"):
        FrozenTable({}, "fp", l2_key_bits=8)


def test_table_round_trip_and_old_tables(tmp_path):
    t = FrozenTable({}, "fp", l2_key_bits=4, default_action="L2")
    path = t.save(tmp_path / "t.json")
    assert FrozenTable.from_json(json.loads(path.read_text())).l2_key_bits == 4
    old = json.loads(path.read_text())
    del old["l2_key_bits"]  # a table written before K4V2: INT2 keys
    assert FrozenTable.from_json(old).l2_key_bits == 2


def test_the_decode_core_builds_the_cache_the_policy_needs():
    cfg = CacheConfig()
    k4 = PaskPolicy(FrozenTable({}, "fp", l2_key_bits=4))
    assert with_key_bits(cfg, k4).l2_key_bits == 4
    assert with_key_bits(CacheConfig(l2_key_bits=4), PaskPolicy(FrozenTable({}, "fp"))).l2_key_bits == 2
    assert with_key_bits(cfg, FullPolicy()) is cfg  # no requirement: the given config


def test_a_k4v2_table_decodes_on_a_k4v2_cache(smol):
    """End to end on the tiny model: every prompt token L2 under a K4V2 table lands in an L2 tier with
    INT4 keys, and the scheduler's cost model prices it as K4V2 (0.25 of BF16, 0.125 of the fp32 test
    model's full-precision bytes)."""
    from pask.runtime.runner import decode_with_policy

    fp = smol.fingerprint
    seen = {}

    class Probe(PaskPolicy):
        def prefill_actions(self, ctx):
            seen["int2_cost"] = ctx.int2_cost
            return [(g, ctx.leaving, Action.L2) for g in range(ctx.num_groups)]

    pol = Probe(FrozenTable({}, fp, l2_key_bits=4))
    res = decode_with_policy(smol.model, [list(range(20, 60))], pol, 3)
    assert seen["int2_cost"] == pytest.approx(CostModel(64, 32, torch.float32, 4).l2_ratio) == pytest.approx(0.125)
    assert res is not None


def test_cli_refuses_a_bad_key_width():
    from pask.cli import app

    r = CliRunner().invoke(app, ["calibrate", "--model", "smollm2-135m", "--l2-key-bits", "3"])
    assert r.exit_code == 2 and "--l2-key-bits must be 2 or 4" in r.output
