"""Prefill + greedy decode of a batch with a TieredCache, applying a policy's actions.

Rows are left-padded for the prefill (pads are not stored); each decode step feeds one token
per row with explicit ``position_ids`` (``cache.seq_length(row)``). A row that finishes while
others go on is dropped from the cache (its bytes are freed; the budget keeps its final
numbers) and fed a dummy token whose output is ignored. When the last rows finish nothing is
dropped, so the returned cache still shows the final state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from pask.kv.budget import Budget
from pask.kv.cache import CacheConfig, TieredCache
from pask.kv.session import TieredSession, left_pad
from pask.policies.base import Policy

__all__ = ["DecodeResult", "decode_with_policy", "left_pad"]

NextTokenFn = Callable[[int, torch.Tensor], int]  # (row, logits [V]) -> token id


@dataclass
class DecodeResult:
    """Generated tokens per row, the cache and its budget (and per-step logits if kept)."""

    tokens: list[list[int]]
    cache: TieredCache
    budget: Budget
    logits: list[torch.Tensor] = field(default_factory=list)  # step -> [B, V] (prefill first)


def decode_with_policy(
    model: torch.nn.Module,
    input_ids_list: list[list[int]],
    policy: Policy,
    max_new_tokens: int,
    cache_config: CacheConfig | None = None,
    next_token_fn: NextTokenFn | None = None,
    *,
    stop_token_ids: Iterable[int] = (),
    pad_token_id: int = 0,
    keep_logits: bool = False,
) -> DecodeResult:
    """Prefill ``input_ids_list`` as one batch, then decode up to ``max_new_tokens`` per row.

    The same :class:`TieredSession` the engine uses, without constraints: for tests that need
    every step's logits or a custom next-token rule.
    """
    from pask.engine import Request

    stops = set(stop_token_ids)
    pick = next_token_fn or (lambda row, logits: int(logits.argmax()))
    rows = len(input_ids_list)
    generated: list[list[int]] = [[] for _ in range(rows)]
    kept: list[torch.Tensor] = []
    session = TieredSession(model, policy, cache_config)
    with torch.no_grad():
        try:
            logits = session.prefill([Request(list(r)) for r in input_ids_list])
            live = list(range(rows))
            while live:
                if keep_logits:
                    kept.append(logits.float().clone())
                done = []
                for row in live:
                    tok = pick(row, logits[row])
                    generated[row].append(tok)
                    if tok in stops or len(generated[row]) >= max_new_tokens:
                        done.append(row)
                live = [r for r in live if r not in done]
                if not live:  # the last rows stay in the cache, which shows the final state
                    break
                for row in done:  # rows finished while others go on are freed
                    session.finish(row)
                logits = session.step([generated[r][-1] if r in live else None for r in range(rows)], [[]] * rows)
        finally:
            session.close()
    return DecodeResult(tokens=generated, cache=session.cache, budget=session.cache.budget(), logits=kept)
