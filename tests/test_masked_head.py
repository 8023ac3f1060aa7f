"""Masked LM head: only the allowed logits are computed; greedy outputs are unchanged."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pask.policies import get_policy
from pask.runtime.engine import generate
from pask.runtime.masked_head import ENV, MaskedHead, allowed_tokens
from pask.structure.constraint import allocate_mask


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 999), max_size=40, unique=True), st.integers(1, 60))
def test_allowed_tokens_unpacks_the_bitmask(ids, limit):
    mask = allocate_mask(1, 1000)
    mask.zero_()
    for t in ids:
        mask[0, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    got = allowed_tokens(mask[0], 1000, limit)
    if len(ids) > limit:
        assert got is None
    else:
        assert got.tolist() == sorted(ids)


@settings(max_examples=60, deadline=None)
@given(
    words=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=12),
    cut=st.integers(0, 31),
    limit=st.integers(1, 400),
)
def test_allowed_tokens_matches_unpacking_every_bit(words, cut, limit):
    """Any words (sign bit included), a vocabulary ending inside the last word: the ids of the set
    bits below the vocabulary, or None past ``limit``."""
    vocab = 32 * len(words) - cut
    row = torch.tensor(words, dtype=torch.int32)
    want = [t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1]
    got = allowed_tokens(row, vocab, limit)
    assert (got is None) == (len(want) > limit)
    if got is not None:
        assert got.dtype == torch.int64 and got.tolist() == want


def test_allowed_tokens_stops_at_the_vocabulary():
    mask = allocate_mask(1, 70)
    mask.fill_(-1)  # every bit set, incl. the padding bits past the vocabulary
    assert allowed_tokens(mask[0], 70, 1000).tolist() == list(range(70))


def test_head_computes_planned_logits_only(smol):
    head = MaskedHead(smol.model)
    try:
        lin = smol.model.get_output_embeddings()
        x = torch.randn(3, 1, lin.in_features)
        full = lin(x)  # no plan: the original head
        head.plan = [torch.tensor([5, 17, 300]), None, torch.empty(0, dtype=torch.long)]
        out = lin(x)
        assert out.shape == full.shape
        torch.testing.assert_close(out[0, 0, [5, 17, 300]], full[0, 0, [5, 17, 300]], atol=1e-5, rtol=1e-5)
        assert torch.isinf(out[0]).sum() == full.shape[-1] - 3
        torch.testing.assert_close(out[1], full[1])
        assert torch.isinf(out[2]).all()
        assert head.plan is None  # one forward per plan
        head.plan = [None, None]  # a plan for another batch size: ignored
        torch.testing.assert_close(lin(x), full)
    finally:
        head.close()
    assert "forward" not in lin.__dict__ and not hasattr(smol.model, "_pask_masked_head")


def test_head_rejects_a_model_without_a_linear_head():
    class M(torch.nn.Module):
        def get_output_embeddings(self):
            return torch.nn.Identity()

    with pytest.raises(TypeError, match=r"nn\.Linear"):
        MaskedHead(M())


@pytest.mark.parametrize("policy", [None, "kivi-4"])
def test_constrained_generation_is_unchanged(smol, monkeypatch, policy):
    """fp32: the same tokens with and without the masked head, Full KV and a tiered policy."""
    from pask.evaluation.run_bfcl import prepare
    from pask.tasks.function_calling import load_cases

    cases = load_cases(["simple", "parallel"], split="test", limit=2)
    runs, counts = [], []
    real_close = MaskedHead.close
    for flag in ("0", "1"):
        monkeypatch.setenv(ENV, flag)
        seen = {}

        def close(self, seen=seen):
            seen["narrow"], seen["full"] = self.narrow_rows, self.full_rows
            real_close(self)

        monkeypatch.setattr(MaskedHead, "close", close)
        reqs = [prepare(smol, c, 32)[0] for c in cases]
        gens = generate(smol, reqs, policy=None if policy is None else get_policy(policy, budget=0.5))
        runs.append([g.token_ids for g in gens])
        counts.append(dict(seen))
    assert runs[0] == runs[1]
    assert counts[0] == {} and counts[1]["narrow"] > counts[1]["full"]
