"""The Policy protocol: explicit members on every registered policy, and explicit per-row reset.

Every registered policy satisfies :class:`pask.policies.base.Policy` with the ``budget`` it was
built with and a consistent ``target_b``. Stateful policies (accumulated attention, prefill
rankings, recurrence statistics) keep their state per row ``seq`` and drop it in ``reset``: an
instance reused for one row after another, or shared by interleaved rows, decides exactly as fresh
instances do, and a new ``seq == 0`` no longer clears the other rows. The decode core calls
``reset`` before each row's prefill decisions and when the row is done.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pask.errors import PaskError
from pask.kv.actions import Action
from pask.kv.cache import layer_groups
from pask.kv.latent import LatentProjections
from pask.policies import BASELINES, FullPolicy, get_policy, policy_names
from pask.policies.base import Policy, PolicyBase, SeqContext
from pask.policies.pask import PaskPolicy
from pask.policies.table import FrozenTable
from pask.runtime.capacity import policy_target_b

H, L, R = int(Action.H), int(Action.L), int(Action.R)
LAYERS, GROUPS, WINDOW = 2, 2, 4
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: Small configurations for ~30-token prompts (windows inside the prompt).
SMALL = {
    "h2o": {"sink": 2, "recent": 4},
    "mikv": {},
    "snapkv": {"window": 8, "kernel": 3},
    "criticalkv": {"window": 8, "kernel": 3, "first_stage_ratio": 0.5},
    "lazyeviction": {"window": 4, "alpha": 0.02},
}
#: The per-row state of each stateful policy.
STATE = {"h2o": "_acc", "mikv": "_acc", "snapkv": "_prio", "criticalkv": "_prio", "lazyeviction": "_rows"}
STATEFUL = tuple(SMALL)


def _table(target_b: float | None = 0.4, expected_b: float | None = 0.38) -> FrozenTable:
    return FrozenTable({}, "test", num_groups=GROUPS, recent_window=WINDOW, target_b=target_b, expected_b=expected_b)


def _projections(n: int = 2) -> LatentProjections:
    """BellowsKV projections for a 2-layer model of hidden 64 and 2 x 32 kv values (latent ratio 0.25 at n = 2)."""
    w = {i: torch.zeros(65, 128) for i in range(LAYERS)}
    return LatentProjections("test", "fp", n, 0.0, w, [])


def _build(name: str, budget: float) -> Policy:
    if name in ("full", "static_mix"):
        return get_policy(name)
    if name == "pask":
        return get_policy(name, table=_table(target_b=budget))
    if name == "bellows":
        return get_policy(name, projections=_projections())
    if name == "bellows-evict":
        return get_policy(name, budget=_evict_budget(budget), projections=_projections())
    return get_policy(name, budget=budget)


def _evict_budget(budget: float) -> float:
    return 0.01 + budget * 0.2  # below the latent's ratio 0.25


# -- the protocol's members ----------------------------------------------------------------------
def test_the_registry_is_covered():
    assert set(policy_names()) == {"full", "static_mix", "pask", "bellows", "bellows-evict", *BASELINES}


@pytest.mark.parametrize("name", policy_names())
@SETTINGS
@given(budget=st.floats(0.05, 1.0))
def test_every_registered_policy_has_the_protocol_members(name, budget):
    p = _build(name, budget)
    assert isinstance(p, Policy) and isinstance(p, PolicyBase)
    assert isinstance(p.name, str) and p.name
    if name in ("full", "static_mix"):
        assert p.budget is None and p.target_b == 1.0  # no target: Full KV's bytes
    elif name == "bellows":
        assert p.budget is None and p.target_b == pytest.approx(40 / 512)  # the 4-bit latent over 2 layers of K/V
    elif name == "bellows-evict":
        assert p.budget == pytest.approx(_evict_budget(budget)) and p.target_b == p.budget
    else:
        assert p.budget == pytest.approx(budget) and p.target_b == pytest.approx(budget)
    assert 0 < p.target_b <= 1 and policy_target_b(p) == p.target_b
    assert p.needs_tags is (name == "pask")
    assert isinstance(p.prefill_window, int) and isinstance(p.prefill_value_norm, bool)
    assert isinstance(p.step_attention, bool)
    assert p.step_scorer is None or callable(p.step_scorer)
    assert hasattr(p, "table") is (name == "pask")  # table: PASK's own member, not the protocol's
    p.reset(0)  # nothing decided yet: a no-op
    p.reset(7)


def test_pask_target_b_follows_its_table():
    assert PaskPolicy(_table(0.4, 0.38)).target_b == 0.4 and PaskPolicy(_table(0.4, 0.38)).budget == 0.4
    assert PaskPolicy(_table(None, 0.38)).target_b == 0.38 and PaskPolicy(_table(None, 0.38)).budget is None
    assert PaskPolicy(_table(None, None)).target_b == 1.0


def test_a_required_budget_stays_required():
    """PolicyBase gives no ``budget`` default, so a dataclass policy's budget field stays required."""
    with pytest.raises(PaskError, match="budget"):
        get_policy("h2o")
    from pask.policies import H2OPolicy

    with pytest.raises(TypeError):
        H2OPolicy()


def test_timed_policy_is_a_policy():
    from pask.bench.policy_overhead import TimedPolicy, _Clock

    inner = get_policy("h2o", budget=0.3)
    t = TimedPolicy(inner, _Clock())
    assert isinstance(t, Policy)
    assert (t.name, t.budget, t.target_b, t.step_attention) == ("h2o", 0.3, 0.3, True)
    assert t.prefill_window == inner.prefill_window and not t.needs_tags
    pask = TimedPolicy(PaskPolicy(_table()), _Clock())
    assert pask.needs_tags and pask.table.target_b == 0.4  # other attributes still pass through
    row = _Row(0, 20, seed=1)
    t.prefill_actions(row.ctx(row.stats_prefill()))
    assert 0 in inner._acc
    t.reset(0)
    assert inner._acc == {}


# -- per-row state and reset ---------------------------------------------------------------------
class _Row:
    """One fake sequence: tiers per layer group with the cache's rules, seeded statistics."""

    def __init__(self, seq: int, prompt_len: int, seed: int):
        self.seq, self.p, self.seed = seq, prompt_len, seed
        self.tiers = torch.zeros(GROUPS, prompt_len, dtype=torch.int8)
        self.decided = 0

    @property
    def n(self) -> int:
        return self.tiers.shape[1]

    def _rand(self, *shape: int, salt: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1000 + salt)
        return torch.rand(*shape, generator=g) ** 4  # a few large values

    def stats_prefill(self) -> dict:
        att = self._rand(LAYERS, 1, self.p, salt=0) * 4
        return {"prefill_attention": att, "prefill_value_norm": self._rand(LAYERS, 1, self.p, salt=1) + 0.1}

    def stats_step(self) -> dict:
        att = self._rand(LAYERS, 1, self.n, salt=self.n)
        att = att / att.sum(-1, keepdim=True)
        return {"step_attention": att.masked_fill(self.tiers[0] == R, 0.0)}

    def ctx(self, stats: dict) -> SeqContext:
        limit = max(0, self.n - WINDOW)
        leaving = torch.arange(self.decided, max(self.decided, limit))
        self.decided = max(self.decided, limit)
        return SeqContext(
            seq=self.seq,
            prompt_len=self.p,
            length=self.n,
            recent_window=WINDOW,
            num_groups=GROUPS,
            leaving=leaving,
            groups=layer_groups(LAYERS, GROUPS),
            tier_fn=lambda: self.tiers.clone(),
            **stats,
        )

    def apply(self, actions) -> list:
        out = []
        for g, pos, act in actions:
            pos = torch.as_tensor(pos)
            assert not bool((self.tiers[g, pos] == R).any()), "already released"
            self.tiers[g, pos] = int(act)
            out.append((g, pos.tolist(), int(act)))
        return out

    def prefill(self, policy: Policy) -> list:
        return self.apply(policy.prefill_actions(self.ctx(self.stats_prefill())))

    def step(self, policy: Policy) -> list:
        self.tiers = torch.cat([self.tiers, torch.zeros(GROUPS, 1, dtype=torch.int8)], dim=1)
        return self.apply(policy.step_actions(self.ctx(self.stats_step())))


def _small(name: str, budget: float) -> Policy:
    return get_policy(name, budget=budget, **SMALL[name])


def _run_alone(name: str, budget: float, seq: int, prompt_len: int, seed: int, steps: int) -> list:
    """A row's actions under a fresh instance."""
    pol, row = _small(name, budget), _Row(seq, prompt_len, seed)
    return [row.prefill(pol)] + [row.step(pol) for _ in range(steps)]


@pytest.mark.parametrize("name", STATEFUL)
@SETTINGS
@given(budget=st.floats(0.3, 0.9), lens=st.tuples(st.integers(16, 32), st.integers(16, 32)), steps=st.integers(1, 6))
def test_one_instance_reused_for_row_0_decides_like_fresh_ones(name, budget, lens, steps):
    shared = _small(name, budget)
    got = []
    for i, p in enumerate(lens):  # one request after the other, each as row 0
        shared.reset(0)
        row = _Row(0, p, seed=i)
        got.append([row.prefill(shared)] + [row.step(shared) for _ in range(steps)])
        assert set(getattr(shared, STATE[name])) == {0}
    assert got == [_run_alone(name, budget, 0, p, i, steps) for i, p in enumerate(lens)]
    shared.reset(0)
    assert getattr(shared, STATE[name]) == {}  # bounded by the live rows


@pytest.mark.parametrize("name", STATEFUL)
@SETTINGS
@given(
    budget=st.floats(0.3, 0.9),
    lens=st.tuples(st.integers(16, 32), st.integers(16, 32)),
    order=st.lists(st.sampled_from([0, 1]), min_size=2, max_size=12),
    first=st.sampled_from([0, 1]),
)
def test_interleaved_rows_do_not_leak_into_each_other(name, budget, lens, order, first):
    """Rows 0 and 1 on one instance (prefilled in either order, steps interleaved) = one instance each."""
    shared = _small(name, budget)
    rows = [_Row(s, lens[s], seed=10 + s) for s in (0, 1)]
    got: dict[int, list] = {0: [], 1: []}
    for s in (first, 1 - first):
        shared.reset(s)
        got[s].append(rows[s].prefill(shared))
    for s in order:
        got[s].append(rows[s].step(shared))
    for s in (0, 1):
        assert got[s] == _run_alone(name, budget, s, lens[s], 10 + s, order.count(s))


@pytest.mark.parametrize("name", STATEFUL)
def test_a_new_seq_0_keeps_seq_1_and_reset_drops_it(name):
    pol = _small(name, 0.5)
    one, zero = _Row(1, 24, seed=3), _Row(0, 20, seed=4)
    one.prefill(pol)
    zero.prefill(pol)  # formerly cleared every other row
    state = getattr(pol, STATE[name])
    assert set(state) == {0, 1}
    one.step(pol)  # row 1 still decides from its own state
    pol.reset(1)
    assert set(state) == {0}
    zero.step(pol)
    with pytest.raises(KeyError):
        one.step(pol)  # row 1 was forgotten: only a new prefill brings it back
    pol.reset(0)
    pol.reset(0)  # idempotent
    assert state == {}


# -- the decode core calls reset -----------------------------------------------------------------
class _Spy(PolicyBase):
    """Full KV that logs reset and decision calls."""

    name = "spy"
    budget = None

    def __init__(self):
        self.log: list[tuple[str, int]] = []

    def reset(self, seq: int) -> None:
        self.log.append(("reset", seq))

    def prefill_actions(self, ctx):
        self.log.append(("prefill", ctx.seq))
        return []

    def step_actions(self, ctx):
        self.log.append(("step", ctx.seq))
        return []


def test_the_decode_core_resets_each_row_before_prefill_and_when_done(smol):
    from pask.runtime.runner import decode_with_policy

    spy = _Spy()
    decode_with_policy(smol.model, [list(range(20, 32)), list(range(40, 50))], spy, 3)
    log = spy.log
    for s in (0, 1):
        calls = [c for c in log if c[1] == s]
        assert calls[:2] == [("reset", s), ("prefill", s)] and calls[-1] == ("reset", s)
        assert calls.count(("reset", s)) == 2 and calls.count(("step", s)) == 2
    h2o = get_policy("h2o", budget=0.5)
    for _ in range(2):  # one instance over several replays: no state survives them
        decode_with_policy(smol.model, [list(range(20, 40)), list(range(50, 66))], h2o, 4)
        assert h2o._acc == {}


def test_the_decode_core_rejects_an_object_outside_the_protocol(smol):
    from pask.runtime.runner import decode_with_policy

    class Bare:
        name = "bare"

        def prefill_actions(self, ctx):
            return []

        def step_actions(self, ctx):
            return []

    assert not isinstance(Bare(), Policy) and isinstance(FullPolicy(), Policy)
    with pytest.raises(PaskError, match="Policy protocol"):
        decode_with_policy(smol.model, [list(range(20, 30))], Bare(), 2)
