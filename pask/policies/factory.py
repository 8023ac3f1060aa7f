"""make_policy: a policy object from its name, a budget and a configuration (tuned defaults first)."""

from __future__ import annotations

import json

from pask.errors import PaskError
from pask.kv.budget import check_budget
from pask.policies import get_policy
from pask.policies.tuning import effective_config


def make_policy(name: str, budget: float | None, config: str | None = None, task: str = "bfcl"):
    """The policy object for a name; ``full`` is Full KV on DynamicCache (None).

    Budget-controlled policies start from their configuration tuned on ``task``'s dev split at that
    budget (``pask/policies/configs.json``, ``configs_sql.json`` for SQL); ``--policy-config``
    overrides it. A missing configuration file, or a tunable policy with no entry at ``budget`` and
    no ``config``, raises :class:`PaskError` unless ``PASK_ALLOW_UNTUNED=1``
    (:func:`pask.policies.tuning.effective_config`).
    """
    try:
        user = json.loads(config) if config else {}
    except json.JSONDecodeError as e:
        raise PaskError(f"--policy-config is not valid JSON: {e}") from None
    if not isinstance(user, dict):
        raise PaskError("--policy-config must be a JSON object")
    if name == "full":
        if budget not in (None, 1.0) or user:
            raise PaskError("policy 'full' keeps every token (B = 1) and takes no configuration")
        return None
    kwargs = dict(user)
    if budget is not None:
        check_budget(budget, f"{name}: budget")  # before its tuned configuration is looked up at that budget
        kwargs = {**effective_config(name, budget, user, task), "budget": budget}
    try:
        return get_policy(name, **kwargs)
    except TypeError as e:
        raise PaskError(f"bad configuration for policy '{name}': {e}") from None
