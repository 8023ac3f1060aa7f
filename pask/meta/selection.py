"""MetaKV's constraints and selection rule.

The rule (MetaKV's): among the candidates predicted to meet both limits, the one with the highest
predicted P(correct); if none is predicted to meet them, the cheapest. pask's choices where the
rule leaves one open: "cheapest" is the smallest predicted KV bytes, then the lowest predicted
latency; ties in P(correct) go to fewer KV bytes, then lower latency, then the candidates' order.
A limit left out (None) always holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pask.errors import PaskError
from pask.meta.predictor import Prediction


def check_limit(value, name: str) -> float | None:
    """A limit as a positive finite float (None: no limit); :class:`PaskError` naming ``name`` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PaskError(f"{name} must be a positive number, got {value!r}")
    v = float(value)
    if math.isnan(v) or math.isinf(v) or v <= 0:
        raise PaskError(f"{name} must be a positive finite number, got {value!r}")
    return v


@dataclass(frozen=True)
class Constraints:
    """A request's limits: end-to-end latency (ms) and KV bytes held (MB = 10^6 bytes)."""

    max_latency_ms: float | None = None
    max_kv_mb: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_latency_ms", check_limit(self.max_latency_ms, "max_latency_ms"))
        object.__setattr__(self, "max_kv_mb", check_limit(self.max_kv_mb, "max_kv_mb"))

    def met(self, latency_ms: float, kv_mb: float) -> bool:
        return (self.max_latency_ms is None or latency_ms <= self.max_latency_ms) and (
            self.max_kv_mb is None or kv_mb <= self.max_kv_mb
        )

    def merged(self, other: Constraints | None) -> Constraints:
        """``other``'s limits where it gives them, these otherwise (a request over server defaults)."""
        if other is None:
            return self
        return Constraints(
            other.max_latency_ms if other.max_latency_ms is not None else self.max_latency_ms,
            other.max_kv_mb if other.max_kv_mb is not None else self.max_kv_mb,
        )

    def to_json(self) -> dict:
        return {"max_latency_ms": self.max_latency_ms, "max_kv_mb": self.max_kv_mb}


@dataclass(frozen=True)
class Choice:
    """The chosen candidate, whether it was predicted to meet the limits, and every prediction."""

    candidate: str
    feasible: bool
    predictions: tuple[Prediction, ...]

    def to_json(self) -> dict:
        return {
            "configuration": self.candidate,
            "predicted_feasible": self.feasible,
            "predictions": [p.to_json() for p in self.predictions],
        }


def select(predictions: Sequence[Prediction], constraints: Constraints) -> Choice:
    """The selection rule (module docstring) over ``predictions`` (one per candidate, in order)."""
    if not predictions:
        raise PaskError("MetaKV has no candidate to choose from")
    order = {p.candidate: i for i, p in enumerate(predictions)}
    feasible = [p for p in predictions if constraints.met(p.latency_ms, p.kv_mb)]
    if feasible:
        best = min(feasible, key=lambda p: (-p.p_correct, p.kv_mb, p.latency_ms, order[p.candidate]))
    else:
        best = min(predictions, key=lambda p: (p.kv_mb, p.latency_ms, order[p.candidate]))
    return Choice(best.candidate, bool(feasible), tuple(predictions))
