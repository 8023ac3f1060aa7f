"""Server metrics: counters and gauges, rendered in the Prometheus text format (``GET /metrics``).

The scheduler's thread records finished requests (:meth:`Metrics.observe`) and publishes the
gauges of the running batch after every step (:meth:`Metrics.publish`); HTTP handlers count
refused requests and render. One lock guards everything.

Replicas (:mod:`pask.serving.replicas`) each publish a :meth:`Metrics.state`; :func:`merge` sums
them and :func:`render` draws the sums with each replica's gauges beside them.
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
    choices: dict[str, int] = field(default_factory=dict)  # MetaKV: requests per chosen configuration
    started: float = field(default_factory=time.monotonic)
    _recent: deque = field(default_factory=deque, repr=False)  # (time, tokens) of finished requests
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, outcome: str) -> None:
        with self._lock:
            self.requests[outcome] = self.requests.get(outcome, 0) + 1

    def chose(self, configuration: str) -> None:
        """Count a request MetaKV gave ``configuration``."""
        with self._lock:
            self.choices[configuration] = self.choices.get(configuration, 0) + 1

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

    def state(self) -> dict:
        """A plain, picklable copy: the counters, the gauges and the current throughput (what
        :func:`render` draws and :func:`merge` sums; replicas publish it, :mod:`pask.serving.replicas`)."""
        with self._lock:
            return {
                "model": self.model,
                "policy": self.policy,
                "requests": dict(self.requests),
                "choices": dict(self.choices),
                **{k: getattr(self, k) for k in COUNTERS},
                "gauges": dict(self.gauges),
                "throughput": self.throughput(),
            }

    def render(self) -> str:
        """Prometheus text exposition."""
        return render(self.state())


COUNTERS = ("prompt_tokens", "completion_tokens", "tpot_sum_s", "tpot_count", "ttft_sum_s", "ttft_count")
GAUGES = (  # (key, help); every one adds up over replicas (the peak: an upper bound of the joint peak)
    ("running", "Requests in the running batch."),
    ("waiting", "Requests waiting for admission."),
    ("kv_bytes_held", "K/V bytes held by the running batch."),
    ("kv_bytes_full", "Bytes the running batch's tokens would take in Full KV."),
    ("kv_bytes_peak", "Peak K/V bytes held."),
    ("kv_bytes_reserved", "K/V bytes reserved by admitted requests."),
    ("kv_capacity_bytes", "Logical KV capacity (Full-KV bytes)."),
)


def retired(state: dict) -> dict:
    """The counters of ``state`` only (a replica that is gone: its gauges and throughput no longer hold)."""
    return {**state, "gauges": {}, "throughput": 0.0}


def merge(states: list[dict]) -> dict:
    """One state for several replicas: counters, throughput and the :data:`GAUGES` summed; the live
    KV budget weighted by each replica's Full-KV bytes (exact); the finished one has no sum (None)."""
    if not states:
        return Metrics().state()
    out = {"model": states[0]["model"], "policy": states[0]["policy"], "requests": {}, "choices": {}, "gauges": {}}
    for s in states:
        for key in ("requests", "choices"):
            for k, v in s.get(key, {}).items():
                out[key][k] = out[key].get(k, 0) + v
    for k in (*COUNTERS, "throughput"):
        out[k] = sum(s[k] for s in states)
    for key, _ in GAUGES:
        values = [s["gauges"][key] for s in states if s["gauges"].get(key) is not None]
        out["gauges"][key] = sum(values) if values else None
    live = [(s["gauges"]["b_live"], s["gauges"].get("kv_bytes_full") or 0) for s in states
            if s["gauges"].get("b_live") is not None]  # fmt: skip
    full = sum(w for _, w in live)
    out["gauges"]["b_live"] = sum(b * w for b, w in live) / full if full else None
    out["gauges"]["b_finished"] = None
    return out


def render(state: dict, replicas: dict[str, dict] | None = None) -> str:
    """Prometheus text of a :meth:`Metrics.state`. Given ``replicas`` (name -> state; ``state`` is
    then their :func:`merge`), every gauge also gets one sample per replica (label ``replica``), and
    ``pask_replicas`` counts them; counters are the sums only."""
    lab = f'model="{state["model"]}",policy="{state["policy"]}"'
    reps = replicas or {}
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float | None]]) -> None:
        lines.append(f"# HELP pask_{name} {help_}")
        lines.append(f"# TYPE pask_{name} {kind}")
        for extra, value in samples:
            if value is not None:
                labels = lab + (f",{extra}" if extra else "")
                lines.append(f"pask_{name}{{{labels}}} {value}")

    def each(value, extra: str = "") -> list[tuple[str, float | None]]:
        """Samples of a gauge: the total, then each replica's (``value``: a state -> number)."""
        per = [(",".join(x for x in (extra, f'replica="{r}"') if x), value(s)) for r, s in sorted(reps.items())]
        return [(extra, value(state)), *per]

    def mean(s: dict, key: str) -> float | None:
        return s[f"{key}_sum_s"] / s[f"{key}_count"] if s[f"{key}_count"] else None

    reqs = state["requests"] or {"ok": 0}
    by_outcome = [(f'outcome="{k}"', v) for k, v in reqs.items()]
    metric("requests_total", "counter", "Requests by outcome.", by_outcome)
    if state.get("choices"):
        chosen = [(f'configuration="{k}"', v) for k, v in sorted(state["choices"].items())]
        metric("meta_choices_total", "counter", "Requests by the configuration MetaKV chose.", chosen)
    metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [("", state["prompt_tokens"])])
    metric("completion_tokens_total", "counter", "Generated tokens.", [("", state["completion_tokens"])])
    metric("tpot_seconds_sum", "counter", "Sum of per-request time per output token.", [("", state["tpot_sum_s"])])
    metric("tpot_seconds_count", "counter", "Requests in tpot_seconds_sum.", [("", state["tpot_count"])])
    metric("tpot_seconds", "gauge", "Mean time per output token of finished requests.",
           each(lambda s: mean(s, "tpot")))  # fmt: skip
    metric("ttft_seconds", "gauge", "Mean time to first token (queueing included).", each(lambda s: mean(s, "ttft")))
    metric("throughput_tokens_per_second", "gauge", "Generated tokens/s over the last minute.",
           each(lambda s: round(s["throughput"], 3)))  # fmt: skip
    for key, help_ in GAUGES:
        metric(key, "gauge", help_, each(lambda s, key=key: s["gauges"].get(key)))
    metric("kv_budget", "gauge", "Measured KV budget B (held / full bytes).",
           each(lambda s: s["gauges"].get("b_live"), 'scope="live"')
           + each(lambda s: s["gauges"].get("b_finished"), 'scope="finished"'))  # fmt: skip
    if reps:
        metric("replicas", "gauge", "Replicas publishing metrics.", [("", len(reps))])
    return "\n".join(lines) + "\n"
