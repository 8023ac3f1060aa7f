"""Teacher-forced and custom-rule replays through the one decode core (calibration, tests).

:func:`decode_with_policy` prefills each row alone and decodes up to ``max_new_tokens`` per row with
:meth:`pask.runtime.scheduler.Scheduler.step`, like every other decode path; a ``next_token_fn``
replaces the greedy choice (teacher forcing), one policy instance is shared by the rows (it sees
row ``r`` as ``SeqContext.seq == r``; the scheduler calls ``policy.reset(r)`` before row ``r``'s
prefill decisions and when the row finishes, so an instance reused over many replays keeps no
state of earlier ones). Rows that finish while others go on are dropped (their
bytes are freed; the budget keeps their final numbers); the rows that finish last stay in the
returned cache, which shows their final state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from pask.kv.budget import Budget
from pask.kv.cache import CacheConfig, TieredCache
from pask.policies.base import Policy
from pask.runtime.scheduler import Job, Scheduler
from pask.runtime.session import left_pad
from pask.runtime.tokens import Request

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
    """Decode ``input_ids_list`` (all rows admitted at once) up to ``max_new_tokens`` per row.

    ``next_token_fn(row, logits)`` picks each token (default: greedy); a token in
    ``stop_token_ids`` is recorded and stops its row. ``keep_logits``: every step's logits
    ``[rows, V]`` (rows that have stopped read 0). ``pad_token_id`` is unused (nothing is padded).
    """
    del pad_token_id
    stops = frozenset(stop_token_ids)
    rows = len(input_ids_list)
    kept: list[torch.Tensor] = []

    def chooser(row: int) -> Callable[[torch.Tensor], int]:
        def choose(logits: torch.Tensor) -> int:
            step = len(jobs[row].generated)
            if keep_logits:
                if step == len(kept):
                    kept.append(torch.zeros(rows, logits.shape[-1]))
                kept[step][row] = logits.float()
            return next_token_fn(row, logits) if next_token_fn is not None else int(logits.argmax())

        return choose

    jobs = [
        Job(
            id=str(r),
            request=Request(list(ids), max_new_tokens=max_new_tokens),
            seq=r,
            choose=chooser(r),
            stop_ids=stops,
        )
        for r, ids in enumerate(input_ids_list)
    ]
    lm = SimpleNamespace(model=model, tokenizer=None)
    sch = Scheduler(lm, lambda: policy, cache_config=cache_config or CacheConfig(), keep_last=True)
    with torch.no_grad():
        try:
            for job in jobs:
                sch.submit(job)
            sch.run_until_idle()
        finally:
            sch.close()
    return DecodeResult(tokens=[j.generated for j in jobs], cache=sch.cache, budget=sch.cache.budget(), logits=kept)
