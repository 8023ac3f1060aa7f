"""Grammar constraint: llguidance behind four verbs (mask, consume, is_done, rollback)."""

from __future__ import annotations

import json
import math
import re
from functools import lru_cache

import llguidance
import llguidance.hf
import llguidance.torch as llt
import torch

from pask.errors import PaskError

# Separators the model's own tool-call format uses (Python json.dumps defaults).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class SchemaError(PaskError):
    """The grammar or schema of one request cannot be compiled or satisfied."""


_AT = re.compile(r"^at \d+\(\d+\): ")  # llguidance's source position


def grammar_message(error: Exception) -> str:
    """llguidance's message without its internal state: the first line, no source position, at most
    300 characters (what a client may be told about its grammar)."""
    text = str(error).split("<state>")[0].strip()
    first = text.splitlines()[0] if text else "unknown error"
    for prefix in ("grammar error: ", "failed to compile JSON schema: "):
        first = first.removeprefix(prefix)
    first = _AT.sub("", first)
    for prefix in ("grammar error: ", "failed to compile JSON schema: "):
        first = first.removeprefix(prefix)
    first = re.sub(r"\s*\(at \d+\(\d+\)\)$", "", first).strip()
    return first if len(first) <= 300 else first[:297] + "..."


@lru_cache(maxsize=8)
def _ll_tokenizer_cached(tok_id: int, tokenizer: object, eos: tuple[int, ...]) -> llguidance.LLTokenizer:
    return llguidance.hf.from_tokenizer(tokenizer, eos_token=list(eos))


def ll_tokenizer(tokenizer: object, eos_ids: list[int]) -> llguidance.LLTokenizer:
    """The llguidance view of a Hugging Face tokenizer (built once per tokenizer)."""
    return _ll_tokenizer_cached(id(tokenizer), tokenizer, tuple(eos_ids))


def lark_json(schema: dict) -> str:
    """Embed a JSON schema into a lark grammar with the model's separators."""
    s = dict(schema)
    s["x-guidance"] = JSON_STYLE
    return "%json " + json.dumps(s)


class Constraint:
    """An llguidance matcher for one request.

    ``mask`` writes the legal-token bitmask of the next step, ``consume`` advances
    on an accepted token, ``is_done`` says the grammar cannot continue or may stop,
    ``rollback`` undoes the last ``n`` tokens.
    """

    def __init__(self, ll_tok: llguidance.LLTokenizer, lark: str) -> None:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        msg = llguidance.LLMatcher.validate_grammar(grammar, ll_tok)
        if msg:
            raise SchemaError(msg.strip().splitlines()[0].removeprefix("at 1(8): "))
        self._m = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
        if self._m.is_error():
            raise SchemaError(f"grammar error: {self._m.get_error()}")
        self.vocab_size = ll_tok.vocab_size

    def mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Fill ``bitmask[row]`` (from :func:`allocate_mask`) with the legal next tokens."""
        llt.fill_next_token_bitmask(self._m, bitmask, row)
        if self._m.is_error():
            raise SchemaError(f"grammar error: {self._m.get_error()}")

    def consume(self, token: int) -> None:
        if not self._m.consume_token(token):
            raise SchemaError(f"token {token} rejected: {self._m.get_error()}")

    def is_done(self) -> bool:
        return self._m.is_stopped()

    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    def rollback(self, n: int) -> None:
        self._m.rollback(n)


def allocate_mask(batch: int, vocab_size: int) -> torch.Tensor:
    return llt.allocate_token_bitmask(batch, vocab_size)


_BITS = torch.arange(32, dtype=torch.int32)


def apply_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set illegal logits to -inf in place (``logits``: [batch, vocab] or one row [vocab], float;
    ``bitmask`` its rows from :func:`allocate_mask`: bit ``t % 32`` of word ``t // 32`` allows token
    ``t``; tokens past the mask's words are illegal). What llguidance's ``apply_token_bitmask_inplace``
    does, in plain tensor ops: its kernel is ``torch.compile``d and compiled (~3 s) on its first call
    and on each new batch shape, a stall inside a decode step."""
    rows = logits if logits.dim() == 2 else logits.unsqueeze(0)
    words = bitmask if bitmask.dim() == 2 else bitmask.unsqueeze(0)
    if words.shape[0] != rows.shape[0]:
        raise ValueError(f"mask rows {words.shape[0]} != logits rows {rows.shape[0]}")
    bits = ((words.unsqueeze(-1) >> _BITS) & 1).reshape(words.shape[0], -1)
    vocab, covered = rows.shape[1], bits.shape[1]
    if covered < vocab:
        rows[:, covered:] = -math.inf
    rows[:, : min(covered, vocab)].masked_fill_(bits[:, :vocab] == 0, -math.inf)
