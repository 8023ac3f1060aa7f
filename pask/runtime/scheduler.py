"""The decode core: one step function for every decode loop, and continuous batching around it.

:meth:`Scheduler.step` is the only decode loop body in pask. Static evaluation
(:func:`pask.runtime.engine.generate`: a batch admitted at once), continuous evaluation
(:func:`pask.evaluation.continuous.decode_continuous`), calibration's teacher-forced replays
(:func:`pask.runtime.runner.decode_with_policy`: a ``choose`` hook per row) and the server
(:mod:`pask.serving.worker`) all drive it. Requests join and leave the running batch at step
boundaries.

Every request (a :class:`Job`) has its own grammar constraint, tagger, policy instance, stop
condition and row of one running :class:`~pask.kv.cache.TieredCache`. One :meth:`Scheduler.step`:

1. cancelled requests leave (their rows are dropped, their reservations freed);
2. waiting requests are admitted while their KV reservation fits the capacity
   (:mod:`pask.runtime.capacity`): each is prefilled alone into a fresh cache, the policy decides
   its prompt tokens, and its row moves into the running cache (:meth:`TieredCache.adopt`); a
   request cancelled while the ones before it were prefilled is skipped, a running one leaves;
3. every running request takes its next token (greedy under its grammar, or sampled from its own
   seeded stream ``Job.rng``, with the engine's closing phase: :func:`pask.runtime.tokens.pick_tokens`,
   :func:`pask.runtime.tokens.accept_token`);
4. finished requests record their budget and free their rows; the running cache is rebuilt
   without them (:meth:`TieredCache.compacted`, storage moves by reference);
5. one decode forward over the remaining rows, then each request's policy decides the tokens
   that left its recent window. Before the forward each constrained request's grammar mask for
   its next token is computed, so that the LM head computes only the allowed logits of narrow
   rows (:mod:`pask.runtime.masked_head`, as in :func:`pask.runtime.engine.generate`); step 3 reuses the mask.

Full KV is the ``full`` policy (everything H) on the same cache, so every method runs one code
path. A policy instance normally serves one request and sees it as row 0 (``SeqContext.seq``);
a replay may share one instance over its rows (``Job.seq``, distinct among the live jobs). The
policy's per-row state is reset (:meth:`Policy.reset <pask.policies.base.Policy>`) right before
a job's prefill decisions and again when the job is done, so a reused instance holds state for
its live rows only.

Every row's arithmetic is independent of its batch-mates: each prompt is prefilled alone, and the
decode step's linears, attention and LM head compute each row the same way whatever the other
rows are (tests/test_batch_invariance.py), so a case gives the same tokens in a static batch of
any size, under continuous batching and in the server.
The scheduler is single-threaded: :mod:`pask.serving.worker` drives it from one thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pask.errors import PaskError
from pask.kv import stats
from pask.kv.attention import enable_pask_attention
from pask.kv.budget import CostModel
from pask.kv.cache import CacheConfig, TieredCache
from pask.kv.stats import StatsCollector, StatsRequest
from pask.policies.base import Policy, with_key_bits
from pask.runtime.capacity import KVCapacity, kv_bytes_per_token, policy_target_b
from pask.runtime.latent import same_latent, with_latent
from pask.runtime.masked_head import MaskedHead, masked_head_enabled
from pask.runtime.models import LoadedModel
from pask.runtime.prefill_store import PrefillStore
from pask.runtime.session import decide_row, row_budget, run_prefill
from pask.runtime.tokens import (
    Generation,
    Request,
    accept_token,
    closing_tokens,
    eos_ids,
    make_generation,
    new_generator,
    pick_tokens,
    plan_head,
)
from pask.structure.constraint import SchemaError, allocate_mask, grammar_message, ll_tokenizer

STEP_LOG = 4096  # decode-step times kept per batch size (the benchmark's per-batch medians)

SERVE_HEADROOM = 256  # spare slots per tier at first allocation: the decode tokens of a typical call


@dataclass
class Job:
    """One request in the scheduler: its engine :class:`Request`, its policy and its decode state.

    ``on_token(job, token_id)`` and ``on_finish(job)`` are called on the scheduler's thread.
    ``stop`` ends as grammar | eos | length | cancelled | error.
    """

    id: str
    request: Request
    on_token: Callable[[Job, int], None] | None = None
    on_finish: Callable[[Job], None] | None = None
    policy: Policy | None = None  # set at submission (one instance per request), unless preset (MetaKV)
    seq: int = 0  # the row the policy sees (SeqContext.seq); a replay sharing one policy numbers its rows
    choose: Callable[[torch.Tensor], int] | None = None  # overrides the greedy choice (teacher forcing)
    stop_ids: frozenset[int] = frozenset()  # tokens that stop the job and are recorded (replays)
    reserved: int = 0  # KV bytes reserved at admission
    rng: torch.Generator | None = None  # the sampling stream of a request with temperature > 0 (set at submission)
    row: int | None = None  # row in the running cache while running
    generated: list[int] = field(default_factory=list)
    tags: list = field(default_factory=list)
    history: list[int] = field(default_factory=list)  # prompt + tokens fed so far (for the policy)
    decided: int = 0  # positions below this have had their final action
    samples: list[float] = field(default_factory=list)  # measured B after each decode step
    logits: torch.Tensor | None = None  # next-token logits, pending
    next_mask: torch.Tensor | None = None  # grammar mask row for those logits, if computed before the forward
    stop: str | None = None
    cancelled: bool = False
    error: str | None = None
    grammar_error: Exception | None = None  # the request's grammar failed: the job ends with stop "error"
    budget: dict | None = None
    result: Generation | None = None
    t_submit: float = 0.0
    t_admit: float = 0.0
    t_first: float = 0.0  # first token chosen
    t_finish: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0  # wall time of the batched decode steps this job took part in
    decode_steps: int = 0

    @property
    def step_ms(self) -> float:
        """Mean decode-step time of this job's steps (forward + policy; no prefills, no sampling)."""
        return self.decode_ms / self.decode_steps if self.decode_steps else 0.0

    @property
    def finished(self) -> bool:
        return self.stop is not None

    @property
    def tpot_ms(self) -> float:
        """Time per output token after the first (0 with fewer than two tokens)."""
        n = len(self.generated)
        return (self.t_finish - self.t_first) * 1e3 / (n - 1) if n > 1 and self.t_first else 0.0


class Scheduler:
    """Continuous batching of :class:`Job` s over one running TieredCache.

    Parameters
    ----------
    lm : LoadedModel
        The model; its attention is switched to ``"pask"`` until :meth:`close`.
    policy_factory : Callable[[], Policy]
        Builds the policy instance of each request (``FullPolicy`` for Full KV).
    capacity_tokens : int | None
        Logical KV capacity in Full-KV tokens (``None``: unlimited).
    cache_config : CacheConfig | None
        Tiered-cache settings (layer groups, recent window, ...). The default reserves
        :data:`SERVE_HEADROOM` spare slots at each tier's first allocation, so that a long prompt's
        row is not copied to a doubled tier during its first decode steps.
    max_batch : int | None
        At most this many running requests (``None``: the capacity decides alone).
    store : PrefillStore | None
        Reuse stored prompt prefills (:mod:`pask.runtime.prefill_store`; default: ``$PASK_PREFILL_STORE``):
        a prompt seen before is loaded instead of recomputed, and every new prompt is stored.
    keep_last : bool
        Rows that finish in the step that empties the batch keep their storage, so that :attr:`cache`
        shows their final state (replays inspect it); their budgets are recorded all the same.
    """

    def __init__(
        self,
        lm: LoadedModel,
        policy_factory: Callable[[], Policy],
        capacity_tokens: int | None = None,
        cache_config: CacheConfig | None = None,
        max_batch: int | None = None,
        store: PrefillStore | None = None,
        keep_last: bool = False,
    ) -> None:
        self.lm, self.model, self.tok = lm, lm.model, lm.tokenizer
        self.policy_factory = policy_factory
        self.max_batch = max_batch
        self.keep_last = keep_last
        self.store = store if store is not None else PrefillStore.from_env(self.model)
        probe = policy_factory()
        if not isinstance(probe, Policy):
            raise PaskError(
                f"{type(probe).__name__} does not implement the Policy protocol (pask.policies.base.Policy; "
                "inherit pask.policies.base.PolicyBase for its defaults)"
            )
        self.config = with_latent(with_key_bits(cache_config or CacheConfig(headroom=SERVE_HEADROOM), probe), probe, lm)
        if self.config.latent is not None:
            self.store = None  # a stored prefill holds no latents: a latent cache runs its prompts
        self.policy_name = probe.name
        self.needs_tags = probe.needs_tags
        self.stats_request = StatsRequest.of(probe)
        dtype = next(self.model.parameters()).dtype
        per_token = kv_bytes_per_token(self.model.config, dtype)
        self.capacity = KVCapacity(per_token, policy_target_b(probe), capacity_tokens)
        self.max_context = getattr(self.model.config, "max_position_embeddings", None)
        if self.tok is not None:
            self.eos = set(eos_ids(self.tok))
            self.token_bytes = ll_tokenizer(self.tok, sorted(self.eos)).decode_bytes
            self.closers = closing_tokens(self.tok, self.eos)
        else:  # a bare model (replays): no EOS, no grammar, no text
            self.eos, self.token_bytes, self.closers = set(), None, torch.empty(0, dtype=torch.long)
        self.head = MaskedHead(self.model) if masked_head_enabled() else None
        self._prev_attn = enable_pask_attention(self.model)
        self.cache = TieredCache(self.model.config, self.config, batch_size=0)
        spec = self.cache.spec
        self.costs = CostModel(spec.head_dim, self.config.quant_group, dtype, self.config.l2_key_bits)
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []  # running[i] holds row i of the cache
        self.reserved = 0
        self.peak_held_bytes = 0
        self.peak_running = 0
        self.steps = 0
        self.step_log: dict[int, deque[float]] = {}  # batch size -> recent decode-step times (ms)
        self.finished_budget = [0, 0]  # held, full bytes of finished requests at their end
        self.listeners: list[Callable[[Job], None]] = []  # called with every finished job (metrics)
        self.tokenizer_lock = threading.Lock()  # HF tokenizers are not safe across threads: share this lock

    # -- requests -------------------------------------------------------------------------------
    def check(self, prompt_len: int, max_new_tokens: int) -> int:
        """The reservation of a request; CapacityError if it can never be admitted (thread-safe)."""
        from pask.runtime.capacity import CapacityError

        if self.max_context is not None and prompt_len + max_new_tokens > self.max_context:
            raise CapacityError(
                f"prompt of {prompt_len} tokens + max_tokens {max_new_tokens} exceeds the model's "
                f"context of {self.max_context} tokens"
            )
        return self.capacity.check(prompt_len, max_new_tokens)

    def submit(self, job: Job) -> None:
        """Queue a job (FIFO); raises CapacityError if it alone exceeds the capacity."""
        r = job.request
        job.reserved = self.check(len(r.prompt_ids), r.max_new_tokens)
        if job.policy is None:
            job.policy = self.policy_factory()
        else:  # chosen per request (MetaKV): it must run on this scheduler's cache and statistics
            self.check_policy(job.policy)
        if r.sampled and job.rng is None:  # one stream per request, drawn on across its steps
            job.rng = new_generator(r.seed)
        job.history = list(r.prompt_ids)
        job.t_submit = job.t_submit or time.perf_counter()
        self.waiting.append(job)

    def check_policy(self, policy: Policy) -> None:
        """:class:`PaskError` unless ``policy`` runs on this scheduler as built: the same cache layout
        (L2 key width, cold tier), statistics it computes (the same prefill window; step attention,
        value norms, the step scorer only if computed) and tags if it reads them."""
        name = getattr(policy, "name", type(policy).__name__)
        if with_key_bits(self.config, policy) != self.config or not same_latent(self.config, policy):
            raise PaskError(f"policy {name} needs another cache layout than this scheduler's ({self.policy_name})")
        need, have = StatsRequest.of(policy), self.stats_request
        missing = [
            what
            for what, bad in (
                ("its prefill window", need.prefill_window and need.prefill_window != have.prefill_window),
                ("prefill value norms", need.prefill_value_norm and not have.prefill_value_norm),
                ("step attention", need.step_attention and not have.step_attention),
                ("its step scorer", need.step_scorer is not None and need.step_scorer is not have.step_scorer),
                ("tags", policy.needs_tags and not self.needs_tags),
            )
            if bad
        ]
        if missing:
            lacks = ", ".join(missing)
            raise PaskError(f"policy {name} needs {lacks}, which this scheduler ({self.policy_name}) lacks")

    def cancel(self, job_id: str) -> bool:
        """Mark a job cancelled; it leaves at the next step boundary, or before its prefill if it
        still waits (another thread may set ``Job.cancelled`` itself: it is read before each
        prefill and after admission). False if unknown or finished."""
        for job in (*self.waiting, *self.running):
            if job.id == job_id and not job.finished:
                job.cancelled = True
                return True
        return False

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # -- the step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        """One step boundary: cancel, admit, pick one token per running request, retire, decode."""
        self._retire_cancelled()
        self._admit()
        if any(j.cancelled for j in self.running):  # cancelled while the admitted ones were prefilled
            self._retire_cancelled()
        if not self.running:
            return
        jobs = list(self.running)
        logits = torch.stack([j.logits for j in jobs])
        bitmask = allocate_mask(len(jobs), logits.shape[-1])
        for i, job in enumerate(jobs):
            if job.next_mask is not None:
                bitmask[i] = job.next_mask
            elif job.grammar_error is None and job.request.constraint is not None:
                try:  # each row's mask here, so that a failing grammar ends its own job only
                    job.request.constraint.mask(bitmask, i)
                    job.next_mask = bitmask[i]
                except SchemaError as e:
                    job.grammar_error = e
        fresh = [j.next_mask is not None for j in jobs]
        requests = [j.request for j in jobs]
        generated, rngs = [j.generated for j in jobs], [j.rng for j in jobs]
        live = [j.grammar_error is None for j in jobs]
        nxt = pick_tokens(logits, requests, generated, live, bitmask, self.closers, masked=fresh, rngs=rngs)
        for i, job in enumerate(jobs):
            if job.choose is not None and live[i]:
                nxt[i] = job.choose(logits[i])
        now = time.perf_counter()
        for job, t in zip(jobs, nxt, strict=True):
            n = len(job.generated)
            job.next_mask = None
            if job.grammar_error is not None:
                job.stop = "error"
            elif t in job.stop_ids:
                job.generated.append(t)
                job.stop = "stop"
            else:
                try:
                    job.stop = accept_token(job.request, t, job.generated, job.tags, self.eos, self.token_bytes)
                except SchemaError as e:
                    job.grammar_error, job.stop = e, "error"
            if job.grammar_error is not None:
                job.error = f"the request's grammar failed while decoding: {grammar_message(job.grammar_error)}"
            if len(job.generated) > n:
                job.t_first = job.t_first or now
                if job.on_token is not None:
                    job.on_token(job, t)
        keep = self.keep_last and not self.waiting and all(j.stop is not None for j in jobs)
        for job in jobs:
            if job.stop is not None:
                self._finish(job, drop=not keep)
        if keep:  # every row stopped: their storage stays, nothing runs any more
            self.running = []
        self._compact()
        if self.running:
            self._decode()
        self.steps += 1

    def run_until_idle(self, max_steps: int | None = None) -> None:
        """Step until no request waits or runs (tests and offline use)."""
        n = 0
        while not self.idle and (max_steps is None or n < max_steps):
            self.step()
            n += 1

    def close(self) -> None:
        """Give the model back its previous attention implementation and its own LM head."""
        self.model.set_attn_implementation(self._prev_attn)
        if self.head is not None:
            self.head.close()
            self.head = None

    # -- admission and prefill ------------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting:
            if any(j.cancelled for j in self.waiting):  # flagged by a server's handler during earlier prefills
                self._retire_waiting()
                continue
            job = self.waiting[0]
            full = self.max_batch is not None and len(self.running) >= self.max_batch
            if full or (self.running and not self.capacity.fits(self.reserved + job.reserved)):
                return
            self.waiting.popleft()
            self.reserved += job.reserved
            self._prefill(job)

    def _prefill(self, job: Job) -> None:
        """Prefill one request alone into a fresh cache, apply its prompt actions, adopt its row."""
        r = job.request
        job.t_admit = time.perf_counter()
        cache = TieredCache(self.model.config, self.config, batch_size=1)
        req = self.stats_request
        collector, logits = run_prefill(self.model, cache, [r.prompt_ids], req, self.store, keep_stats=req.prefill)
        extra = {}
        if collector is not None:
            extra["prefill_attention"], extra["prefill_value_norm"] = collector.take_prefill(0)
        job.policy.reset(job.seq)  # a fresh row: nothing of an earlier row with this seq
        job.decided = decide_row(
            cache,
            0,
            job.policy.prefill_actions,
            0,
            job.history,
            [],
            r.prompt_labels,
            self.costs,
            extra,
            seq=job.seq,
        )
        job.row = self.cache.adopt(cache, 0)
        job.logits = logits[0]
        job.prefill_ms = (time.perf_counter() - job.t_admit) * 1e3
        self.running.append(job)
        self.peak_running = max(self.peak_running, len(self.running))
        self._track_peak()

    # -- decode ---------------------------------------------------------------------------------
    def _decode(self) -> None:
        """One forward over the running rows; then each policy decides its leaving tokens."""
        t0 = time.perf_counter()
        cache, jobs = self.cache, self.running
        for job in jobs:
            job.history.append(job.generated[-1])
        feed = torch.tensor([[j.generated[-1]] for j in jobs])
        positions = torch.tensor([[cache.seq_length(j.row)] for j in jobs])
        collector = None
        if self.stats_request.step:
            collector = StatsCollector(self.stats_request, cache.spec.num_layers, cache.num_seqs)
            stats.attach(cache, collector)
            collector.begin_step()
        if self.head is not None:
            self._plan_head(jobs)
        out = self.model(input_ids=feed, position_ids=positions, cache=cache, use_cache=True)
        ops: list = []  # every row's actions, applied at once (one native call for the INT4 / INT2 moves)
        for job in jobs:
            extra = {}
            if collector is not None:
                extra["step_attention"], extra["step_scores"] = collector.take_step(job.row)
            labels = job.request.prompt_labels
            job.decided = decide_row(
                cache, job.row, job.policy.step_actions, job.decided, job.history, job.tags, labels,
                self.costs, extra, seq=job.seq, ops=ops,
            )  # fmt: skip
        if ops:
            cache.apply_many(ops)
        for i, job in enumerate(jobs):
            job.samples.append(row_budget(cache, job.row)["b_total"])
            job.logits = out.logits[i, -1]
        if self.keep_last:  # a replay reads the cache's own time-averaged budget at the end
            cache.sample_budget()
        self._track_peak()
        dt = (time.perf_counter() - t0) * 1e3
        self.step_log.setdefault(len(jobs), deque(maxlen=STEP_LOG)).append(dt)
        for job in jobs:
            job.decode_ms += dt
            job.decode_steps += 1

    def _plan_head(self, jobs: list[Job]) -> None:
        """Compute each constrained job's next mask now (:func:`pask.runtime.tokens.plan_head`); keep it for step 3."""
        vocab = self.head.head.out_features
        bitmask = allocate_mask(len(jobs), vocab)
        failed = plan_head(self.head, [j.request for j in jobs], [True] * len(jobs), bitmask, vocab)
        for i, e in failed.items():
            jobs[i].grammar_error = e  # ends at the next step boundary, alone
        for i, job in enumerate(jobs):
            job.next_mask = bitmask[i] if job.request.constraint is not None else None

    def _track_peak(self) -> None:
        self.peak_held_bytes = max(self.peak_held_bytes, self.cache.held_bytes())

    # -- leaving --------------------------------------------------------------------------------
    def _retire_waiting(self) -> None:
        for job in [j for j in self.waiting if j.cancelled]:
            self.waiting.remove(job)
            job.stop = "cancelled"
            self._done(job)

    def _retire_cancelled(self) -> None:
        self._retire_waiting()
        for job in [j for j in self.running if j.cancelled and not j.finished]:
            job.stop = "cancelled"
            self._finish(job)
        self._compact()

    def _finish(self, job: Job, drop: bool = True) -> None:
        """Record the budget of a job that stopped, free its row (unless ``drop`` is False: the
        batch's last rows under ``keep_last``) and its reservation."""
        b = row_budget(self.cache, job.row)
        b["b_total_avg"] = sum(job.samples) / len(job.samples) if job.samples else b["b_total"]
        job.budget = {k: round(v, 5) if isinstance(v, float) else v for k, v in b.items()}
        if counters := job.policy.report(job.seq):  # e.g. KVFetch's channel: fires, fetched tokens
            job.budget["policy"] = counters
        held, full = self.cache._seq_bytes(job.row)
        self.finished_budget[0] += sum(held)
        self.finished_budget[1] += sum(full)
        if drop:
            self.cache.drop(job.row)
        self.reserved -= job.reserved
        job.logits = None
        self._done(job)

    def _done(self, job: Job) -> None:
        job.t_finish = time.perf_counter()
        job.policy.reset(job.seq)  # its row is decided no more: drop the policy's state of it
        if job.stop not in ("cancelled", "error") and self.tok is not None:
            with self.tokenizer_lock:
                job.result = make_generation(
                    self.tok, job.request, job.generated, job.tags, job.stop, job.prefill_ms, job.tpot_ms, job.budget
                )
        for listener in self.listeners:
            listener(job)
        if job.on_finish is not None:
            job.on_finish(job)

    def _compact(self) -> None:
        """Rebuild the running cache without dropped rows (storage moves by reference)."""
        if not any(self.cache.dropped):
            return
        self.cache, rows = self.cache.compacted()
        self.running = [j for j in self.running if j.row in rows and not j.finished]
        for job in self.running:
            job.row = rows[job.row]

    def fail_all(self, message: str) -> None:
        """End every job with ``stop = "error"`` (after an exception in a step) and start a fresh cache."""
        for job in [*self.running, *self.waiting]:
            if not job.finished:
                job.stop, job.error = "error", message
                job.t_finish = time.perf_counter()
                for listener in self.listeners:
                    listener(job)
                if job.on_finish is not None:
                    job.on_finish(job)
        self.running, self.waiting, self.reserved = [], deque(), 0
        if self.head is not None:
            self.head.plan = None  # a plan left by a forward that failed serves nothing
        self.cache = TieredCache(self.model.config, self.config, batch_size=0)

    # -- state ----------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Gauges of the running batch (read by metrics; call from the scheduler's thread)."""
        held, full = self.cache.budget_bytes(live_only=True)
        fh, ff = self.finished_budget
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_bytes_held": self.cache.held_bytes(),
            "kv_bytes_full": sum(full),
            "kv_bytes_peak": self.peak_held_bytes,
            "peak_running": self.peak_running,
            "kv_bytes_reserved": self.reserved,
            "b_live": sum(held) / sum(full) if sum(full) else None,
            "b_finished": fh / ff if ff else None,
        }
