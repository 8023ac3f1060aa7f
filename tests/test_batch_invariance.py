"""Batch invariance in bf16: a request gets the same tokens alone, in static batches of any size and
composition, and under continuous batching (the one decode core, per-row prefills, row-independent
decode linears: pask/cpu/native_gemv.cpp)."""

from __future__ import annotations

import pytest
import torch

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


KNOWN = pytest.mark.xfail(
    strict=True,
    reason="issue 26, open: with an INT4 tier (KIVI-4) one of the six rows decodes differently in a batch "
    "than alone; the source in the INT4 path (bulk quantiser, key balance or the attention kernel's "
    "INT4 tier) is not found yet. Full KV is batch-invariant.",
)


@pytest.mark.parametrize("policy", [None, pytest.param("kivi-4", marks=KNOWN)])
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
