"""KVFetch's cold tier in the cache: demote / fetch / unfetch, bytes, errors, and that attention
never reads a cold token unless it is fetched (fp32, no model)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from pask.kv import Action, CacheConfig, TieredCache
from pask.kv.actions import ColdOp
from pask.kv.attention import tiered_attention_reference
from pask.kv.errors import KVCacheError, ProtectedTokenError

HQ, HKV, D = 4, 2, 64


def tiny_config(layers: int = 2) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=HQ * D,
        num_attention_heads=HQ,
        num_key_value_heads=HKV,
        head_dim=D,
        num_hidden_layers=layers,
        intermediate_size=64,
        vocab_size=64,
    )


def filled(n: int, layers: int = 2, cold_bits: int = 2, seed: int = 0):
    """A cache of one group holding random K/V for ``n`` positions in every layer."""
    g = torch.Generator().manual_seed(seed)
    cfg = CacheConfig(num_groups=1, recent_window=8, cold_bits=cold_bits)
    cache = TieredCache(tiny_config(layers), cfg, 1)
    kv = []
    for layer in range(layers):
        k, v = torch.randn(HKV, n, D, generator=g) * 2, torch.randn(HKV, n, D, generator=g)
        cache.update(k[None], v[None], layer)
        kv.append((k, v))
    return cache, kv


def attend(cache: TieredCache, layer: int = 0, seed: int = 5) -> torch.Tensor:
    q = torch.randn(HQ, 1, D, generator=torch.Generator().manual_seed(seed))
    return tiered_attention_reference(q, cache.layers[layer].seqs[0], 0.125)


def test_demote_is_release_for_attention_and_keeps_a_cold_copy():
    cache, _ = filled(200)
    ref, _ = filled(200)
    pos = torch.arange(20, 90)
    cache.recall(0, 0, pos, ColdOp.DEMOTE)
    ref.apply(0, 0, pos, Action.R)
    assert torch.equal(cache.tiers(0, 0), ref.tiers(0, 0))
    for layer in range(2):  # the cold tier never enters attention
        assert torch.equal(attend(cache, layer), attend(ref, layer))
    st = cache.layers[0].seqs[0]
    assert st.cold is not None and st.cold.n == 70
    # the cold tier's bytes are held and counted in B; released tokens hold none
    held, _ = cache.budget_bytes()
    held_ref, _ = ref.budget_bytes()
    cold = sum(layer.seqs[0].cold.live_bytes() + layer.seqs[0].balance_bytes() for layer in cache.layers)
    assert sum(held) - sum(held_ref) == cold > 0  # the codes and scales, and the key balance they use


@pytest.mark.parametrize("bits", [2, 4])
def test_fetch_brings_back_exactly_the_demoted_values_dequantised(bits):
    cache, kv = filled(160, cold_bits=bits)
    pos = torch.arange(10, 60)
    cache.recall(0, 0, pos, ColdOp.DEMOTE)
    fetch = torch.tensor([30, 31, 32, 33])
    cache.recall(0, 0, fetch, ColdOp.FETCH)
    tiers = cache.tiers(0, 0)
    assert (tiers[fetch] == int(Action.H)).all()
    assert int((tiers == int(Action.R)).sum()) == 46
    ix = cache.index(0, 0)
    assert ix.fetched == {30, 31, 32, 33}
    for layer, (k, v) in enumerate(kv):
        st = cache.layers[layer].seqs[0]
        slots = ix.slot_of.t[fetch].long()
        got = st.h.take(slots)
        kd, vd = st.low_kv(slots=ix.cold_slot.t[fetch].long(), cold=True)
        assert torch.equal(got["k"], kd) and torch.equal(got["v"], vd)
        tol = 0.6 if bits == 2 else 0.15  # quantisation error, relative to the values' spread
        assert (got["k"] - k[:, fetch]).abs().max() < tol * k.abs().max()
        assert (got["v"] - v[:, fetch]).abs().max() < tol * v.abs().max()
    # unfetch: released again, the cold copy stays and can be fetched again
    before = cache.layers[0].seqs[0].cold.n
    cache.recall(0, 0, fetch, ColdOp.UNFETCH)
    assert (cache.tiers(0, 0)[fetch] == int(Action.R)).all() and not cache.index(0, 0).fetched
    assert cache.layers[0].seqs[0].cold.n == before
    cache.recall(0, 0, fetch[:2], ColdOp.FETCH)
    assert cache.index(0, 0).fetched == {30, 31}


def test_attention_reads_a_cold_token_only_while_fetched():
    cache, _ = filled(120)
    cache.recall(0, 0, torch.arange(0, 100), ColdOp.DEMOTE)
    dormant = attend(cache)
    cache.recall(0, 0, torch.arange(40, 48), ColdOp.FETCH)
    active = attend(cache)
    assert not torch.allclose(dormant, active)
    cache.recall(0, 0, torch.arange(40, 48), ColdOp.UNFETCH)
    assert torch.allclose(attend(cache), dormant, atol=1e-6)


def test_demote_from_low_tiers_and_bytes_counts():
    cache, _ = filled(100)
    cache.apply(0, 0, torch.arange(0, 30), Action.L)
    cache.apply(0, 0, torch.arange(30, 50), Action.L2)
    cache.recall(0, 0, torch.arange(10, 40), ColdOp.DEMOTE)
    ix = cache.index(0, 0)
    assert ix.cold_n == 30 and ix.cold_counts == [30, 0]
    assert ix.counts[int(Action.R)] == [30, 0]
    assert ix.n[int(Action.L)] == 10 and ix.n[int(Action.L2)] == 10
    cache.recall(0, 0, torch.tensor([12, 35]), ColdOp.FETCH)
    assert ix.counts[int(Action.R)] == [28, 0] and ix.counts[int(Action.H)] == [52, 0]


def test_cold_operations_refuse_bad_input():
    cache, _ = filled(100)
    with pytest.raises(ProtectedTokenError):
        cache.recall(0, 0, torch.tensor([95]), ColdOp.DEMOTE)
    cache.apply(0, 0, torch.tensor([3]), Action.R)
    with pytest.raises(KVCacheError, match="already released"):
        cache.recall(0, 0, torch.tensor([3]), ColdOp.DEMOTE)
    with pytest.raises(KVCacheError, match="not in the cold tier"):
        cache.recall(0, 0, torch.tensor([3]), ColdOp.FETCH)  # released without a cold copy
    with pytest.raises(KVCacheError, match="not in the cold tier"):
        cache.recall(0, 0, torch.tensor([4]), ColdOp.FETCH)  # still held
    cache.recall(0, 0, torch.tensor([5, 6]), ColdOp.DEMOTE)
    with pytest.raises(KVCacheError, match="were not fetched"):
        cache.recall(0, 0, torch.tensor([5]), ColdOp.UNFETCH)
    cache.recall(0, 0, torch.tensor([5]), ColdOp.FETCH)
    with pytest.raises(KVCacheError, match="cold copy"):
        cache.recall(0, 0, torch.tensor([5]), ColdOp.DEMOTE)
    with pytest.raises(KVCacheError, match="only be released"):
        cache.apply(0, 0, torch.tensor([5]), Action.L)
    cache.apply(0, 0, torch.tensor([5]), Action.R)  # a fetched token may be released: it leaves its slot
    assert not cache.index(0, 0).fetched
    with pytest.raises(KVCacheError, match="duplicate"):
        cache.recall(0, 0, torch.tensor([7, 7]), ColdOp.DEMOTE)
    with pytest.raises(KVCacheError, match="unknown"):
        cache.recall(0, 0, torch.tensor([100]), ColdOp.DEMOTE)
    with pytest.raises(KVCacheError, match="cold_bits"):
        CacheConfig(cold_bits=3)
