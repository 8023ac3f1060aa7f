"""Server metrics: counters and gauges, rendered in the Prometheus text format (``GET /metrics``).

The scheduler's thread records finished requests (:meth:`Metrics.observe`) and publishes the
gauges of the running batch after every step (:meth:`Metrics.publish`); HTTP handlers count
refused requests and render. One lock guards everything.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

THROUGHPUT_WINDOW_S = 60.0  # generated tokens per second over the last minute


@dataclass
class Metrics:
    """Counters since start, the last published gauges and a sliding window of generated tokens."""

    model: str = ""
    policy: str = ""
    # by outcome: ok | cancelled | timeout | error | rejected | unauthorized | overloaded | unavailable
    requests: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tpot_sum_s: float = 0.0
    tpot_count: int = 0
    ttft_sum_s: float = 0.0
    ttft_count: int = 0
    gauges: dict[str, float | None] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    _recent: deque = field(default_factory=deque, repr=False)  # (time, tokens) of finished requests
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, outcome: str) -> None:
        with self._lock:
            self.requests[outcome] = self.requests.get(outcome, 0) + 1

    def observe(self, job, outcome: str | None = None) -> None:
        """Record a finished :class:`~pask.runtime.scheduler.Job` (``outcome``: instead of the one its stop implies)."""
        outcome = outcome or ("ok" if job.stop not in ("cancelled", "error") else job.stop)
        n = len(job.generated)
        with self._lock:
            self.requests[outcome] = self.requests.get(outcome, 0) + 1
            self.prompt_tokens += len(job.request.prompt_ids)
            self.completion_tokens += n
            if n > 1 and job.t_first:
                self.tpot_sum_s += job.tpot_ms / 1e3
                self.tpot_count += 1
            if job.t_first and job.t_submit:
                self.ttft_sum_s += job.t_first - job.t_submit
                self.ttft_count += 1
            now = time.monotonic()
            self._recent.append((now, n))
            while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
                self._recent.popleft()

    def publish(self, gauges: dict[str, float | None]) -> None:
        with self._lock:
            self.gauges = dict(gauges)

    def throughput(self) -> float:
        """Generated tokens per second over the last minute (or since start, if younger)."""
        now = time.monotonic()
        span = min(THROUGHPUT_WINDOW_S, max(now - self.started, 1e-9))
        return sum(n for t, n in self._recent if t >= now - THROUGHPUT_WINDOW_S) / span

    def render(self) -> str:
        """Prometheus text exposition."""
        with self._lock:
            lab = f'model="{self.model}",policy="{self.policy}"'
            lines: list[str] = []

            def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float | None]]) -> None:
                lines.append(f"# HELP pask_{name} {help_}")
                lines.append(f"# TYPE pask_{name} {kind}")
                for extra, value in samples:
                    if value is not None:
                        labels = lab + (f",{extra}" if extra else "")
                        lines.append(f"pask_{name}{{{labels}}} {value}")

            reqs = self.requests or {"ok": 0}
            by_outcome = [(f'outcome="{k}"', v) for k, v in reqs.items()]
            metric("requests_total", "counter", "Requests by outcome.", by_outcome)
            metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [("", self.prompt_tokens)])
            metric("completion_tokens_total", "counter", "Generated tokens.", [("", self.completion_tokens)])
            metric("tpot_seconds_sum", "counter", "Sum of per-request time per output token.", [("", self.tpot_sum_s)])
            metric("tpot_seconds_count", "counter", "Requests in tpot_seconds_sum.", [("", self.tpot_count)])
            tpot = self.tpot_sum_s / self.tpot_count if self.tpot_count else None
            metric("tpot_seconds", "gauge", "Mean time per output token of finished requests.", [("", tpot)])
            ttft = self.ttft_sum_s / self.ttft_count if self.ttft_count else None
            metric("ttft_seconds", "gauge", "Mean time to first token (queueing included).", [("", ttft)])
            metric("throughput_tokens_per_second", "gauge", "Generated tokens/s over the last minute.",
                   [("", round(self.throughput(), 3))])  # fmt: skip
            g = self.gauges
            for key, help_ in (
                ("running", "Requests in the running batch."),
                ("waiting", "Requests waiting for admission."),
                ("kv_bytes_held", "K/V bytes held by the running batch."),
                ("kv_bytes_full", "Bytes the running batch's tokens would take in Full KV."),
                ("kv_bytes_peak", "Peak K/V bytes held."),
                ("kv_bytes_reserved", "K/V bytes reserved by admitted requests."),
                ("kv_capacity_bytes", "Logical KV capacity (Full-KV bytes)."),
            ):
                metric(key, "gauge", help_, [("", g.get(key))])
            metric("kv_budget", "gauge", "Measured KV budget B (held / full bytes).",
                   [('scope="live"', g.get("b_live")), ('scope="finished"', g.get("b_finished"))])  # fmt: skip
            return "\n".join(lines) + "\n"
