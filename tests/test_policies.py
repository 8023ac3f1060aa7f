"""Budget-controlled baselines: a shared end-to-end matrix, each policy's defining choice, bad input.

The matrix (like kvpress's ``tests/default_presses.py``) runs every baseline on smollm2-135m fp32
with a two-row batch, one row per target budget, and checks the measured B of each row, the
recent window at every step and that real bytes are released. The unit tests drive a policy by
hand on a tiny fake sequence with hand-built attention statistics.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from pask.errors import PaskError
from pask.kv.actions import Action
from pask.kv.cache import layer_groups
from pask.kv.stats import StatsRequest, collector_of, explicit_decode, window_attention
from pask.policies import (
    BASELINES,
    CriticalKVPolicy,
    FullPolicy,
    H2OPolicy,
    KIVIPolicy,
    LazyEvictionPolicy,
    MiKVPolicy,
    RocketKVPolicy,
    SeqContext,
    SnapKVPolicy,
    get_policy,
)
from pask.policies.base import PolicyBase
from pask.policies.rocketkv import hsa_scores
from pask.runtime.runner import decode_with_policy

H, L, R, L2 = int(Action.H), int(Action.L), int(Action.R), int(Action.L2)
BUDGETS = (0.5, 0.33)
NEW_TOKENS = 24

#: Small configurations for ~150-token prompts (windows well inside the prompt).
DEFAULT_CONFIGS = {
    "h2o": {"sink": 4, "recent": 16},
    "snapkv": {"window": 16, "kernel": 5, "pooling": "avg"},
    "mikv": {},
    "rocketkv": {"window": 16, "kernel": 31, "prefill_ratio": 0.25, "topr": 32, "page_size": 4},
    "criticalkv": {"window": 16, "first_stage_ratio": 0.5, "epsilon": 1e-4},
    "lazyeviction": {"window": 16, "alpha": 1e-3},
    "kivi-4": {},
    "kivi-2": {},
    "kivi-mix": {},
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


# -- the shared end-to-end matrix ---------------------------------------------------------------
class PerRow(PolicyBase):
    """One policy per batch row (so one batched run checks two budgets); checks the recent window.

    At every call it checks that the previous call's recent window is still H in every group
    (actions are applied between calls).
    """

    def __init__(self, policies):
        self.policies = policies
        self.name = policies[0].name
        self.budget = policies[0].budget
        for attr in ("prefill_window", "prefill_value_norm", "step_attention", "step_scorer"):
            if hasattr(policies[0], attr):
                setattr(self, attr, getattr(policies[0], attr))
        self.prev: dict[int, int] = {}
        self.calls = 0

    def _check(self, ctx: SeqContext) -> None:
        self.calls += 1
        n_prev = self.prev.get(ctx.seq)
        if n_prev is not None:
            window = ctx.tiers()[:, max(0, n_prev - ctx.recent_window) : n_prev]
            assert bool((window == H).all()), f"recent window of row {ctx.seq} touched"
        self.prev[ctx.seq] = ctx.length

    def reset(self, seq: int) -> None:
        self.policies[seq].reset(seq)

    def prefill_actions(self, ctx):
        self._check(ctx)
        return self.policies[ctx.seq].prefill_actions(ctx)

    def step_actions(self, ctx):
        self._check(ctx)
        return self.policies[ctx.seq].step_actions(ctx)


@pytest.fixture(scope="module")
def prompts(smol):
    tok = smol.tokenizer
    a = "Functions: " + ", ".join(f"get_weather_{i}(city, unit)" for i in range(12)) + ". Call one for Paris."
    b = "def add(a, b):\n    return a + b\n" * 12 + "# Now write a function that multiplies two numbers."
    rows = [tok(a)["input_ids"], tok(b)["input_ids"]]
    assert all(120 <= len(r) <= 170 for r in rows), [len(r) for r in rows]
    return rows


@pytest.mark.parametrize("name", BASELINES)
def test_policy_end_to_end_meets_budget(smol, prompts, name):
    policies = [get_policy(name, budget=b, **DEFAULT_CONFIGS[name]) for b in BUDGETS]
    wrapper = PerRow(policies)
    res = decode_with_policy(smol.model, prompts, wrapper, NEW_TOKENS)
    cache = res.cache
    assert all(len(t) == NEW_TOKENS for t in res.tokens)
    assert wrapper.calls == 2 * NEW_TOKENS  # prefill + 23 steps per row
    for row, target in enumerate(BUDGETS):
        held, full = cache._seq_bytes(row)  # what the engine reports as extra["budget"]["b_total"]
        b = sum(held) / sum(full)
        assert abs(b - target) <= 0.02, (name, row, b, target)
        n = cache.seq_length(row)
        for g in range(len(cache.groups)):
            tiers = cache.tiers(row, g)
            assert bool((tiers[n - cache.config.recent_window :] == H).all())
            if name in ("mikv", "kivi-4", "kivi-2", "kivi-mix"):
                assert not bool((tiers == R).any()), "mixed precision above the INT4 cost releases nothing"
                assert bool((tiers == (L2 if name == "kivi-2" else L)).any())
                assert not bool((tiers == (L if name == "kivi-2" else L2)).any())
            else:
                assert not bool((tiers == L).any()) and not bool((tiers == L2).any())
    st = cache.layers[0].seqs[0]
    d = cache.spec.head_dim
    for bits in (4, 2):  # both low tiers exist in every cache; a slot is codes + bf16 scale and zero
        assert st.low(bits).slot_bytes() == 2 * cache.spec.num_kv_heads * (d * bits // 8 + 4 * d // 32)
    if name in ("mikv", "kivi-4", "kivi-2", "kivi-mix"):
        assert st.low(2 if name == "kivi-2" else 4).n
    cache.compact()
    assert cache.allocated_bytes() < cache.full_bytes()


def test_full_policy_collects_nothing_and_explicit_path_is_exact(smol, prompts):
    """Full KV attaches no collector; a policy asking for step statistics decodes the same tokens at B = 1."""
    ids = [prompts[0][:60]]
    full = decode_with_policy(smol.model, ids, FullPolicy(), 8, keep_logits=True)
    assert collector_of(full.cache) is None
    h2o = decode_with_policy(smol.model, ids, H2OPolicy(budget=1.0), 8, keep_logits=True)
    assert collector_of(h2o.cache) is not None
    assert h2o.tokens == full.tokens
    assert (torch.stack(h2o.logits) - torch.stack(full.logits)).abs().max() <= 1e-4


class Recorder(PolicyBase):
    """A policy that only records the statistics it is given."""

    name = "recorder"
    budget = None
    prefill_window = 8
    prefill_value_norm = True
    step_attention = True

    def __init__(self):
        self.seen = []

    def prefill_actions(self, ctx):
        self.seen.append(("prefill", ctx.prompt_len, ctx.prefill_attention, ctx.prefill_value_norm))
        return [(g, torch.arange(5, 15), Action.R) for g in range(ctx.num_groups)]

    def step_actions(self, ctx):
        self.seen.append(("step", ctx.length, ctx.step_attention, ctx.int4_cost))
        return []


def test_session_statistics_shapes_and_mass(smol, prompts):
    rec = Recorder()
    rows = [prompts[0][:40], prompts[1][:30]]  # left padding on row 1
    decode_with_policy(smol.model, rows, rec, 3)
    cfg = smol.model.config
    layers, hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
    pre = [s for s in rec.seen if s[0] == "prefill"]
    assert [s[1] for s in pre] == [40, 30]
    for _, p, att, vn in pre:
        assert att.shape == (layers, hkv, p) and vn.shape == (layers, hkv, p)
        assert torch.allclose(att.sum(-1), torch.full((layers, hkv), 8.0), atol=1e-3)  # 8 queries
        assert bool((vn > 0).all())
    steps = [s for s in rec.seen if s[0] == "step"]
    assert len(steps) == 4
    for _, n, att, cost in steps:
        assert att.shape == (layers, hkv, n)
        assert torch.allclose(att.sum(-1), torch.ones(layers, hkv), atol=1e-4)
        assert float(att[..., 5:15].abs().max()) == 0.0  # released positions get nothing
        assert math.isclose(cost, 40 / 256)  # INT4 bytes / fp32 bytes at D = 64, g = 32


def test_window_attention_and_explicit_decode_match_naive():
    g = torch.Generator().manual_seed(0)
    hq, hkv, p, d = 4, 2, 12, 64
    q, k = torch.randn(hq, p, d, generator=g), torch.randn(hkv, p, d, generator=g)
    got = window_attention(q, k, 3, 0.125)
    kk = k.repeat_interleave(2, 0)
    s = (q @ kk.transpose(1, 2)) * 0.125
    s = s.masked_fill(torch.ones(p, p).triu(1).bool(), -torch.inf)
    want = torch.softmax(s, -1)[:, -3:].sum(1).view(hkv, 2, p).mean(1)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(window_attention(q, k, 100, 0.125).sum(-1), torch.full((hkv,), float(p)))

    from pask.kv.attention import tiered_attention_reference
    from pask.kv.cache import CacheConfig, TieredCache
    from tests.test_kv_attention import tiny_config

    cache = TieredCache(tiny_config(1), CacheConfig(num_groups=1, recent_window=2), 1)
    kv = torch.randn(1, 2, 20, 64, generator=g)
    cache.update(kv, kv * 0.5, 0)
    cache.apply(0, 0, torch.arange(0, 6), Action.L)
    cache.apply(0, 0, torch.arange(6, 9), Action.R)
    store, layer = cache.layers[0].seqs[0], cache.layers[0]
    qd = torch.randn(6, 1, 64, generator=g)
    out, probs, pos, _ = explicit_decode(qd, store, 0.125, layer.positions(0, Action.H), layer.positions(0, Action.L))
    assert torch.allclose(out, tiered_attention_reference(qd, store, 0.125), atol=1e-5)
    assert sorted(pos.tolist()) == [*range(6), *range(9, 20)]
    assert torch.allclose(probs.sum(-1), torch.ones(2))


# -- a tiny fake sequence for unit tests ---------------------------------------------------------
class FakeSeq:
    """Tiers of one sequence over ``groups`` groups of one layer each, with the cache's action rules."""

    def __init__(self, prompt_len: int, groups: int = 1, window: int = 2, cost: float = 0.3125, cost2: float = 0.1875):
        self.p, self.window, self.cost, self.cost2 = prompt_len, window, cost, cost2
        self.tiers = torch.zeros(groups, prompt_len, dtype=torch.int8)

    @property
    def n(self) -> int:
        return self.tiers.shape[1]

    def ctx(self, **stats) -> SeqContext:
        g = self.tiers.shape[0]
        return SeqContext(
            seq=0,
            prompt_len=self.p,
            length=self.n,
            recent_window=self.window,
            num_groups=g,
            leaving=torch.arange(0),
            groups=layer_groups(g, g),
            int4_cost=self.cost,
            int2_cost=self.cost2,
            tier_fn=lambda: self.tiers.clone(),
            **stats,
        )

    def apply(self, actions) -> None:
        for g, pos, act in actions:
            pos = torch.as_tensor(pos)
            assert int(pos.max()) < self.n - self.window, "recent window touched"
            assert not bool((self.tiers[g, pos] == R).any()), "already released"
            assert act != Action.H
            self.tiers[g, pos] = int(act)

    def grow(self) -> None:
        self.tiers = torch.cat([self.tiers, torch.zeros(self.tiers.shape[0], 1, dtype=torch.int8)], dim=1)

    def where(self, tier: int, g: int = 0) -> set[int]:
        return set(torch.nonzero(self.tiers[g] == tier).squeeze(1).tolist())

    def budget(self) -> float:
        t = self.tiers.float()
        return float(((t == H).sum() + self.cost * (t == L).sum() + self.cost2 * (t == L2).sum()) / t.numel())


def per_layer(x: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """``[n]`` -> ``[layers = groups, Hkv = 1, n]``."""
    return x.float().expand(groups, 1, x.shape[-1]).clone()


def test_snapkv_keeps_pooled_topk_of_window_attention():
    p = 40
    att = torch.full((p,), 0.01)
    att[10], att[30] = 1.0, 0.2  # a spike whose neighbours pooling lifts, and a lone medium token
    seq = FakeSeq(p)
    pol = SnapKVPolicy(budget=7 / 40, window=4, kernel=3, pooling="avg")
    seq.apply(pol.prefill_actions(seq.ctx(prefill_attention=per_layer(att * 4))))
    assert seq.where(H) == {9, 10, 11, 36, 37, 38, 39}  # pooled top-3 + the observation window
    seq = FakeSeq(p)
    raw = SnapKVPolicy(budget=7 / 40, window=4, kernel=1)
    seq.apply(raw.prefill_actions(seq.ctx(prefill_attention=per_layer(att * 4))))
    assert 30 in seq.where(H) and 9 not in seq.where(H)  # without pooling the lone token wins
    # generated tokens are kept; the lowest-ranked prompt tokens make room for them
    seq = FakeSeq(p)
    seq.apply(pol.prefill_actions(seq.ctx(prefill_attention=per_layer(att * 4))))
    for _ in range(3):
        seq.grow()
        seq.apply(pol.step_actions(seq.ctx()))
    kept = seq.where(H)  # round(0.175 * 43) = 8 held: generated, the window, the best prefix token
    assert (
        set(range(36, 43)) <= kept and len(kept - set(range(36, 43))) == 1 and kept - set(range(36, 43)) < {9, 10, 11}
    )
    assert abs(seq.budget() - 7 / 40) <= 1 / seq.n


def test_h2o_keeps_sinks_heavy_hitters_and_recent():
    p = 40
    att = torch.full((p,), 1.0)
    att[7], att[15], att[25] = 50.0, 40.0, 5.0
    seq = FakeSeq(p)
    pol = H2OPolicy(budget=8 / 40, sink=2, recent=4)
    seq.apply(pol.prefill_actions(seq.ctx(prefill_attention=per_layer(att))))
    assert seq.where(H) == {0, 1, 7, 15, 36, 37, 38, 39}
    # decode: attention moves to token 36 (just left H2O's recent share); it overtakes heavy hitter 15
    seq.grow()
    step = torch.zeros(seq.n)
    step[36] = 100.0
    seq.apply(pol.step_actions(seq.ctx(step_attention=per_layer(step))))
    assert seq.where(H) == {0, 1, 7, 36, 37, 38, 39, 40}  # round(0.2 * 41) = 8 held


def test_lazyeviction_keeps_the_token_whose_recurrence_is_imminent():
    p = 12
    pre = torch.zeros(p)
    pre[[3, 4]] = 1.0  # both recur at prefill (step 0)
    seq = FakeSeq(p, window=2)
    pol = LazyEvictionPolicy(budget=1.0, window=2, alpha=0.05)
    seq.apply(pol.prefill_actions(seq.ctx(prefill_attention=per_layer(pre * 2))))
    for s in range(1, 7):
        seq.grow()
        att = torch.zeros(seq.n)
        att[3] = 0.1 if s in (2, 4, 6) else 0.0  # A recurs every 2 steps: next due at step 8
        att[4] = 0.9 if s == 1 else 0.0  # B: a big hit at step 1, then silence (overdue)
        if s == 6:
            pol.budget = 3 / seq.n  # now room for the window and one more token
        seq.apply(pol.step_actions(seq.ctx(step_attention=per_layer(att))))
    assert seq.where(H) == {3, seq.n - 2, seq.n - 1}
    st = pol._rows[0]
    assert float(st.mri[0, 3]) == 2.0 and float(st.acc[0, 4]) > float(st.acc[0, 3])


def test_criticalkv_prefers_high_value_output_norm_among_equal_scores():
    p = 30
    att = torch.full((p,), 0.5)
    vnorm = torch.ones(p)
    vnorm[[3, 11, 17]] = 5.0
    seq = FakeSeq(p)
    pol = CriticalKVPolicy(budget=7 / 30, first_stage_ratio=0.0, window=4, kernel=1)
    seq.apply(pol.prefill_actions(seq.ctx(prefill_attention=per_layer(att), prefill_value_norm=per_layer(vnorm))))
    assert seq.where(H) == {3, 11, 17, 26, 27, 28, 29}
    # stage 1 keeps the attention winner even though its value norm is small
    att2 = att.clone()
    att2[20] = 3.0
    vnorm2 = vnorm.clone()
    vnorm2[20] = 0.01
    seq = FakeSeq(p)
    pol = CriticalKVPolicy(budget=7 / 30, first_stage_ratio=0.34, window=4, kernel=1)
    seq.apply(pol.prefill_actions(seq.ctx(prefill_attention=per_layer(att2), prefill_value_norm=per_layer(vnorm2))))
    assert 20 in seq.where(H) and len(seq.where(H) & {3, 11, 17}) == 2


def test_mikv_sends_unimportant_tokens_to_int4_not_release():
    p = 20
    att = torch.arange(p, 0, -1).float()  # earlier = more important
    att[[2, 5, 9]] = 100.0
    seq = FakeSeq(p, cost=0.3125)
    pol = MiKVPolicy(budget=0.5)
    seq.apply(pol.prefill_actions(seq.ctx(prefill_attention=per_layer(att))))
    # h + 0.3125 (20 - h) = 10 -> h = round(5.45) = 5: the window (2) and the 3 most important
    assert seq.where(H) == {2, 5, 9, 18, 19}
    assert seq.where(R) == set() and len(seq.where(L)) == 15
    assert abs(seq.budget() - 0.5) <= 0.02
    # below the INT4 cost the least important are released, the rest stay INT4
    seq = FakeSeq(p, cost=0.3125)
    seq.apply(MiKVPolicy(budget=0.25).prefill_actions(seq.ctx(prefill_attention=per_layer(att))))
    assert seq.where(H) == {18, 19} and {2, 5, 9} <= seq.where(L) and 17 in seq.where(R)
    assert seq.budget() <= 0.25 + 1e-9 and abs(seq.budget() - 0.25) <= 0.02


def test_kivi_quantises_everything_outside_the_residual_and_releases_nothing():
    seq = FakeSeq(40, window=2, cost=0.3125)
    pol = KIVIPolicy(budget=0.5)
    seq.apply(pol.prefill_actions(seq.ctx()))
    residual = round((0.5 - 0.3125) / 0.6875 * 40)  # 11 newest tokens stay H
    assert seq.where(H) == set(range(40 - residual, 40)) and seq.where(L) == set(range(40 - residual))
    for _ in range(10):
        seq.grow()
        seq.apply(pol.step_actions(seq.ctx()))
    assert seq.where(R) == set() and abs(seq.budget() - 0.5) <= 0.02
    assert max(seq.where(L)) < min(seq.where(H))  # the residual is the newest tokens
    seq = FakeSeq(40, window=2, cost=0.3125)
    seq.apply(KIVIPolicy(budget=0.2).prefill_actions(seq.ctx()))  # below the INT4 cost: floor, no release
    assert seq.where(H) == {38, 39} and seq.where(R) == set()


def test_kivi2_sizes_its_residual_by_the_int2_cost_and_takes_the_int2_tier():
    pol = get_policy("kivi-2", budget=0.25)
    assert pol.name == "kivi-2"
    seq = FakeSeq(40, window=2)  # INT2 costs 0.1875 of BF16 at D = 64, g = 32
    seq.apply(pol.prefill_actions(seq.ctx()))
    residual = round((0.25 - 0.1875) / 0.8125 * 40)  # 3 newest tokens stay H (INT4 could not reach 0.25)
    assert seq.where(H) == set(range(40 - residual, 40)) and seq.where(R) == set()
    assert seq.where(L2) == set(range(40 - residual)) and seq.where(L) == set()
    assert abs(seq.budget() - 0.25) <= 0.02


@pytest.mark.parametrize(
    ("budget", "order", "int2"),
    [
        (0.33, "last", []),
        (0.29, "last", [3]),
        (0.26, "last", [2, 3]),
        (0.26, "first", [0, 1]),
        (0.1, "last", [0, 1, 2, 3]),
    ],
)
def test_kivi_mix_gives_int2_to_the_fewest_groups_that_reach_the_budget(budget, order, int2):
    pol = get_policy("kivi-mix", budget=budget, int2_groups=order)
    seq = FakeSeq(200, groups=4, window=2)
    seq.apply(pol.prefill_actions(seq.ctx()))
    for g in range(4):
        low = seq.where(L2 if g in int2 else L, g)
        assert low and not seq.where(L if g in int2 else L2, g) and not seq.where(R, g)
    floor = ((4 - len(int2)) * 0.3125 + len(int2) * 0.1875) / 4
    assert abs(seq.budget() - max(budget, floor)) <= 0.02
    with pytest.raises(PaskError, match="int2_groups"):
        get_policy("kivi-mix", budget=0.3, int2_groups="middle")


def test_mikv_at_two_bits_keeps_the_rest_in_int2():
    seq = FakeSeq(100, window=2)
    pol = get_policy("mikv", budget=0.3, bits=2)
    seq.apply(pol.prefill_actions(seq.ctx(prefill_attention=per_layer(torch.rand(100)))))
    assert seq.where(L) == set() and seq.where(R) == set() and seq.where(L2)
    assert abs(seq.budget() - 0.3) <= 0.02
    with pytest.raises(PaskError, match="bits"):
        get_policy("mikv", budget=0.3, bits=3)


def test_rocketkv_stage1_max_pool_and_stage2_hsa_topk():
    p = 60
    att = torch.full((p,), 0.01)
    att[20] = 1.0
    seq = FakeSeq(p)
    pol = RocketKVPolicy(budget=0.2, window=4, kernel=7, prefill_ratio=0.1, page_size=2)
    seq.apply(pol.prefill_actions(seq.ctx(prefill_attention=per_layer(att * 4))))
    kept = seq.where(H)
    assert len(kept) == round((0.2 + 0.1 * 0.8) * p) and set(range(17, 24)) <= kept  # max pool spreads the spike
    # stage 2: exact when every dimension is read; the best-scored tokens survive the per-step cut
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 3, 64, generator=g), torch.randn(1, 10, 64, generator=g)
    exact = torch.softmax(q @ k.transpose(1, 2) * 0.125, -1).mean(1)
    sc = hsa_scores(q, k, torch.arange(10), 0.125, topr=64, page_size=2)
    assert sc.shape == (2, 1, 10) and torch.allclose(sc[1], exact, atol=1e-6)
    seq.grow()
    scores = torch.zeros(1, 2, 1, seq.n)
    scores[0, 0, 0] = 1.0  # every page equal
    best = sorted(kept - {56, 57, 58, 59})[-3:]  # ties keep earlier tokens: only the score saves these
    scores[0, 1, 0, best] = 1.0
    seq.apply(pol.step_actions(seq.ctx(step_scores=scores)))
    assert len(seq.where(H)) == round(0.2 * 61) and set(best) <= seq.where(H)


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", BASELINES)
@pytest.mark.parametrize("budget", [0.0, -0.1, 1.5, float("nan"), "half"])
def test_budget_outside_unit_interval_is_rejected(name, budget):
    with pytest.raises(PaskError, match="budget"):
        get_policy(name, budget=budget)


def test_unknown_policy_and_unknown_or_bad_config_keys_are_clear_errors():
    with pytest.raises(PaskError, match=r"unknown policy 'nope'; known policies: .*h2o"):
        get_policy("nope", budget=0.5)
    with pytest.raises(PaskError, match=r"bad configuration for policy 'snapkv'.*windw"):
        get_policy("snapkv", budget=0.5, windw=8)
    with pytest.raises(PaskError, match=r"bad configuration for policy 'h2o'.*budget"):
        get_policy("h2o")
    with pytest.raises(PaskError, match="pooling"):
        get_policy("snapkv", budget=0.5, pooling="median")
    with pytest.raises(PaskError, match="odd"):
        get_policy("rocketkv", budget=0.5, kernel=64)
    with pytest.raises(PaskError, match="bits"):
        get_policy("mikv", budget=0.5, bits=8)
    with pytest.raises(PaskError, match="alpha"):
        get_policy("lazyeviction", budget=0.5, alpha=0.0)
    assert get_policy("kivi", budget=0.4).name == "kivi-4"
    with pytest.raises(PaskError, match=r"bad configuration for policy 'kivi-2'.*bits"):
        get_policy("kivi-2", budget=0.4, bits=4)
    with pytest.raises(PaskError, match="bits must be 2 or 4"):
        KIVIPolicy(budget=0.4, bits=3)


def test_stats_requests_of_each_policy():
    """Only what each policy needs is computed (prefill-only policies keep the fused decode path)."""
    req = {name: StatsRequest.of(get_policy(name, budget=0.5)) for name in BASELINES}
    assert not req["kivi-4"].any and not req["kivi-2"].any and not StatsRequest.of(FullPolicy()).any
    assert req["snapkv"].prefill and not req["snapkv"].step
    assert req["criticalkv"].prefill_value_norm and not req["criticalkv"].step
    assert req["h2o"].step_attention and req["mikv"].step_attention and req["lazyeviction"].step_attention
    assert req["rocketkv"].step_scorer is not None and not req["rocketkv"].step_attention


# -- tuning ---------------------------------------------------------------------------------------
def test_tune_walks_the_grid_resumes_and_records_the_choice(tmp_path):
    from pask.policies.tuning import TABLE8_GRIDS, grid_configs, tune, tuned_config

    assert len(grid_configs(TABLE8_GRIDS["snapkv"])) == 24
    grid = {"sink": [2, 4], "recent": [16, 32]}
    calls = []

    def evaluate(name, budget, params):
        calls.append(params)
        if len(calls) == 3 and not (tmp_path / "crashed").exists():
            (tmp_path / "crashed").touch()
            raise KeyboardInterrupt
        return {"score": params["sink"] * 10 + params["recent"] / 100, "b_total": budget}

    log, configs = tmp_path / "log.jsonl", tmp_path / "configs.json"
    with pytest.raises(KeyboardInterrupt):
        tune("h2o", 0.33, grid, evaluate, log, configs)
    assert len(log.read_text().splitlines()) == 2
    best = tune("h2o", 0.33, grid, evaluate, log, configs)
    assert best == {"sink": 4, "recent": 32} and len(calls) == 5  # 2 + the interrupted one again + 2
    assert tuned_config("h2o", 0.33, configs) == best and tuned_config("h2o", 0.5, configs) == {}
    with pytest.raises(PaskError, match="bad configuration"):
        tune("h2o", 0.33, {"sinks": [1]}, evaluate, log, configs)


def test_coordinate_search_varies_one_knob_at_a_time(tmp_path):
    from pask.policies.tuning import TABLE8_GRIDS, coordinate_configs, policy_defaults, tune

    grid = TABLE8_GRIDS["snapkv"]
    base = policy_defaults("snapkv", list(grid))
    assert base == {"window": 32, "pooling": "avg", "kernel": 5}
    cfgs = coordinate_configs(grid, base)
    assert cfgs[0] == base and len(cfgs) == 4 + 2 + 3 - 2  # base + the other values of each knob
    assert len({json.dumps(c, sort_keys=True) for c in cfgs}) == len(cfgs)
    for c in cfgs[1:]:  # each differs from the base in exactly one knob
        assert sum(c[k] != base[k] for k in grid) == 1
    with pytest.raises(PaskError, match="base value"):
        coordinate_configs({"window": [1]}, {})
    seen = []
    best = tune(
        "snapkv",
        0.33,
        None,
        lambda n, b, p: seen.append(p) or float(p["window"]),
        tmp_path / "log.jsonl",
        tmp_path / "c.json",
        search="coordinate",
    )
    assert seen == cfgs and best["window"] == 128
    with pytest.raises(PaskError, match="unknown search"):
        tune("snapkv", 0.33, None, lambda *a: 0.0, tmp_path / "l2.jsonl", tmp_path / "c.json", search="random")


def test_group_scores_of_an_empty_prefix():
    from pask.policies._common import group_scores

    out = group_scores(torch.zeros(4, 2, 0), [range(0, 2), range(2, 4)])
    assert out.shape == (2, 0)


@pytest.mark.parametrize("name", ["snapkv", "criticalkv", "rocketkv"])
def test_prompt_shorter_than_the_observation_window(smol, name):
    from pask.runtime.runner import decode_with_policy

    res = decode_with_policy(smol.model, [list(range(20, 30))], get_policy(name, budget=0.5), 12)
    assert len(res.tokens[0]) == 12


def test_policy_from_spec_names_budgets_and_committed_tables():
    from pask.policies.factory import policy_from_spec

    assert policy_from_spec("full", "qwen2.5-coder-0.5b") is None  # Full KV: DynamicCache
    assert isinstance(policy_from_spec("kivi-4@0.33", "qwen2.5-coder-0.5b"), KIVIPolicy)
    pask = policy_from_spec("pask@0.33", "qwen2.5-coder-0.5b")
    assert type(pask).__name__ == "PaskPolicy"
    for spec, words in [
        ("pask", "needs a budget"),
        ("pask@x", "must be a number"),
        ("pask@0.77", "no committed PASK bfcl table"),
    ]:
        with pytest.raises(PaskError, match=words):
            policy_from_spec(spec, "qwen2.5-coder-0.5b")
