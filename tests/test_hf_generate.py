"""pask.kv_policy: Hugging Face ``model.generate`` on the tiered cache under a KV policy (issue 26)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pask
from pask.errors import PaskError
from pask.hf import KVPolicy, kv_policy, left_pad_lengths
from pask.kv.actions import Action
from pask.policies.table import FrozenTable

PROMPTS = ["The capital of France is", "Write a short poem about the sea and the sky at night:"]
N = 12  # new tokens per generation: enough to pass the recent window (8) and take step actions


def _new(out: torch.Tensor, width: int) -> list[list[int]]:
    return out[:, width:].tolist()


def _generate(lm, text, **kw) -> list[int]:
    enc = lm.tokenizer(text, return_tensors="pt")
    out = lm.model.generate(**enc, max_new_tokens=N, do_sample=False, **kw)
    return _new(out, enc.input_ids.shape[1])[0]


def _hooks(model) -> tuple[int, int]:
    return len(model._forward_pre_hooks), len(model._forward_hooks)


@pytest.fixture
def batch(smol):
    tok = smol.tokenizer
    side, tok.padding_side = tok.padding_side, "left"
    try:
        yield tok(PROMPTS, return_tensors="pt", padding=True)
    finally:
        tok.padding_side = side


def test_full_kv_gives_exactly_the_tokens_of_plain_generate(smol):
    want = _generate(smol, PROMPTS[1])
    with pask.kv_policy(smol.model, "full") as kv:
        assert smol.model.config._attn_implementation == "pask"
        got = _generate(smol, PROMPTS[1], cache=kv.cache)
    assert got == want
    assert kv.budget == 1.0
    (row,) = kv.row_budgets
    assert row["b_prompt"] == row["b_decode"] == row["b_total_avg"] == 1.0
    assert kv.cache.held_bytes() == kv.cache.full_bytes()


def test_kivi_meets_its_budget_with_real_bytes(smol):
    enc = smol.tokenizer(PROMPTS[1], return_tensors="pt")
    with pask.kv_policy(smol, "kivi-4", budget=0.5) as kv:  # pask.load's result works as well
        smol.model.generate(**enc, cache=kv.cache, max_new_tokens=3 * N, do_sample=False)
    assert kv.budget is not None and 0.35 < kv.budget < 0.65
    (row,) = kv.row_budgets
    assert row["b_total"] == kv.budget and row["b_prompt"] < row["b_total"] < 1
    cache = kv.cache
    assert 0 < cache.held_bytes() < cache.full_bytes()
    assert row["held_bytes"] == cache.held_bytes()
    tiers = torch.stack([cache.tiers(0, g) for g in range(len(cache.groups))])
    assert (tiers == int(Action.L)).any() and not (tiers == int(Action.R)).any()  # quantised, nothing released
    assert (tiers[:, -cache.config.recent_window :] == int(Action.H)).all()


@pytest.mark.parametrize("policy", ["full", "kivi-4"])
def test_batched_left_padded_rows_match_each_prompt_alone(smol, batch, policy):
    budget = None if policy == "full" else 0.5
    alone = []
    for text in PROMPTS:
        with kv_policy(smol.model, policy, budget) as kv:
            alone.append(_generate(smol, text, cache=kv.cache))
    if policy == "full":
        assert alone == [_generate(smol, text) for text in PROMPTS]
    width = batch.input_ids.shape[1]
    assert batch.attention_mask[0, 0] == 0  # the short prompt is left-padded
    with kv_policy(smol.model, policy, budget) as kv:
        out = smol.model.generate(**batch, cache=kv.cache, max_new_tokens=N, do_sample=False)
    assert _new(out, width) == alone
    assert kv.cache.num_seqs == 2
    assert [kv.cache.prompt_length(b) for b in range(2)] == batch.attention_mask.sum(dim=1).tolist()
    assert len(kv.row_budgets) == 2


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.integers(200, 20000), min_size=1, max_size=14), min_size=2, max_size=3))
def test_full_kv_batches_of_token_prompts_match_plain_generate_alone(smol, prompts):
    model, steps = smol.model, 6
    pad = smol.tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    alone = []
    for p in prompts:
        out = model.generate(input_ids=torch.tensor([p]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
        alone.append(out[0, len(p) :].tolist())
    with kv_policy(model, "full") as kv:
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            cache=kv.cache,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
        )
    assert _new(out, width) == alone
    assert [kv.cache.prompt_length(b) for b in range(len(prompts))] == [len(p) for p in prompts]


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])  # prefill statistics / step statistics
def test_policies_that_read_attention_statistics(smol, batch, policy):
    with kv_policy(smol.model, policy, 0.33) as kv:
        smol.model.generate(**batch, cache=kv.cache, max_new_tokens=N, do_sample=False)
    assert all(r["b_total"] < 0.6 for r in kv.row_budgets)
    tiers = torch.stack([kv.cache.tiers(0, g) for g in range(len(kv.cache.groups))])
    assert (tiers == int(Action.R)).any()


def test_restored_after_the_block_and_after_an_exception(smol):
    model = smol.model
    prev, hooks = model.config._attn_implementation, _hooks(model)
    with kv_policy(model, "full") as kv:
        assert _hooks(model) == (hooks[0] + 1, hooks[1] + 1)
        assert "active" in repr(kv)
    assert (model.config._attn_implementation, _hooks(model)) == (prev, hooks)
    with pytest.raises(ValueError, match="inside"), kv_policy(model, "kivi-4", 0.5):
        raise ValueError("inside")
    assert (model.config._attn_implementation, _hooks(model)) == (prev, hooks)
    enc = smol.tokenizer(PROMPTS[0], return_tensors="pt")
    with pytest.raises(PaskError, match=r"cache=kv\.cache"), kv_policy(model, "full"):
        model.generate(**enc, max_new_tokens=2, do_sample=False)  # forgot the cache: raised in the hook
    assert (model.config._attn_implementation, _hooks(model)) == (prev, hooks)
    assert _generate(smol, PROMPTS[0])  # the model works as before


def test_one_cache_per_generate_call(smol):
    enc = smol.tokenizer(PROMPTS[0], return_tensors="pt")
    with kv_policy(smol.model, "full") as kv:
        first = kv.cache
        a = smol.model.generate(**enc, cache=kv.cache, max_new_tokens=4, do_sample=False)
        with pytest.raises(PaskError, match="new_cache"):
            smol.model.generate(**enc, cache=kv.cache, max_new_tokens=4, do_sample=False)
        b = smol.model.generate(**enc, cache=kv.new_cache(), max_new_tokens=4, do_sample=False)
    assert kv.cache is not first and torch.equal(a, b)
    assert kv.new_cache() is kv.cache and kv.budget is None and kv.row_budgets == []


def test_pask_policy_needs_a_table_and_is_refused_without_tags(smol, tmp_path):
    with pytest.raises(PaskError, match="table=PATH"):
        kv_policy(smol, "pask", budget=0.5)  # no committed table for smollm2
    with pytest.raises(PaskError, match="needs a budget"):
        kv_policy(smol, "pask")
    path = FrozenTable({}, smol.fingerprint, target_b=0.5, default_action="L").save(tmp_path / "t.json")
    with pytest.raises(PaskError, match="untagged=True"):
        kv_policy(smol, "pask", budget=0.5, table=path)
    other = FrozenTable({}, "llama-L1-H1:0", target_b=0.5).save(tmp_path / "other.json")
    with pytest.raises(PaskError, match="calibrated on model"):
        kv_policy(smol, "pask", budget=0.5, table=other)
    enc = smol.tokenizer(PROMPTS[1], return_tensors="pt")
    with kv_policy(smol, "pask", budget=0.5, table=path, untagged=True) as kv:  # every token: the default (L)
        smol.model.generate(**enc, cache=kv.cache, max_new_tokens=N, do_sample=False)
    assert kv.budget < 0.6


def test_a_policy_object_is_accepted(smol):
    from pask.policies.kivi import KIVIPolicy

    kv = kv_policy(smol.model, KIVIPolicy(0.5, bits=2))
    assert isinstance(kv, KVPolicy) and kv.policy_name == "kivi-2"
    with pytest.raises(PaskError, match="constructor"):
        kv_policy(smol.model, KIVIPolicy(0.5), budget=0.5)
    with pytest.raises(PaskError, match="prefill_actions"):
        kv_policy(smol.model, object())


def test_a_policy_object_sees_each_row_with_its_token_history(smol, batch):
    from pask.policies.full import FullPolicy

    class Recording(FullPolicy):
        def __init__(self):
            self.calls, self.resets = [], []

        def reset(self, seq):
            self.resets.append(seq)

        def prefill_actions(self, ctx):
            self.calls.append(("prefill", ctx.seq, ctx.prompt_len, list(ctx.token_ids)))
            return []

        def step_actions(self, ctx):
            self.calls.append(("step", ctx.seq, ctx.length, list(ctx.token_ids)))
            return []

    pol = Recording()
    width = batch.input_ids.shape[1]
    with kv_policy(smol.model, pol) as kv:
        out = smol.model.generate(**batch, cache=kv.cache, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        assert pol.resets == [0, 1]  # before each row's prefill decisions
    assert pol.resets == [0, 1, 0, 1]  # and when the block ends
    prompts = [ids[m.bool()].tolist() for ids, m in zip(batch.input_ids, batch.attention_mask, strict=True)]
    assert pol.calls[:2] == [("prefill", b, len(p), p) for b, p in enumerate(prompts)]
    fed = out[:, width:].tolist()
    steps = pol.calls[2:]
    assert [c[:2] for c in steps] == [("step", 0), ("step", 1)] * 2  # the last token is never fed
    for i, (_, b, length, history) in enumerate(steps):
        n = i // 2 + 1
        assert history == prompts[b] + fed[b][:n] and length == len(prompts[b]) + n


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("nosuch", 0.5), {}, "unknown policy 'nosuch'"),
        (("kivi-4", 0.0), {}, r"budget must be in \(0, 1\]"),
        (("kivi-4", 1.5), {}, r"budget must be in \(0, 1\]"),
        (("full", 0.5), {}, "keeps every token"),
        (("kivi-4", 0.5), {"table": "t.json"}, "table= is for policy 'pask'"),
    ],
)
def test_bad_arguments_are_clear_errors(smol, args, kwargs, message):
    with pytest.raises(PaskError, match=message):
        kv_policy(smol.model, *args, **kwargs)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True), st.just(float("nan"))))
def test_any_budget_outside_0_1_is_refused(smol, budget):
    with pytest.raises(PaskError, match="budget"):
        kv_policy(smol.model, "kivi-4", budget)


def test_models_the_pask_attention_cannot_serve_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel, MambaConfig, MambaForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0))
    with pytest.raises(PaskError, match="num_key_value_heads"):
        kv_policy(gpt2, "full")
    mamba = MambaForCausalLM(MambaConfig(num_hidden_layers=1, hidden_size=16, vocab_size=64))
    with pytest.raises(PaskError, match="AttentionInterface"):
        kv_policy(mamba, "full")
    with pytest.raises(PaskError, match="causal LM"):
        kv_policy("smollm2-135m", "full")


def test_right_padding_is_refused(smol):
    tok = smol.tokenizer
    side, tok.padding_side = tok.padding_side, "right"
    try:
        enc = tok(PROMPTS, return_tensors="pt", padding=True)
    finally:
        tok.padding_side = side
    with pytest.raises(PaskError, match="left-padded"), kv_policy(smol.model, "full") as kv:
        smol.model(**enc, cache=kv.cache)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 6)), min_size=1, max_size=5), st.integers(0, 3))
def test_left_pad_lengths(rows, extra):
    width = max(p + n for p, n in rows) + extra
    pads = [width - n for _, n in rows]
    mask = torch.tensor([[0] * p + [1] * (width - p) for p in pads])
    assert left_pad_lengths(mask, len(rows), width) == pads
    assert left_pad_lengths(None, len(rows), width) == [0] * len(rows)
    bad = mask.clone()
    bad[0] = bad[0].flip(0)  # right padding (or, with no pad, an unchanged row)
    if pads[0]:
        with pytest.raises(PaskError, match=r"row 0 .* not left-padded"):
            left_pad_lengths(bad, len(rows), width)
    empty = mask.clone()
    empty[-1] = 0
    with pytest.raises(PaskError, match="no token"):
        left_pad_lengths(empty, len(rows), width)
    with pytest.raises(PaskError, match="2-D attention_mask"):
        left_pad_lengths(mask[:, None], len(rows), width)


def test_lazy_exports():
    import pask.hf

    assert pask.kv_policy is pask.hf.kv_policy and pask.KVPolicy is pask.hf.KVPolicy
