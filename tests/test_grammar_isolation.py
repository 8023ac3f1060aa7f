"""A grammar that fails while decoding ends its own job only (issue 27): the batch-mates decode on
to the tokens they get alone, and the failed job's message carries no llguidance internals."""

from __future__ import annotations

import pytest

from pask.policies.full import FullPolicy
from pask.runtime.engine import generate
from pask.runtime.scheduler import Job, Scheduler
from pask.runtime.tokens import Request, eos_ids
from pask.structure.constraint import Constraint, SchemaError, lark_json, ll_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
INTERNALS = "grammar error: at 4(7): lexer failed <state>\nstack: [0x7f, 12, 13]\n</state>"


class Breaking(Constraint):
    """A JSON constraint whose ``mask`` (or ``consume``) fails from its ``after``-th call on."""

    def __init__(self, llt, grammar: str, after: int, where: str) -> None:
        super().__init__(llt, grammar)
        self.calls, self.after, self.where = 0, after, where

    def _tick(self, where: str) -> None:
        if where == self.where:
            self.calls += 1
            if self.calls > self.after:
                raise SchemaError(INTERNALS)

    def mask(self, bitmask, row: int) -> None:
        self._tick("mask")
        super().mask(bitmask, row)

    def consume(self, token: int) -> None:
        self._tick("consume")
        super().consume(token)


def _requests(lm, bad: Constraint | None = None) -> list[Request]:
    tok = lm.tokenizer
    llt = ll_tokenizer(tok, eos_ids(tok))
    grammar = "start: " + lark_json(SCHEMA)

    def chat(text: str) -> list[int]:
        msgs = [{"role": "user", "content": text}]
        return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)

    good = [
        Request(chat("A person as JSON."), Constraint(llt, grammar), max_new_tokens=24, close_margin=8),
        Request(chat("Tell me a story."), max_new_tokens=12),
    ]
    if bad is None:
        return good
    return [good[0], Request(chat("Another person as JSON."), bad, max_new_tokens=24, close_margin=8), good[1]]


@pytest.mark.parametrize("where", ["mask", "consume"])
def test_a_failing_grammar_ends_only_its_own_job(smol, where):
    alone = [g.token_ids for g in generate(smol, _requests(smol))]
    llt = ll_tokenizer(smol.tokenizer, eos_ids(smol.tokenizer))
    bad = Breaking(llt, "start: " + lark_json(SCHEMA), after=3, where=where)
    sch = Scheduler(smol, FullPolicy)
    try:
        jobs = [Job(str(i), r) for i, r in enumerate(_requests(smol, bad))]
        for j in jobs:
            sch.submit(j)
        sch.run_until_idle()
        assert sch.idle and sch.cache.held_bytes() == 0  # every row left, the failed one too
    finally:
        sch.close()
    good, failed, story = jobs
    assert failed.stop == "error" and failed.result is None
    assert failed.error.startswith("the request's grammar failed while decoding: ")
    assert "<state>" not in failed.error and "0x7f" not in failed.error and "at 4(7)" not in failed.error
    assert good.stop != "error" and story.stop != "error"
    assert [good.generated, story.generated] == alone  # the batch-mates never noticed
