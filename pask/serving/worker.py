"""The decode thread: one background thread owns the model and drives the :class:`Scheduler`.

HTTP handlers (asyncio) call :meth:`Worker.open`: the job goes through a thread-safe inbox to the
scheduler, and its tokens and its end come back on an ``asyncio.Queue`` of the handler's loop as
``("token", id)`` and ``("done", job)``. :meth:`Worker.cancel` takes a job out at the next step
boundary. After every step the worker publishes the batch's gauges to :class:`Metrics`.
An exception inside a step ends every job in flight with ``stop = "error"`` (the server answers
500) and the worker goes on with a fresh cache.
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
        scheduler.listeners.append(self.metrics.observe)
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

    # -- from the handlers ----------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        self._inbox.put(("submit", job))

    def cancel(self, job_id: str) -> None:
        self._inbox.put(("cancel", job_id))

    def open(self, job_id: str, request) -> tuple[Job, asyncio.Queue]:
        """Submit an engine request from a coroutine; its events arrive on the returned queue."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def post(item) -> None:
            with contextlib.suppress(RuntimeError):  # the handler's loop is gone
                loop.call_soon_threadsafe(events.put_nowait, item)

        job = Job(job_id, request, on_token=lambda j, t: post(("token", t)), on_finish=lambda j: post(("done", j)))
        self.submit(job)
        return job, events

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
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
                if value.on_finish is not None:
                    value.on_finish(value)
        elif kind == "cancel":
            self.scheduler.cancel(value)

    def _publish(self) -> None:
        snap = self.scheduler.snapshot()
        snap["kv_capacity_bytes"] = self.scheduler.capacity.capacity_bytes
        self.metrics.publish(snap)
