"""The decode thread: one background thread owns the model and drives the :class:`Scheduler`.

HTTP handlers (asyncio) call :meth:`Worker.open`: the job goes through a thread-safe inbox to the
scheduler, and its tokens and its end come back on an ``asyncio.Queue`` of the handler's loop as
``("token", id)`` and ``("done", job)``. :meth:`Worker.cancel` takes a job out at the next step
boundary. After every step the worker publishes the batch's gauges to :class:`Metrics`.
An exception inside a step ends every job in flight with ``stop = "error"`` (the server answers
500) and the worker goes on with a fresh cache. Should the thread die all the same (an error
outside a step), it fails the jobs in flight on its way out and :attr:`Worker.alive` turns False
(``/health`` answers 503).

The worker knows its open jobs: :meth:`Worker.waiting` counts those not yet admitted into the
running batch (the server's queue limit), and a job cancelled with ``reason="timeout"`` is counted
as ``timeout`` rather than ``cancelled`` in the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import traceback

import torch

from pask.cpu import openmp
from pask.runtime.scheduler import Job, Scheduler
from pask.serving.metrics import Metrics

log = logging.getLogger("pask.serve")
IDLE_WAIT_S = 0.2


class Worker:
    """A daemon thread stepping ``scheduler`` while it has work; see the module docstring."""

    def __init__(self, scheduler: Scheduler, metrics: Metrics | None = None) -> None:
        self.scheduler = scheduler
        self.metrics = metrics or Metrics()
        self.tokenizer_lock = scheduler.tokenizer_lock  # HF tokenizers are not safe across threads
        scheduler.listeners.append(self._finished)
        self._jobs: dict[str, Job] = {}  # open jobs by id (handlers add, the decode thread removes)
        self._timed_out: set[str] = set()
        self._lock = threading.Lock()
        self._inbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pask-decode", daemon=True)
        self._publish()

    def start(self) -> None:
        """Start the decode thread, first ending the OpenMP pool of the calling thread (see :mod:`pask.cpu.openmp`)."""
        openmp.release_pool()
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the current step; jobs still in flight end with an error."""
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.scheduler.fail_all("the server is shutting down")
        self.scheduler.close()

    @property
    def alive(self) -> bool:
        """Whether the decode thread runs (False before :meth:`start`, after :meth:`stop` or its death)."""
        return self._thread.is_alive()

    def waiting(self) -> int:
        """Open jobs not yet admitted into the running batch (thread-safe)."""
        with self._lock:
            return sum(1 for j in self._jobs.values() if not j.t_admit and not j.finished)

    def open_jobs(self) -> int:
        """Jobs submitted and not yet finished (thread-safe)."""
        with self._lock:
            return len(self._jobs)

    # -- from the handlers ----------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._lock:
            self._jobs[job.id] = job
        self._inbox.put(("submit", job))

    def cancel(self, job_id: str, reason: str = "cancelled") -> None:
        """Take a job out at the next step boundary; ``reason`` ``"timeout"`` counts it as a timeout."""
        with self._lock:
            job = self._jobs.get(job_id)
            if reason == "timeout" and job is not None:
                self._timed_out.add(job_id)
        if job is not None:  # read before each prefill: a step admitting many requests skips this one
            job.cancelled = True
        self._inbox.put(("cancel", job_id))

    def open(self, job_id: str, request, policy=None) -> tuple[Job, asyncio.Queue]:
        """Submit an engine request from a coroutine (``policy``: its own, else the scheduler's
        factory makes one); its events arrive on the returned queue."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def post(item) -> None:
            with contextlib.suppress(RuntimeError):  # the handler's loop is gone
                loop.call_soon_threadsafe(events.put_nowait, item)

        job = Job(job_id, request, lambda j, t: post(("token", t)), lambda j: post(("done", j)), policy=policy)
        self.submit(job)
        return job, events

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the thread dies: say so, and end the jobs in flight (handlers answer 500)
            log.critical("the decode thread died:\n%s", traceback.format_exc())
            with contextlib.suppress(Exception):
                self.scheduler.fail_all(f"the decode thread died: {type(e).__name__}: {e}")

    def _loop(self) -> None:
        with torch.inference_mode():
            while not self._stop.is_set():
                self._drain(block=self.scheduler.idle)
                if self._stop.is_set():
                    break
                if not self.scheduler.idle:
                    try:
                        self.scheduler.step()
                    except Exception as e:  # one bad step must not kill the server
                        log.error("decode step failed:\n%s", traceback.format_exc())
                        self.scheduler.fail_all(f"internal error in the decode loop: {type(e).__name__}: {e}")
                self._publish()

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, value) -> None:
        if kind == "submit":
            try:
                self.scheduler.submit(value)
            except Exception as e:  # checked by the handler already; report rather than die
                value.stop, value.error = "error", str(e)
                self._finished(value)
                if value.on_finish is not None:
                    value.on_finish(value)
        elif kind == "cancel":
            self.scheduler.cancel(value)

    def _finished(self, job: Job) -> None:
        """A job ended (scheduler listener): forget it and record it in the metrics."""
        with self._lock:
            self._jobs.pop(job.id, None)
            timed_out = job.id in self._timed_out
            self._timed_out.discard(job.id)
        self.metrics.observe(job, "timeout" if timed_out and job.stop == "cancelled" else None)

    def _publish(self) -> None:
        snap = self.scheduler.snapshot()
        snap["kv_capacity_bytes"] = self.scheduler.capacity.capacity_bytes
        self.metrics.publish(snap)
