"""Retention policies and their registry."""

from __future__ import annotations

from collections.abc import Callable

from pask.errors import PaskError
from pask.policies.base import ActionSpec, Policy, SeqContext
from pask.policies.full import FullPolicy
from pask.policies.static_mix import StaticMixPolicy

_REGISTRY: dict[str, Callable[..., Policy]] = {
    "full": FullPolicy,
    "static_mix": StaticMixPolicy,
}


def register_policy(name: str, factory: Callable[..., Policy]) -> None:
    """Add (or replace) a policy factory under ``name``."""
    _REGISTRY[name] = factory


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def get_policy(name: str, **kwargs) -> Policy:
    """Build the policy registered as ``name`` with ``kwargs``."""
    if name not in _REGISTRY:
        raise PaskError(f"unknown policy '{name}'; known policies: {', '.join(policy_names())}")
    return _REGISTRY[name](**kwargs)


__all__ = [
    "ActionSpec",
    "FullPolicy",
    "Policy",
    "SeqContext",
    "StaticMixPolicy",
    "get_policy",
    "policy_names",
    "register_policy",
]
