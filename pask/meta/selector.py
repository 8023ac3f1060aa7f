"""MetaKV at run time: a request's features -> predictions -> the chosen candidate's fresh policy.

:class:`MetaSelector` is what ``pask eval --policy meta`` and ``pask serve --policy meta`` hold. A
running batch holds one cache layout, so a server offers only candidates that can share it
(:func:`pask.meta.candidates.cache_key_bits`; ``allowed`` picks them); an eval groups its cases by
the chosen candidate and runs each group on its own cache, so it may offer all of them.
:class:`MetaProbe` is the policy a meta server's scheduler is built from: it asks for the union of
the candidates' statistics and tags, and never decides (each request brings its chosen policy).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pask.errors import PaskError
from pask.meta.candidates import cache_key_bits
from pask.meta.features import request_features
from pask.meta.predictor import MetaPredictor
from pask.meta.selection import Choice, Constraints, select
from pask.policies.base import PolicyBase
from pask.policies.full import FullPolicy


@dataclass
class MetaSelector:
    """Chooses a candidate per request (see the module docstring)."""

    predictor: MetaPredictor
    defaults: Constraints = field(default_factory=Constraints)
    allowed: Sequence[str] | None = None  # None: every candidate
    fingerprint: str | None = None
    batch_size: int | None = None  # rows decoding together, for the latency (None: the predictor's)
    policies: dict[str, Any] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        names = self.predictor.names
        if self.allowed is not None:
            unknown = [n for n in self.allowed if n not in names]
            if unknown or not self.allowed:
                raise PaskError(f"unknown MetaKV candidates {unknown or '(none given)'}; choose among {names}")
            names = [n for n in names if n in set(self.allowed)]
        self.allowed = names
        by_name = {c.name: c for c in self.predictor.candidates}
        for n in names:  # built once: a bad table or configuration fails here, not per request
            self.policies[n] = by_name[n].build(self.predictor.task, self.fingerprint)

    def choose(self, prompt_ids: Sequence[int], prompt_labels, constraints: Constraints | None = None) -> Choice:
        feats = request_features(prompt_ids, prompt_labels)
        preds = self.predictor.predict(feats, self.allowed, self.batch_size)
        return select(preds, self.defaults.merged(constraints))

    def policy(self, name: str):
        """A fresh policy instance of candidate ``name`` (Full KV: :class:`FullPolicy`)."""
        base = self.policies[name]
        return FullPolicy() if base is None else copy.deepcopy(base)

    def probe(self) -> MetaProbe:
        """The scheduler policy of a server offering these candidates (one cache layout for all); the
        error of candidates that cannot share one suggests the largest such subset, in order."""
        try:
            return MetaProbe.of(self.policies)
        except PaskError as e:
            fit: dict[str, Any] = {}
            for name, policy in self.policies.items():
                try:
                    MetaProbe.of({**fit, name: policy})
                    fit[name] = policy
                except PaskError:
                    continue
            raise PaskError(f"{e}; e.g. --meta-candidates {','.join(fit)}") from None


@dataclass
class MetaProbe(PolicyBase):
    """The union of the candidates' needs; a scheduler built from it runs any of them per request."""

    name: str = "meta"
    budget: float | None = None
    needs_tags: bool = False
    prefill_window: int = 0
    prefill_value_norm: bool = False
    step_attention: bool = False
    step_scorer: Any = None
    l2_key_bits: int | None = None
    cold_bits: int | None = None

    @classmethod
    def of(cls, policies: dict[str, Any]) -> MetaProbe:
        live = [p for p in policies.values() if p is not None]
        scorers = {id(p.step_scorer): p.step_scorer for p in live if p.step_scorer is not None}
        if len(scorers) > 1:
            raise PaskError("MetaKV candidates with different step scorers cannot share one running batch")
        windows = {int(p.prefill_window) for p in live if p.prefill_window}
        if len(windows) > 1:  # the prefill statistics are summed over the window: one window per batch
            raise PaskError(
                f"MetaKV candidates read prefill attention over different windows {sorted(windows)} and cannot "
                "share one running batch: serve a subset that agrees (--meta-candidates)"
            )
        colds = {p.cold_bits for p in live if p.cold_bits is not None}
        if len(colds) > 1:
            raise PaskError(f"MetaKV candidates use cold tiers of different widths {sorted(colds)}")
        return cls(
            needs_tags=any(p.needs_tags for p in live),
            prefill_window=next(iter(windows), 0),
            prefill_value_norm=any(p.prefill_value_norm for p in live),
            step_attention=any(p.step_attention for p in live),
            step_scorer=next(iter(scorers.values()), None),
            l2_key_bits=cache_key_bits(policies),
            cold_bits=next(iter(colds), None),
        )

    def prefill_actions(self, ctx):
        raise RuntimeError("MetaProbe does not decide: each request carries its chosen policy")

    def step_actions(self, ctx):
        raise RuntimeError("MetaProbe does not decide: each request carries its chosen policy")
