"""PaskPolicy: table lookup per bucket, defaults, recent window, prefill / decode ablations."""

from __future__ import annotations

import itertools

import pytest
import torch

from pask.errors import PaskError
from pask.kv.actions import Action
from pask.policies.base import SeqContext
from pask.policies.pask import PaskPolicy, benchmark_overhead
from pask.policies.table import FrozenTable
from pask.structure.tags import Bucket, PromptLabel, json_tags

TAGS = list(json_tags())
LABELS = list(PromptLabel)
G = 4


def mixed_table(default: str = "H", skip_every: int = 0) -> FrozenTable:
    """Every label / JSON tag x group gets a deterministic action (some left out when ``skip_every``)."""
    acts = {}
    for i, (item, g) in enumerate(itertools.product([*LABELS, *TAGS], range(G))):
        if skip_every and i % skip_every == 0:
            continue
        acts[str(Bucket(item, g))] = ("H", "L", "L2", "R")[(i + i // G) % 4]
    return FrozenTable(acts, "test", num_groups=G, recent_window=8, default_action=default)


def expected_action(table: FrozenTable, item, group: int) -> Action:
    return Action.H if item is None else table.action(Bucket(item, group))


def _ctx(leaving, prompt_len=40, n_tags=30, labels=True) -> SeqContext:
    return SeqContext(
        seq=0,
        prompt_len=prompt_len,
        length=prompt_len + n_tags,
        recent_window=8,
        num_groups=G,
        leaving=torch.as_tensor(leaving, dtype=torch.long),
        tags=[TAGS[(5 * i) % len(TAGS)] for i in range(n_tags)],
        prompt_labels=[LABELS[(7 * i) % len(LABELS)] for i in range(prompt_len)] if labels else None,
    )


def _as_map(specs) -> dict[tuple[int, int], Action]:
    out = {}
    for g, pos, act in specs:
        for p in pos.tolist():
            assert (g, p) not in out, "a position got two actions in one group"
            out[(g, p)] = act
    return out


@pytest.mark.parametrize("leaving", [list(range(32)), list(range(30, 62)), [45], [3]])
def test_lookup_matches_table_per_bucket(leaving):
    table = mixed_table(skip_every=5)
    pol = PaskPolicy(table)
    ctx = _ctx(leaving)
    got = _as_map(pol.step_actions(ctx))
    for p in leaving:
        item = ctx.prompt_labels[p] if p < ctx.prompt_len else ctx.tags[p - ctx.prompt_len]
        for g in range(G):
            want = expected_action(table, item, g)
            assert got.get((g, p), Action.H) == want, (p, g, item)
    assert all(act != Action.H for act in got.values())  # H is never issued (no-op)
    if len(leaving) > 1:  # the batched path issues every lossy action, INT2 included
        assert {Action.L, Action.L2, Action.R} <= set(got.values())
    assert set(p for _, p in got) <= set(leaving)  # only leaving positions are touched


def test_missing_buckets_and_tags_get_the_default():
    table = FrozenTable({}, "test", num_groups=G, recent_window=8, default_action="L")
    pol = PaskPolicy(table)
    got = _as_map(pol.prefill_actions(_ctx(range(10), labels=False)))
    assert got == {(g, p): Action.L for g in range(G) for p in range(10)}
    # a generated position past the known tags (no tag) -> default too
    got = _as_map(pol.step_actions(_ctx([40 + 35], n_tags=30)))
    assert got == {(g, 75): Action.L for g in range(G)}


def test_string_tags_and_labels_find_the_same_rows():
    table = mixed_table()
    pol = PaskPolicy(table)
    ctx = _ctx(range(60))
    ctx_s = _ctx(range(60))
    ctx_s.tags = [str(t) for t in ctx.tags]
    ctx_s.prompt_labels = [str(x) for x in ctx.prompt_labels]
    assert _as_map(pol.step_actions(ctx)) == _as_map(pol.step_actions(ctx_s))


def test_ablation_switches():
    table = mixed_table()
    ctx = _ctx(range(60))
    full = _as_map(PaskPolicy(table).step_actions(ctx))
    pre = _as_map(PaskPolicy(table, decode=False).step_actions(ctx))
    dec = _as_map(PaskPolicy(table, prefill=False).step_actions(ctx))
    assert pre == {k: v for k, v in full.items() if k[1] < 40}
    assert dec == {k: v for k, v in full.items() if k[1] >= 40}
    assert PaskPolicy(table, prefill=False, decode=False).step_actions(ctx) == []


def test_group_or_window_mismatch_is_an_error():
    pol = PaskPolicy(FrozenTable({}, "test", num_groups=2, recent_window=8))
    with pytest.raises(PaskError, match="2 layer groups"):
        pol.prefill_actions(_ctx(range(5)))
    assert pol.prefill_actions(_ctx([])) == []  # nothing leaving: nothing checked


def test_factory_loads_a_table_file_and_checks_the_budget(tmp_path):
    from pask.policies.pask import make_pask_policy

    t = mixed_table()
    t.target_b = 0.33
    path = t.save(tmp_path / "t.json")
    pol = make_pask_policy(str(path), budget=0.33, decode=False, fingerprint="test")
    assert pol.table.actions == t.actions and pol.decode is False and pol.needs_tags
    with pytest.raises(PaskError, match=r"calibrated for B = 0\.33"):
        make_pask_policy(path, budget=0.5)
    with pytest.raises(PaskError, match="not on this model"):
        make_pask_policy(path, fingerprint="other-model")


def test_factory_checks_the_task_unless_a_transfer(tmp_path):
    from pask.policies.pask import make_pask_policy

    t = mixed_table()  # calibrated on bfcl
    path = t.save(tmp_path / "t.json")
    assert make_pask_policy(path, task="bfcl").table.task == "bfcl"
    with pytest.raises(PaskError, match=r"calibrated for task 'bfcl', not 'ruler'.*allow_transfer"):
        make_pask_policy(path, task="ruler")
    assert make_pask_policy(path, task="ruler", allow_transfer=True).table.task == "bfcl"


def test_overhead_benchmark_runs():
    r = benchmark_overhead(steps=200, prompt_len=128)
    assert 0 < r["step_us"] < 5000 and r["prefill_tokens"] == 128


# -- on the real cache ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tagged_run(smol):
    """One BFCL case generated on the all-H tiered cache with tags and prompt labels."""
    from pask.calibration.control import all_h_policy
    from pask.evaluation.run_bfcl import prepare
    from pask.runtime.engine import generate
    from pask.tasks.function_calling import load_cases

    torch.set_num_threads(1)
    (case,) = load_cases(["simple"], split="calibration", limit=1)
    req, err = prepare(smol, case, 24, tagging=True)
    assert err is None
    (gen,) = generate(smol, [req], policy=all_h_policy(smol.fingerprint, G, 8))
    n_fed = len(gen.token_ids) - (gen.stop_reason != "eos")
    return case, req, gen, n_fed


def _replay(smol, req, gen, n_fed, policy):
    from pask.calibration.distortion import FORCED_STOP, ForcedContext
    from pask.runtime.runner import decode_with_policy

    toks = gen.token_ids[:n_fed]
    it = iter([*toks, FORCED_STOP])
    return decode_with_policy(
        smol.model,
        [req.prompt_ids],
        ForcedContext(policy, [gen.extra["tags"]], [req.prompt_labels]),
        max_new_tokens=n_fed + 1,
        next_token_fn=lambda row, logits: next(it),
        stop_token_ids=(FORCED_STOP,),
    )


@pytest.mark.parametrize("prefill, decode", [(True, True), (True, False), (False, True)])
def test_real_cache_tiers_follow_the_table(smol, tagged_run, prefill, decode):
    _case, req, gen, n_fed = tagged_run
    table = mixed_table()
    res = _replay(smol, req, gen, n_fed, PaskPolicy(table, prefill=prefill, decode=decode))
    cache = res.cache
    stored = len(req.prompt_ids) + n_fed
    assert cache.seq_length(0) == stored
    tags = gen.extra["tags"]
    for g in range(G):
        tiers = cache.tiers(0, g).tolist()
        for p in range(stored):
            if p >= stored - 8:  # the recent window is never touched
                want = Action.H
            elif p < len(req.prompt_ids):
                want = expected_action(table, req.prompt_labels[p], g) if prefill else Action.H
            else:
                want = expected_action(table, tags[p - len(req.prompt_ids)], g) if decode else Action.H
            assert tiers[p] == int(want), (g, p)


def test_engine_measured_budget_matches_table_prediction(smol, tagged_run):
    """The engine (tags from its own tagger) applies the table: its measured B is the table's cost."""
    from pask.evaluation.run_bfcl import prepare
    from pask.kv.budget import CostModel
    from pask.kv.cache import layer_groups
    from pask.runtime.engine import generate

    case, *_ = tagged_run
    table = mixed_table()
    req, _ = prepare(smol, case, 24, tagging=True)
    (gen,) = generate(smol, [req], policy=PaskPolicy(table))
    n_fed = len(gen.token_ids) - (gen.stop_reason != "eos")
    stored, plen = len(req.prompt_ids) + n_fed, len(req.prompt_ids)
    cm = CostModel(head_dim=64, dtype=torch.float32)
    groups = layer_groups(smol.num_layers, G)
    want = 0.0
    int4_layers = 0  # layers whose INT4 tier was written: each holds a key balance [Hkv, 2, D] fp32
    for g, layers in enumerate(groups):
        acts = set()
        for p in range(stored):
            if p >= stored - 8:
                c = 1.0
            else:
                item = req.prompt_labels[p] if p < plen else gen.extra["tags"][p - plen]
                act = expected_action(table, item, g)
                acts.add(act)
                c = cm.cost(act)
            want += c * len(layers) / smol.num_layers / stored
        int4_layers += len(layers) * (Action.L in acts)
    cfg = smol.model.config
    h_token_bytes = 2 * cfg.num_key_value_heads * 64 * 4 * smol.num_layers  # K and V, fp32, every layer
    want += int4_layers * cfg.num_key_value_heads * 2 * 64 * 4 / (h_token_bytes * stored)
    assert gen.extra["budget"]["b_total"] == pytest.approx(want, abs=1e-4)
    assert want < 0.9
