"""TieredCache storage: appends, actions, errors, compaction, bytes and budget (no model needed)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

from pask.errors import PaskError
from pask.kv import (
    Action,
    AlreadyReleasedError,
    CacheConfig,
    CostModel,
    IrreversibleActionError,
    ProtectedTokenError,
    TieredCache,
    UnknownPositionError,
    UnsupportedModelError,
    layer_groups,
)
from pask.policies import StaticMixPolicy

HKV, D = 2, 64


def tiny_config(layers: int = 4, **kw) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=HKV,
        head_dim=D,
        num_hidden_layers=layers,
        intermediate_size=64,
        vocab_size=32,
        **kw,
    )


def kv_at(positions: torch.Tensor, layer: int, dtype=torch.float32) -> torch.Tensor:
    """Deterministic K (= V + 1) of each position: [HKV, n, D]."""
    base = positions.float()[None, :, None] + 0.01 * torch.arange(D)[None, None, :] + 100 * layer
    return (base + torch.arange(HKV)[:, None, None] * 0.5).to(dtype)


def feed(cache: TieredCache, n: int, rows: int = 1, pads: list[int] | None = None, dtype=torch.float32) -> None:
    """Emulate one forward of ``n`` columns through every layer (``pads`` left pads per row)."""
    pads = pads or [0] * rows
    starts = [cache.seq_length(b) - pads[b] for b in range(rows)]
    for layer in range(len(cache.layers)):
        k = torch.stack([kv_at(torch.arange(s, s + n), layer, dtype) for s in starts])
        cache.update(k, k + 1, layer)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def test_layer_groups():
    assert layer_groups(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert layer_groups(24, 4) == [range(0, 6), range(6, 12), range(12, 18), range(18, 24)]
    with pytest.raises(PaskError):
        layer_groups(3, 4)


def test_lengths_and_ragged_prefill_drop_pads():
    cache = TieredCache(tiny_config(), CacheConfig(), batch_size=2)
    cache.begin_prefill([3, 0])
    feed(cache, 10, rows=2, pads=[3, 0])
    assert [cache.seq_length(0), cache.seq_length(1)] == [7, 10]
    assert [cache.prompt_length(0), cache.prompt_length(1)] == [7, 10]
    assert cache.get_seq_length() == 10
    st0 = cache.layers[2].seqs[0]
    assert st0.h.n == 7
    assert torch.equal(st0.h.view("k"), kv_at(torch.arange(7), 2))  # pads were not stored
    feed(cache, 1, rows=2)
    assert [cache.seq_length(0), cache.seq_length(1)] == [8, 11]
    assert torch.equal(cache.layers[3].seqs[1].h.view("k")[:, -1], kv_at(torch.tensor([10]), 3)[:, 0])


def test_append_is_amortised_linear():
    cache = TieredCache(tiny_config(layers=1), CacheConfig(num_groups=1, initial_capacity=4), batch_size=1)
    n = 3000
    for _ in range(n):
        feed(cache, 1)
    stats = cache.stats
    assert stats.reallocs <= 12  # log2(3000 / 4) + 1 for the single tier
    assert stats.copied_bytes <= 2 * stats.appended_bytes  # doubling: copies < 2x what was appended
    assert cache.layers[0].seqs[0].h.cap == 4096


@pytest.mark.parametrize("headroom", [0, 1, 40])
def test_headroom_first_allocation_spares_decode_copies(headroom):
    cfg = CacheConfig(num_groups=1, initial_capacity=4, headroom=headroom)
    cache = TieredCache(tiny_config(layers=2), cfg, batch_size=1)
    feed(cache, 100)  # prefill: one append of 100 slots per layer
    tier = cache.layers[0].seqs[0].h
    cap = 100 + headroom if headroom else 128  # without headroom: doubling from initial_capacity
    assert tier.cap == cap
    copied = cache.stats.copied_bytes
    for _ in range(cap - 100):
        feed(cache, 1)
    assert cache.stats.copied_bytes == copied  # no decode append reallocated yet
    feed(cache, 1)  # one past the spare slots: the tier doubles as before (copies the row)
    assert cache.stats.copied_bytes > copied and tier.cap == 2 * cap
    assert torch.equal(tier.view("k")[:, -1], kv_at(torch.tensor([cache.seq_length(0) - 1]), 0)[:, 0])


def test_headroom_must_not_be_negative():
    with pytest.raises(PaskError, match="headroom"):
        CacheConfig(headroom=-1)


def _mixed_cache(dtype=torch.float32, n=2000, window=8):
    cfg = CacheConfig(recent_window=window)
    cache = TieredCache(tiny_config(), cfg, batch_size=1)
    feed(cache, n, dtype=dtype)
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mix_third_bytes_match_cost_model_and_memory_drops(dtype):
    n, window = 2000, 8
    cache = _mixed_cache(dtype, n, window)
    full = cache.held_bytes()
    alloc_before = cache.allocated_bytes()
    assert cache.full_bytes() == full
    policy = StaticMixPolicy(1 / 3, 1 / 3, 1 / 3)
    outside = torch.arange(n - window)
    acts = policy.assign(outside)
    for g in range(4):
        for a in (Action.L, Action.R):
            cache.apply(0, g, outside[acts == int(a)], a)
    cm = CostModel(D, 32, dtype)
    predicted = (window + (n - window) * cm.mix_cost(1 / 3, 1 / 3, 1 / 3)) / n
    held = cache.held_bytes()
    assert held / full == pytest.approx(predicted, rel=0.02)
    if dtype == torch.bfloat16:
        assert cm.l_ratio == pytest.approx(0.3125)
    # the storage really shrank: bytes of the tensors the cache owns, not a counter
    alloc_after = cache.allocated_bytes()
    assert alloc_after < 0.6 * alloc_before
    assert alloc_after < 1.6 * held
    cache.compact()
    meta = sum(ix.nbytes() for ix in cache._indices[0])  # position/slot bookkeeping
    l_slot = cache.layers[0].seqs[0].l.slot_bytes()
    assert 0 <= cache.allocated_bytes() - meta - held < 64 * l_slot * len(cache.layers)  # L tier: 64-slot blocks
    b = cache.budget()
    assert b.b_total == pytest.approx(held / full) and b.held_bytes == held and b.full_bytes == full


def test_int4_tier_holds_quantised_original_tokens():
    cache = _mixed_cache(n=300)
    pos = torch.tensor([5, 17, 100, 250])
    cache.apply(0, 1, pos, Action.L)
    for li in cache.groups[1]:
        st = cache.layers[li].seqs[0]
        where = cache.layers[li].positions(0, Action.L)
        assert sorted(where.tolist()) == pos.tolist()
        k, v = st.low_kv()  # bf16 scale/zero: ~ 1/15 of (group range + bf16 ulp of values ~100-400)
        assert torch.allclose(k, kv_at(where.long(), li), atol=0.1)
        assert torch.allclose(v, kv_at(where.long(), li) + 1, atol=0.1)
        # H tier stays exact and consistent with its positions
        hp = cache.layers[li].positions(0, Action.H).long()
        assert torch.equal(st.h.view("k"), kv_at(hp, li))
    assert cache.tiers(0, 1)[pos.long()].tolist() == [1, 1, 1, 1]
    assert cache.tiers(0, 0)[pos.long()].tolist() == [0, 0, 0, 0]


ACTION_OPS = st.lists(
    st.tuples(st.integers(0, 3), st.sets(st.integers(0, 91), max_size=12), st.sampled_from([1, 2])), max_size=12
)


@settings(max_examples=25, deadline=None)
@given(ops=ACTION_OPS)
def test_random_actions_keep_slots_consistent(ops):
    cache = TieredCache(tiny_config(), CacheConfig(initial_capacity=8), batch_size=1)
    feed(cache, 100)
    state = {g: torch.zeros(100, dtype=torch.int8) for g in range(4)}
    for g, positions, a in ops:
        pos = torch.tensor(sorted(positions), dtype=torch.long)
        ok = bool((state[g][pos] != 2).all()) if pos.numel() else True
        if not ok:
            with pytest.raises(AlreadyReleasedError):
                cache.apply(0, g, pos, Action(a))
            continue
        cache.apply(0, g, pos, Action(a))
        if pos.numel():
            cur = state[g][pos]
            state[g][pos] = torch.where((cur == 1) & (a == 1), cur, torch.tensor(a, dtype=torch.int8))
    for g in range(4):
        assert torch.equal(cache.tiers(0, g), state[g])
        for li in cache.groups[g]:
            st_ = cache.layers[li].seqs[0]
            hp = cache.layers[li].positions(0, Action.H).long()
            assert sorted(hp.tolist()) == torch.nonzero(state[g] == 0).flatten().tolist()
            assert torch.equal(st_.h.view("k"), kv_at(hp, li))
            assert torch.equal(st_.h.view("v"), kv_at(hp, li) + 1)
            lp = cache.layers[li].positions(0, Action.L).long()
            assert sorted(lp.tolist()) == torch.nonzero(state[g] == 1).flatten().tolist()
            if lp.numel():
                k, v = st_.low_kv()
                assert torch.allclose(k, kv_at(lp, li), atol=0.1)
                assert torch.allclose(v, kv_at(lp, li) + 1, atol=0.1)


def test_action_errors_are_clear():
    cache = _mixed_cache(n=50, window=8)
    cache.apply(0, 0, torch.tensor([1, 2]), Action.R)
    cache.apply(0, 0, torch.tensor([3]), Action.L)
    with pytest.raises(AlreadyReleasedError, match=r"\[1\].*already released"):
        cache.apply(0, 0, torch.tensor([1]), Action.L)
    with pytest.raises(AlreadyReleasedError):
        cache.apply(0, 0, torch.tensor([2]), Action.R)
    with pytest.raises(IrreversibleActionError, match="cannot go back"):
        cache.apply(0, 0, torch.tensor([3]), Action.H)
    with pytest.raises(UnknownPositionError, match="unknown"):
        cache.apply(0, 0, torch.tensor([50]), Action.R)
    with pytest.raises(UnknownPositionError):
        cache.apply(0, 0, torch.tensor([-1]), Action.R)
    with pytest.raises(UnknownPositionError, match="duplicate"):
        cache.apply(0, 0, torch.tensor([4, 4]), Action.R)
    with pytest.raises(ProtectedTokenError, match="recent window"):
        cache.apply(0, 0, torch.tensor([45]), Action.L)
    with pytest.raises(UnknownPositionError, match="group"):
        cache.apply(0, 4, torch.tensor([5]), Action.L)
    with pytest.raises(UnknownPositionError, match="sequence"):
        cache.apply(1, 0, torch.tensor([5]), Action.L)
    cache.apply(0, 0, torch.tensor([3]), Action.L)  # L on L: no-op
    cache.apply(0, 0, torch.tensor([4]), Action.H)  # H on H: no-op
    assert all(issubclass(e, PaskError) for e in (AlreadyReleasedError, ProtectedTokenError))


def test_drop_frees_bytes_and_keeps_budget():
    cache = TieredCache(tiny_config(), CacheConfig(), batch_size=2)
    feed(cache, 40, rows=2)
    before = cache.allocated_bytes()
    cache.apply(1, 0, torch.arange(10), Action.R)
    b_before = cache.budget().b_total
    cache.drop(1)
    assert cache.allocated_bytes() < 0.6 * before
    assert cache.budget().b_total == pytest.approx(b_before)
    feed(cache, 1, rows=2)  # a dropped row may still be fed: ignored
    assert cache.seq_length(0) == 41
    with pytest.raises(UnknownPositionError, match="dropped"):
        cache.apply(1, 0, torch.tensor([0]), Action.R)


def test_budget_splits_prompt_and_generated():
    cache = TieredCache(tiny_config(), CacheConfig(recent_window=2), batch_size=1)
    feed(cache, 20)
    for _ in range(10):
        feed(cache, 1)
    for g in range(4):
        cache.apply(0, g, torch.arange(20), Action.R)
    cache.sample_budget()
    b = cache.budget()
    assert b.b_prompt == 0.0 and b.b_decode == 1.0
    assert b.b_total == pytest.approx(10 / 30)
    assert b.samples == 1 and b.b_total_avg == pytest.approx(10 / 30)


def test_unsupported_configs_raise():
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads"):
        TieredCache(type("Cfg", (), {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64})())
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        TieredCache(tiny_config(layer_types=["full_attention", "sliding_attention"] * 2))
    with pytest.raises(UnsupportedModelError, match="divisible"):
        TieredCache(tiny_config(), CacheConfig(quant_group=48))
    with pytest.raises(PaskError):
        CacheConfig(num_groups=0)


def test_cache_is_not_kept_alive_by_the_attention_record():
    import gc
    import weakref

    cache = TieredCache(tiny_config(), CacheConfig(), batch_size=1)
    feed(cache, 5)
    ref = weakref.ref(cache)
    del cache
    gc.collect()
    assert ref() is None


def test_static_mix_fractions_validation_and_registry():
    from pask.policies import get_policy, policy_names

    with pytest.raises(PaskError, match="sum to 1"):
        StaticMixPolicy(0.5, 0.5, 0.1)
    with pytest.raises(PaskError, match=">= 0"):
        StaticMixPolicy(1.2, -0.2, 0.0)
    StaticMixPolicy(0.5, 0.5 - 5e-7, 0.0)  # within 1e-6
    with pytest.raises(PaskError, match=r"known policies: .*static_mix"):
        get_policy("nope")
    assert {"full", "static_mix"} <= set(policy_names())
    p = get_policy("static_mix", h=0.34, l=0.33, r=0.33)
    acts = p.assign(torch.arange(3000))
    assert torch.equal(acts, p.assign(torch.arange(3000)))  # deterministic
    fr = torch.bincount(acts, minlength=3).float() / 3000
    assert torch.allclose(fr, torch.tensor([0.34, 0.33, 0.33]), atol=0.005)


def test_key_balance_tames_outlier_channels_and_is_counted():
    """Keys with a large per-channel offset: balanced INT4 keys are far closer; the balance bytes are held."""
    from pask.kv.storage import key_balance

    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 200, 64, generator=g)
    k[:, :, 3] += 60.0  # a k-bias-like outlier channel
    v = torch.randn(2, 200, 64, generator=g)
    errs = {}
    for balanced in (False, True):
        cfg = CacheConfig(num_groups=1, recent_window=0, key_balance=balanced)
        cache = TieredCache(tiny_config(1), cfg, 1)
        cache.update(k[None].to(torch.bfloat16), v[None].to(torch.bfloat16), 0)
        cache.apply(0, 0, torch.arange(200), Action.L)
        st = cache.layers[0].seqs[0]
        kd, _ = st.low_kv()
        errs[balanced] = float((kd - k).norm() / (k - k.mean(1, keepdim=True)).norm())
        assert (cache.held_bytes() - st.l.live_bytes()) == (2 * 2 * 64 * 4 if balanced else 0)
    assert errs[True] < errs[False] / 3, errs
    bal = key_balance(k)
    assert bal.shape == (2, 2, 64) and float(bal[0, 0, 3]) > 50  # mid-range of the outlier channel


def test_bench_kv_fills_a_four_tier_mix():
    """`pask bench kv --mix H:INT4:release:INT2` puts each share of the tokens in its tier."""
    from pask.bench.kv import _fill_tiered
    from pask.kv.cache import attention_config

    n, layers = 520, 4
    gen = torch.Generator().manual_seed(0)
    kv = [
        (
            torch.randn(1, 2, n, 64, generator=gen).to(torch.bfloat16),
            torch.randn(1, 2, n, 64, generator=gen).to(torch.bfloat16),
        )
        for _ in range(layers)
    ]
    cache = _fill_tiered(attention_config(2, 7, 64, layers), CacheConfig(), kv, (0.1, 0.3, 0.2, 0.4))
    st = cache.layers[0].seqs[0]
    outside = n - CacheConfig().recent_window
    assert abs(st.l.n - 0.3 * outside) <= 3 and abs(st.l2.n - 0.4 * outside) <= 3
    assert abs((outside - st.h.n + 8 - st.l.n - st.l2.n) - 0.2 * outside) <= 3
    three = _fill_tiered(attention_config(2, 7, 64, layers), CacheConfig(), kv, (0.1, 0.3, 0.6))
    assert three.layers[0].seqs[0].l2.n == 0
