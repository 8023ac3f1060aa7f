"""Retention policies and their registry.

``full`` and ``static_mix`` are references; the budget-controlled baselines (each takes a target
measured budget ``budget`` in (0, 1] and meets it within about ``1 / (2n)``) are ``h2o``,
``snapkv``, ``mikv``, ``rocketkv``, ``criticalkv``, ``lazyeviction``, ``kivi-4`` (alias
``kivi``), ``kivi-2`` (the cache's INT2 tier) and ``kivi-mix`` (INT4 or INT2 per layer group). See
:mod:`pask.policies._common` for the budget arithmetic shared by all of them, and
:class:`pask.policies.base.Policy` for the protocol every policy implements (``budget``,
``target_b``, ``reset``, ...; :class:`~pask.policies.base.PolicyBase` gives the defaults).
"""

from __future__ import annotations

from collections.abc import Callable

from pask.errors import PaskError
from pask.policies.base import ActionSpec, Policy, PolicyBase, SeqContext
from pask.policies.bellows import BellowsEvictPolicy, BellowsPolicy
from pask.policies.criticalkv import CriticalKVPolicy
from pask.policies.full import FullPolicy
from pask.policies.h2o import H2OPolicy
from pask.policies.kivi import KIVIMixPolicy, KIVIPolicy, kivi_factory
from pask.policies.lazyeviction import LazyEvictionPolicy
from pask.policies.mikv import MiKVPolicy
from pask.policies.pask import PaskPolicy, make_pask_policy
from pask.policies.rocketkv import RocketKVPolicy
from pask.policies.snapkv import SnapKVPolicy
from pask.policies.static_mix import StaticMixPolicy

_REGISTRY: dict[str, Callable[..., Policy]] = {
    "full": FullPolicy,
    "static_mix": StaticMixPolicy,
    "h2o": H2OPolicy,
    "snapkv": SnapKVPolicy,
    "mikv": MiKVPolicy,
    "rocketkv": RocketKVPolicy,
    "criticalkv": CriticalKVPolicy,
    "lazyeviction": LazyEvictionPolicy,
    "kivi-4": kivi_factory(4),
    "kivi-2": kivi_factory(2),
    "kivi-mix": KIVIMixPolicy,
    "pask": make_pask_policy,  # needs ``table`` (a FrozenTable or the path of a table file)
    "bellows": BellowsPolicy,  # needs ``projections`` (a `pask calibrate-bellows` file)
    "bellows-evict": BellowsEvictPolicy,
}
_ALIASES = {"kivi": "kivi-4"}

#: The budget-controlled baselines (each takes ``budget``).
BASELINES = ("h2o", "snapkv", "mikv", "rocketkv", "criticalkv", "lazyeviction", "kivi-4", "kivi-2", "kivi-mix")


def register_policy(name: str, factory: Callable[..., Policy]) -> None:
    """Add (or replace) a policy factory under ``name``."""
    _REGISTRY[name] = factory


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def get_policy(name: str, **kwargs) -> Policy:
    """Build the policy registered as ``name`` with ``kwargs`` (unknown or missing keys: PaskError)."""
    name = _ALIASES.get(name, name)
    if name not in _REGISTRY:
        raise PaskError(f"unknown policy '{name}'; known policies: {', '.join(policy_names())}")
    try:
        return _REGISTRY[name](**kwargs)
    except TypeError as e:
        raise PaskError(f"bad configuration for policy '{name}': {e}") from None


__all__ = [
    "BASELINES",
    "ActionSpec",
    "BellowsEvictPolicy",
    "BellowsPolicy",
    "CriticalKVPolicy",
    "FullPolicy",
    "H2OPolicy",
    "KIVIMixPolicy",
    "KIVIPolicy",
    "LazyEvictionPolicy",
    "MiKVPolicy",
    "PaskPolicy",
    "Policy",
    "PolicyBase",
    "RocketKVPolicy",
    "SeqContext",
    "SnapKVPolicy",
    "StaticMixPolicy",
    "get_policy",
    "policy_names",
    "register_policy",
]
