"""The public Python API: load a model, generate one structured request under a KV policy.

``pask.load`` and ``pask.generate`` do what ``pask generate`` does, from Python; decoding goes
through the one decode core (:mod:`pask.runtime.scheduler`) like every other path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pask.errors import PaskError
from pask.kv.budget import check_budget
from pask.runtime.models import DEFAULT_MODEL, LoadedModel

_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


@dataclass
class Result:
    """One generation: its text, the parsed calls (tools) or JSON value (response_format), the
    measured budget (``b_prompt``, ``b_decode``, ``b_total``, ``held_bytes``), timings (ms) and, with
    ``save_tags``, each generated token's structural tag."""

    text: str
    calls: list[dict] | None = None
    value: Any = None
    stop_reason: str = ""
    budget: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    tags: list[str] | None = None  # each generated token's structural tag (``save_tags=True``, with tools)


def load(model: str = DEFAULT_MODEL, dtype: str = "bf16", weights: str | None = None) -> LoadedModel:
    """Load an embedded model name, a Hugging Face id or a local directory (``dtype``: bf16 | fp32 | fp16;
    ``weights``: the linear layers' format, bf16 | int8 | int4, default ``$PASK_WEIGHTS`` or bf16)."""
    import torch

    from pask.cpu.weights import configured
    from pask.runtime.models import load_model

    if dtype not in _DTYPES:
        raise PaskError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    return load_model(model, dtype=getattr(torch, _DTYPES[dtype]), weights=configured(weights))


def _policy(
    lm: LoadedModel,
    policy: str,
    budget: float | None,
    table: str | Path | None,
    config: dict | None,
    allow_transfer: bool = False,
):
    """The KV policy object (``None``: Full KV) for a name, budget and PASK table."""
    from pask.policies.factory import make_policy

    if budget is not None:
        check_budget(budget)
    if policy != "pask":
        return make_policy(policy, budget, json.dumps(config) if config else None)
    from pask.policies.pask import make_pask_policy
    from pask.policies.table import default_table, load

    if budget is None:
        raise PaskError("policy 'pask' needs a budget (e.g. budget=0.33)")
    if table is None:
        table = default_table(lm.name, "bfcl", budget)
        if table is None:
            raise PaskError(f"no committed PASK table for this model at budget {budget}: pass table=PATH")
    return make_pask_policy(load(Path(table), fingerprint=lm.fingerprint, allow_transfer=allow_transfer), budget)


def generate(
    lm: LoadedModel,
    messages: list[dict],
    tools: list[dict] | None = None,
    response_format: dict | None = None,
    policy: str = "full",
    budget: float | None = None,
    table: str | Path | None = None,
    policy_config: dict | None = None,
    max_new_tokens: int = 384,
    allow_transfer: bool = False,
    save_tags: bool = False,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
) -> Result:
    """Generate one reply under the tool-call grammar (``tools``: the reply is one or more calls) or
    a JSON schema (``response_format``: ``{"type": "json_schema", "json_schema": {"schema": ...}}``),
    with the KV ``policy`` at ``budget`` (``"full"``: Full KV; ``"pask"`` uses ``table`` or the
    committed table for the model and budget; ``allow_transfer``: accept a table calibrated on another
    model). ``save_tags``: the result's ``tags`` hold each generated token's structural tag (tool
    requests). ``temperature`` 0 (the default) decodes greedily; above 0 (up to 2) tokens are sampled
    from the grammar-masked distribution within the ``top_p`` nucleus, from a stream seeded with
    ``seed`` (None: a fresh random seed), so a fixed seed reproduces. Schemas and sampling
    parameters are checked before anything runs."""
    from pask.runtime.engine import generate as run
    from pask.runtime.tokens import check_sampling
    from pask.serving.protocol import attach_tagging, build_chat_request, tool_calls_of
    from pask.structure.schema_check import check_response_format
    from pask.tasks.function_calling import check_tools

    check_sampling(temperature, top_p, seed)
    if tools:
        check_tools(tools)
    if response_format is not None:
        schema = (response_format.get("json_schema") or {}).get("schema")
        if schema is not None:
            check_response_format(schema)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise PaskError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    kv = _policy(lm, policy, budget, table, policy_config, allow_transfer)
    body: dict[str, Any] = {"model": "pask", "messages": messages, "max_tokens": max_new_tokens}
    if tools:
        body["tools"], body["tool_choice"] = tools, "required"
    if response_format is not None:
        body["response_format"] = response_format
    chat = build_chat_request(body, lm.tokenizer, "pask", max_new_tokens)
    chat.request.temperature, chat.request.top_p, chat.request.seed = temperature, top_p, seed
    if save_tags or (kv is not None and getattr(kv, "needs_tags", False)):
        attach_tagging(chat, lm.tokenizer)
    (g,) = run(lm, [chat.request], policy=kv)
    calls = None
    if tools:
        raw = tool_calls_of(g.text) or []
        calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])} for c in raw]
    value = None
    if response_format is not None:
        try:
            value = json.loads(g.text)
        except json.JSONDecodeError:
            value = None
    timings = {"prefill_ms": round(g.prefill_ms, 2), "tpot_ms": round(g.tpot_ms, 2)}
    tags = [str(t) for t in g.extra["tags"]] if save_tags and "tags" in g.extra else None
    measured = g.extra.get("budget") or {}
    return Result(g.text, calls, value, g.stop_reason, measured, timings, list(g.token_ids), tags)
