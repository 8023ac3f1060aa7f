"""Batch invariance in bf16: a request gets the same tokens alone, in static batches of any size and
composition, and under continuous batching (the one decode core, per-row prefills, row-independent
decode linears: pask/cpu/native_gemv.cpp; on CPUs with BF16 arithmetic ``auto`` takes that kernel
too, as PyTorch's bf16 GEMM gives a row different bits in a batch of 6 than alone)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pask.evaluation.continuous import decode_continuous
from pask.policies import get_policy
from pask.runtime.engine import generate
from pask.runtime.models import load_model
from pask.runtime.tokens import Request

PROMPTS = [
    "def add(a, b):\n    return",
    "SELECT name FROM users WHERE",
    "The capital of France is Paris. The capital of Italy is",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "import numpy as np\nx = np.",
    "Once upon a time there was a very small model that",
]


@pytest.fixture(scope="module")
def smol_bf16():
    return load_model("smollm2-135m", dtype=torch.bfloat16)


def _requests(lm, n_tokens: int = 12) -> list[Request]:
    return [Request(lm.tokenizer(p)["input_ids"], max_new_tokens=n_tokens + i) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("policy", [None, "kivi-4", "h2o"])
def test_tokens_do_not_depend_on_the_batch(smol_bf16, policy):
    lm = smol_bf16

    def pol():
        return None if policy is None else get_policy(policy, budget=0.5)

    alone = [generate(lm, [r], policy=pol())[0].token_ids for r in _requests(lm)]
    whole = [g.token_ids for g in generate(lm, _requests(lm), policy=pol())]
    reqs = _requests(lm)
    mixed = [g.token_ids for g in generate(lm, [reqs[4], reqs[1], reqs[5]], policy=pol())]
    cont = decode_continuous(lm, list(enumerate(_requests(lm))), max_batch=4, policy=pol())
    assert whole == alone
    assert mixed == [alone[4], alone[1], alone[5]]
    assert [cont[i].token_ids for i in range(len(PROMPTS))] == alone


@settings(max_examples=12, deadline=None)
@given(k=st.sampled_from([64, 96, 576, 1536]), n=st.integers(1, 70), m=st.integers(2, 16), seed=st.integers(0, 99))
def test_decode_linears_give_a_row_the_same_bits_in_any_batch(k, n, m, seed):
    """The native decode GEMVs (fp32 and, where the CPU has it, bf16 in/out): row i of an m-row
    product equals the row's product alone, bit for bit."""
    from pask.cpu import native_gemv

    if not native_gemv.available():
        pytest.skip(native_gemv.status())
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    kernels = [native_gemv.linear] + ([native_gemv.linear_bf16] if native_gemv.has_bf16_io() else [])
    for f in kernels:
        batch = f(x, w, b)
        for i in range(m):
            assert torch.equal(batch[i], f(x[i : i + 1].contiguous(), w, b)[0]), (f.__name__, i)
