"""make_policy: a policy object from its name, a budget and a configuration (tuned defaults first)."""

from __future__ import annotations

import json

from pask.errors import PaskError
from pask.kv.budget import check_budget
from pask.policies import get_policy
from pask.policies.kvfetch import FETCH_KEYS, FetchPolicy
from pask.policies.tuning import effective_config

#: ``fetch-<policy>``: KVFetch's recall channel around an eviction policy (:mod:`pask.policies.kvfetch`)
FETCH_PREFIX = "fetch-"
#: the policies KVFetch can wrap: those whose releases can feed its cold tier
FETCH_INNER = ("snapkv", "h2o", "criticalkv", "rocketkv", "lazyeviction", "pask")


def split_fetch_options(user: dict) -> tuple[dict, dict]:
    """(KVFetch's own options, the inner policy's) of a ``fetch-<inner>`` configuration."""
    own = {k: v for k, v in user.items() if k in FETCH_KEYS}
    return own, {k: v for k, v in user.items() if k not in own}


def fetch_params(name: str, budget: float, user: dict, task: str = "bfcl") -> dict:
    """What ``fetch-<inner>`` runs with: the wrapper's options as given, and ``inner``: the inner
    policy's effective configuration (tuned at ``budget`` under the rest of ``user``)."""
    own, rest = split_fetch_options(user or {})
    base = name.removeprefix(FETCH_PREFIX)
    return {**own, "inner": rest if base == "pask" else effective_config(base, budget, rest, task)}


def make_fetch(name: str, budget: float | None, user: dict, task: str = "bfcl", inner=None) -> FetchPolicy:
    """``fetch-<inner>``: the configuration's :data:`~pask.policies.kvfetch.FETCH_KEYS` go to the
    wrapper (its defaults otherwise), the rest to the inner policy, built at ``budget`` with its own
    tuned configuration (or given as ``inner``: a PASK policy). ``inner`` must be one of
    :data:`FETCH_INNER`: the policies that release tokens."""
    base = name.removeprefix(FETCH_PREFIX)
    if base not in FETCH_INNER:
        raise PaskError(
            f"'{name}': KVFetch wraps a policy that releases tokens: "
            + ", ".join(FETCH_PREFIX + p for p in FETCH_INNER)
        )
    if budget is None and inner is None:
        raise PaskError(f"policy '{name}' needs --budget")
    own, rest = split_fetch_options(user)
    if inner is None:
        if base == "pask":
            raise PaskError(
                "fetch-pask needs a PASK table: `pask eval --policy fetch-pask --table T` or a sweep's "
                '"fetch-pask@B" table (pask serve and pask generate do not take it yet)'
            )
        try:
            inner = make_policy(base, budget, json.dumps(rest) if rest else None, task)
        except PaskError as e:
            raise PaskError(f"{e} (policy '{name}'; KVFetch's own options: {', '.join(FETCH_KEYS)})") from None
    elif rest:
        raise PaskError(
            f"'{name}': unknown KVFetch option(s) {', '.join(sorted(rest))} (its options: {', '.join(FETCH_KEYS)})"
        )
    try:
        return FetchPolicy(inner, budget=budget, **own)
    except TypeError as e:
        raise PaskError(f"bad configuration for policy '{name}': {e}") from None


def parse_policy_config(config: str | None) -> dict:
    """A ``--policy-config`` JSON text as a dict (``{}`` for none); PaskError otherwise."""
    try:
        user = json.loads(config) if config else {}
    except json.JSONDecodeError as e:
        raise PaskError(f"--policy-config is not valid JSON: {e}") from None
    if not isinstance(user, dict):
        raise PaskError("--policy-config must be a JSON object")
    return user


def fetch_pask_options(config: str | None) -> dict:
    """``fetch-pask``'s ``--policy-config``: KVFetch's options only (PASK's come from its table), checked."""
    from pask.policies.kvfetch import check_config

    user = parse_policy_config(config)
    if bad := sorted(split_fetch_options(user)[1]):
        raise PaskError(
            f"--policy-config of fetch-pask: unknown option(s) {', '.join(bad)} "
            f"(KVFetch's options: {', '.join(FETCH_KEYS)}; PASK's come from --table)"
        )
    check_config(**user)
    return user


def make_policy(name: str, budget: float | None, config: str | None = None, task: str = "bfcl"):
    """The policy object for a name; ``full`` is Full KV on DynamicCache (None).

    Budget-controlled policies start from their configuration tuned on ``task``'s dev split at that
    budget (``pask/policies/configs.json``, ``configs_sql.json`` for SQL); ``--policy-config``
    overrides it. A missing configuration file, or a tunable policy with no entry at ``budget`` and
    no ``config``, raises :class:`PaskError` unless ``PASK_ALLOW_UNTUNED=1``
    (:func:`pask.policies.tuning.effective_config`).
    """
    user = parse_policy_config(config)
    if name == "full":
        if budget not in (None, 1.0) or user:
            raise PaskError("policy 'full' keeps every token (B = 1) and takes no configuration")
        return None
    if name.startswith(FETCH_PREFIX):
        return make_fetch(name, budget, user, task)
    kwargs = dict(user)
    if budget is not None:
        check_budget(budget, f"{name}: budget")  # before its tuned configuration is looked up at that budget
        kwargs = {**effective_config(name, budget, user, task), "budget": budget}
    try:
        return get_policy(name, **kwargs)
    except TypeError as e:
        raise PaskError(f"bad configuration for policy '{name}': {e}") from None


def policy_from_spec(
    spec: str, model: str, fingerprint: str | None = None, allow_transfer: bool = False, task: str = "bfcl"
):
    """A policy from ``NAME`` or ``NAME@B`` (as the benchmark scripts take them); ``pask@B`` loads the
    committed ``task`` table of ``model`` at B, checked against ``fingerprint`` (None: unchecked)."""
    name, _, b = spec.partition("@")
    try:
        budget = float(b) if b else None
    except ValueError:
        raise PaskError(f"{spec!r}: the budget after @ must be a number") from None
    if name != "pask":
        return make_policy(name, budget, task=task)
    if budget is None:
        raise PaskError(f"{spec!r}: pask needs a budget, pask@B")
    from pask.policies.pask import make_pask_policy
    from pask.policies.table import default_table, load

    path = default_table(model, task, budget)
    if path is None:
        raise PaskError(f"no committed PASK {task} table for {model} at B = {budget}")
    return make_pask_policy(load(path, fingerprint=fingerprint, allow_transfer=allow_transfer), budget)
