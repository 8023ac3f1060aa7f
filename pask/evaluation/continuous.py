"""Continuous batching for the offline task runners: a row leaves the batch when it stops.

Static batches (:func:`pask.runtime.engine.generate`) decode until their longest request stops, so one
request that runs to ``max_new_tokens`` keeps its whole batch stepping (text-to-SQL outputs are
mostly short, a few run to 256 tokens; ``benchmarks/continuous_batching.py`` measures the gain).
Here the waiting requests take the freed rows at the next step boundary instead, through the
serving :class:`~pask.runtime.scheduler.Scheduler` (per-request policy instance, tiered cache row,
grammar and stop condition). Every policy runs on the tiered cache (Full KV as the ``full``
policy), each prompt is prefilled alone (no padding), and results arrive in finishing order.
Greedy decoding does not depend on the batch it runs in (up to floating-point rounding, which in
bf16 can flip a near-tie token), so the accuracy of a run matches static batching's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

from pask.errors import PaskError

if TYPE_CHECKING:  # this module stays light: the sweep and the CLI check ``batching`` before loading torch
    from pask.kv.cache import CacheConfig
    from pask.runtime.engine import Generation, Request
    from pask.runtime.models import LoadedModel

K = TypeVar("K")

BATCHING = ("static", "continuous")  # how the task runners batch their cases


def check_batching(batching: str, name: str = "batching") -> None:
    """:class:`PaskError` unless ``batching`` is one of :data:`BATCHING` (``name``: how the user gave it)."""
    if batching not in BATCHING:
        raise PaskError(f"unknown {name} '{batching}': choose {' or '.join(BATCHING)}")


def decode_continuous(
    lm: LoadedModel,
    items: Iterable[tuple[K, Request]],
    max_batch: int,
    policy=None,
    on_result: Callable[[K, Generation], None] | None = None,
    cache_config: CacheConfig | None = None,
) -> dict[K, Generation]:
    """Greedy-decode ``(key, request)`` items with at most ``max_batch`` running at once.

    ``policy`` is copied (deep) for each request, so it must be unused; ``None`` is Full KV.
    ``on_result(key, generation)`` is called as each request finishes (in finishing order).
    Returns every generation by key.
    """
    from pask.kv.cache import CacheConfig
    from pask.policies.full import FullPolicy
    from pask.runtime.scheduler import Job, Scheduler

    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    base = policy if policy is not None else FullPolicy()
    results: dict[K, Generation] = {}

    def finished(key: K) -> Callable[[Job], None]:
        def done(job: Job) -> None:
            if job.result is None:  # only an error or a cancellation ends a job without a result
                raise RuntimeError(f"request {key!r} ended without a result ({job.stop}: {job.error})")
            results[key] = job.result
            if on_result is not None:
                on_result(key, job.result)

        return done

    sch = Scheduler(lm, lambda: copy.deepcopy(base), cache_config=cache_config or CacheConfig(), max_batch=max_batch)
    try:
        for i, (key, req) in enumerate(items):
            sch.submit(Job(id=str(i), request=req, on_finish=finished(key)))
        sch.run_until_idle()
    finally:
        sch.close()
    return results
