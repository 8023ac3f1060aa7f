"""Masked LM head: only the allowed logits are computed; greedy outputs are unchanged."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pask.policies import get_policy
from pask.runtime.engine import generate
from pask.runtime.masked_head import ENV, MaskedHead, allowed_tokens, head_bytes
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


class _HeadOnly(torch.nn.Module):
    def __init__(self, head: torch.nn.Module) -> None:
        super().__init__()
        self.head = head

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


@pytest.mark.parametrize("quant", [False, True])
def test_head_counts_the_bytes_its_steps_read(quant):
    """What the serving benchmark's bandwidth limit counts for the head: per planned forward, the
    whole weight once if any row is wide, plus each narrow row's gathered rows (a quantised head:
    the blocks of 16 outputs that hold them, codes and scales), plus their biases."""
    from pask.cpu import native_gemv
    from pask.cpu.weights import QuantLinear

    if quant and not native_gemv.available():
        pytest.skip(f"native gemv: {native_gemv.status()}")
    lin = torch.nn.Linear(64, 100, bias=True)
    head = QuantLinear.from_linear(lin.bfloat16(), 8) if quant else lin
    dtype = torch.bfloat16 if quant else torch.float32
    # by hand: fp32 rows of 64 and fp32 biases; or int8 blocks of 16 x 64 codes + 2 x 2 x 16 bf16 scales, bf16 biases
    full = 100 * 64 * 4 + 100 * 4 if not quant else 7 * (16 * 64 + 2 * 2 * 16 * 2) + 100 * 2
    row = 64 * 4 + 4 if not quant else None
    block = 16 * 64 + 2 * 2 * 16 * 2
    mh = MaskedHead(_HeadOnly(head))
    try:
        assert head_bytes(head) == mh.full_bytes == full and mh.bytes_per_step() is None
        x = torch.randn(2, 1, 64).to(dtype)
        head(x)  # no plan (a prefill's forward): not a step
        assert mh.planned == 0 and mh.bytes_read == 0
        mh.plan = [torch.tensor([3, 4, 40]), torch.tensor([7])]  # narrow rows only
        head(x)
        narrow = 4 * row if not quant else 3 * block + 4 * 2  # blocks {0, 2} and {0}; four biases
        assert mh.bytes_read == narrow and mh.planned == 1
        mh.plan = [None, torch.tensor([99])]  # a wide row: the whole weight once, and the narrow row's
        head(x)
        one = row if not quant else block + 2
        assert mh.bytes_read == narrow + full + one
        mh.plan = [None, None]
        head(x)
        assert mh.bytes_read == narrow + 2 * full + one and mh.planned == 3
        assert mh.bytes_per_step() == pytest.approx((narrow + 2 * full + one) / 3)
        mh.reset_counts()
        assert mh.bytes_per_step() is None and mh.narrow_rows == mh.full_rows == mh.bytes_read == 0
    finally:
        mh.close()


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
