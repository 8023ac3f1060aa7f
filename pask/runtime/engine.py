"""Static batches: every request of a batch admitted at once into the one decode core.

:func:`generate` is the entry point of the offline runners' static batching, the calibration
runs and ``pask generate``; it decodes through :meth:`pask.runtime.scheduler.Scheduler.step` like
every other path. :class:`Request` and :class:`Generation` live in :mod:`pask.runtime.tokens`.
"""

from __future__ import annotations

import copy

from pask.kv.cache import CacheConfig
from pask.policies.full import FullPolicy
from pask.runtime.models import LoadedModel
from pask.runtime.scheduler import Job, Scheduler
from pask.runtime.tokens import Generation, Request

__all__ = ["Generation", "Request", "generate", "run_jobs"]


def generate(lm: LoadedModel, requests: list[Request], policy=None, cache_config=None) -> list[Generation]:
    """Greedy-decode a static batch: every request admitted at once, each stopping on grammar
    completion, EOS or length; results in request order.

    One :class:`~pask.runtime.scheduler.Scheduler` step function decodes it, as it decodes
    continuous batches and the server's requests: each prompt is prefilled alone and every row's
    arithmetic is independent of its batch-mates, so a request gets the same tokens in any batch.
    ``policy`` (``None``: Full KV, the ``full`` policy on the tiered cache) is copied for each
    request, so it must be unused.
    """
    if not requests:
        return []
    jobs = run_jobs(lm, [Job(id=str(i), request=r) for i, r in enumerate(requests)], policy, cache_config)
    for job in jobs:
        if job.result is None:
            raise RuntimeError(f"request {job.id} ended without a result ({job.stop}: {job.error})")
    return [job.result for job in jobs]


def run_jobs(
    lm: LoadedModel, jobs: list[Job], policy=None, cache_config=None, max_batch: int | None = None, store=None
) -> list[Job]:
    """Admit ``jobs`` (at most ``max_batch`` running; None: all at once) and decode until every one
    ends; returns them, with their timings (``prefill_ms``, ``step_ms``) and results. ``policy``
    (None: Full KV) is copied for each job; ``store``: a prefill store (None: ``$PASK_PREFILL_STORE``)."""
    base = policy if policy is not None else FullPolicy()
    config = cache_config or CacheConfig()
    batch = max_batch or len(jobs)
    sch = Scheduler(lm, lambda: copy.deepcopy(base), cache_config=config, max_batch=batch, store=store)
    try:
        for job in jobs:
            sch.submit(job)
        sch.run_until_idle()
    finally:
        sch.close()
    return jobs
