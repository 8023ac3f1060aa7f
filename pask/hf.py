"""Hugging Face ``model.generate`` on pask's tiered cache under a KV policy.

::

    with pask.kv_policy(model, "kivi-4", budget=0.5) as kv:
        out = model.generate(**inputs, cache=kv.cache, max_new_tokens=32, do_sample=False)
    print(kv.budget)  # measured B: bytes held / Full-KV bytes, mean over the rows

Like a kvpress press, :func:`kv_policy` is a context manager around an unchanged model: on entry
it selects the ``"pask"`` attention (:mod:`pask.kv.attention`) and puts a forward pre-hook and a
forward hook on the model; on exit (also after an exception) it removes both and restores the
previous attention implementation. What runs in between is the same per-row bookkeeping as the
decode core (:mod:`pask.runtime.scheduler`), driven by whatever loop calls the model
(``model.generate``, or a hand-written loop that passes ``cache=kv.cache``):

* first forward of the cache (the prompt): the rows' left padding is read from the 2-D
  ``attention_mask`` and declared with :meth:`TieredCache.begin_prefill` (pads are never stored;
  the cache is sized to the batch here); after the forward the policy's ``prefill_actions`` decide
  every prompt token outside the recent window (:func:`pask.runtime.session.decide_row`);
* every later forward (one token per row): the fed token joins the row's ``token_ids`` history,
  and after the forward the policy's ``step_actions`` decide the tokens that left the recent
  window; the row's measured B is sampled (:func:`pask.runtime.session.row_budget`).

One policy instance serves all rows of a batch (each row is its ``SeqContext.seq``, as in
calibration's replays); its ``reset(seq)`` is called before a row's prefill decisions and for
every row when the cache is replaced (:meth:`KVPolicy.new_cache`) or the block ends. Policies that
ask for attention statistics (``h2o``, ``snapkv``, ``criticalkv``, ...) get them through a
:class:`pask.kv.stats.StatsCollector` attached to the cache, as in the decode core.

Differences from :func:`pask.generate` and the decode core:

* No grammar: generation is whatever ``generate`` does (greedy, sampling, its stopping rules;
  rows that finished keep being fed the pad token, which the cache stores like any token).
* No structural tags and no prompt labels: the PASK policy looks every token up by its prompt
  label (prompt tokens) or its grammar tag (generated tokens), and a token without one gets the
  table's ``default_action`` -- ``H`` in every committed table, so PASK would keep everything and
  measure B = 1 while looking compressed. :func:`kv_policy` therefore refuses policies with
  ``needs_tags`` unless ``untagged=True`` (for a table whose default action is not ``H``, or to
  measure exactly that); use :func:`pask.generate` for PASK with its tags.
* The prompt is prefilled as one left-padded batch (the decode core prefills each prompt alone),
  so a padded row's prompt K/V may differ from its unpadded prefill in the last bits.
* One cache serves one ``generate`` call: take :meth:`KVPolicy.new_cache` for the next one.
  Beam search, assisted decoding and continuing from a used cache are refused
  (:class:`~pask.kv.cache.TieredCache` cannot reorder, crop or re-prefill).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pask.errors import PaskError
from pask.kv import stats
from pask.kv.attention import check_model, enable_pask_attention, register
from pask.kv.budget import CostModel, check_budget
from pask.kv.cache import CacheConfig, TieredCache
from pask.kv.stats import StatsCollector, StatsRequest
from pask.policies.base import Policy, with_key_bits
from pask.policies.full import FullPolicy
from pask.runtime.session import decide_row, row_budget

_CACHE_KEYS = ("cache", "past_key_values")  # the cache argument of a forward (transformers 5; older name)


@dataclass
class _Row:
    """Decode state of one batch row: its token history, the positions decided, its B samples."""

    history: list[int] = field(default_factory=list)
    decided: int = 0
    samples: list[float] = field(default_factory=list)


def _unwrap(model) -> tuple[torch.nn.Module, str | None, str | None]:
    """The Hugging Face model of a :class:`pask.runtime.models.LoadedModel` (or the model itself),
    its fingerprint and its pask name (what a committed PASK table is named after), where known."""
    inner = getattr(model, "model", None)
    if isinstance(inner, torch.nn.Module) and hasattr(model, "fingerprint") and hasattr(model, "tokenizer"):
        return inner, model.fingerprint, getattr(model, "name", None)
    if not isinstance(model, torch.nn.Module):
        raise PaskError(f"kv_policy needs a Hugging Face causal LM (or pask.load's result), got {type(model).__name__}")
    return model, getattr(model, "_pask_fingerprint", None), None


def _make_policy(
    model_name: str | None,
    fingerprint: str | None,
    policy: str | Policy,
    budget: float | None,
    table: str | Path | None,
    config: dict | None,
) -> Policy:
    """The policy object for a name (built like ``pask.generate`` does) or the instance given."""
    from pask.policies.factory import make_policy

    if not isinstance(policy, str):
        if budget is not None or table is not None or config:
            raise PaskError("budget, table and policy_config configure a policy by name: pass them to its constructor")
        if not (callable(getattr(policy, "prefill_actions", None)) and callable(getattr(policy, "step_actions", None))):
            raise PaskError(f"policy must be a name or an object with prefill_actions/step_actions, got {policy!r}")
        return policy
    if budget is not None:
        check_budget(budget)
    if policy != "pask":
        if table is not None:
            raise PaskError(f"table= is for policy 'pask', not {policy!r}")
        made = make_policy(policy, budget, json.dumps(config) if config else None)
        return made if made is not None else FullPolicy()
    from pask.policies.pask import make_pask_policy
    from pask.policies.table import default_table

    if budget is None:
        raise PaskError("policy 'pask' needs a budget (e.g. budget=0.33) and its table (table=PATH)")
    if config:
        raise PaskError("policy 'pask' takes no policy_config: its actions are its table's")
    if table is None:
        table = default_table(model_name, "bfcl", budget) if model_name else None
        if table is None:
            raise PaskError(f"no committed PASK table for this model at budget {budget}: pass table=PATH")
    return make_pask_policy(table, budget, fingerprint=fingerprint)


def left_pad_lengths(mask: torch.Tensor | None, batch: int, width: int) -> list[int]:
    """The left padding of each row of a first forward's 2-D ``attention_mask [batch, width]``
    (no mask: none). PaskError if a row is not left-padded (the cache drops leading pads only:
    any other pad would be stored and attended to) or holds no token."""
    if mask is None:
        return [0] * batch
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tuple(mask.shape) != (batch, width):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise PaskError(
            f"pask.kv_policy needs a 2-D attention_mask of shape {(batch, width)} at the first forward, got {shape}"
        )
    m = mask.detach().to(device="cpu", dtype=torch.bool)
    real = m.sum(dim=1)
    pads = (width - real).tolist()
    # left-padded: each row is pads zeros then ones, i.e. its mask equals (column >= pads)
    want = torch.arange(width)[None, :] >= (width - real)[:, None]
    bad = torch.nonzero((m != want).any(dim=1)).flatten().tolist()
    if bad:
        raise PaskError(
            f"row {bad[0]} of the attention_mask is not left-padded: pask needs left padding "
            "(tokenizer.padding_side = 'left')"
        )
    for b, p in enumerate(pads):
        if p == width:
            raise PaskError(f"row {b} of the batch holds no token (its attention_mask is all zeros)")
    return pads


def kv_policy(
    model,
    policy: str | Policy = "full",
    budget: float | None = None,
    *,
    table: str | Path | None = None,
    policy_config: dict | None = None,
    cache_config: CacheConfig | None = None,
    untagged: bool = False,
) -> KVPolicy:
    """A context manager that runs ``model.generate(..., cache=kv.cache)`` on a tiered cache under a policy.

    Parameters
    ----------
    model : transformers.PreTrainedModel | LoadedModel
        A causal LM whose attention the pask attention can serve (Llama / Qwen2 style; checked
        here), or :func:`pask.load`'s result.
    policy : str | Policy
        A policy name (``full``, ``kivi-4``, ``snapkv``, ``h2o``, ``pask``, ...; built by
        :func:`pask.policies.factory.make_policy` with its tuned configuration at ``budget``) or a
        policy object.
    budget : float | None
        Target measured budget B in (0, 1] of a budget-controlled policy named by ``policy``.
    table : str | Path | None
        The PASK table file of policy ``pask`` (default: the committed table for the model and budget).
    policy_config : dict | None
        Overrides of the named policy's configuration.
    cache_config : CacheConfig | None
        Tiered-cache settings (layer groups, recent window, ...); the policy sets the L-tier width.
    untagged : bool
        Run a policy that reads grammar tags and prompt labels (PASK) without them: every token
        then gets its table's default action (see the module docstring).

    Raises
    ------
    PaskError
        Unknown policy, bad budget, missing table, a tag-reading policy without ``untagged``, or a
        model the pask attention cannot serve (:class:`pask.kv.errors.UnsupportedModelError`).
    """
    hf, fingerprint, model_name = _unwrap(model)
    pol = _make_policy(model_name, fingerprint, policy, budget, table, policy_config)
    name = getattr(pol, "name", type(pol).__name__)
    if getattr(pol, "needs_tags", False) and not untagged:
        raise PaskError(
            f"policy {name!r} reads the grammar tags of generated tokens and the labels of prompt tokens, "
            "which model.generate does not produce: without them every token gets the table's default action "
            "(H in the committed tables: no compression). Use pask.generate for structured generation with "
            "tags, or pass untagged=True to run it anyway."
        )
    if cache_config is not None and not isinstance(cache_config, CacheConfig):
        raise PaskError(f"cache_config must be a pask.kv.cache.CacheConfig, got {type(cache_config).__name__}")
    if getattr(pol, "latent", None) is not None:  # duck-typed policy objects are accepted here
        raise PaskError(
            f"policy {name!r} keeps BellowsKV latents, which pask's decode core binds to the model it loaded "
            "(fingerprint, capture hooks): use pask.generate, `pask eval` or `pask serve`"
        )
    register()
    check_model(hf)  # UnsupportedModelError (a PaskError) before anything is changed
    return KVPolicy(hf, pol, with_key_bits(cache_config or CacheConfig(), pol))


class KVPolicy:
    """The handle :func:`kv_policy` returns; use it in a ``with`` block (see the module docstring).

    Attributes
    ----------
    model : torch.nn.Module
        The Hugging Face model served.
    policy : Policy
        The policy object (shared by the rows of a batch).
    config : CacheConfig
        The tiered cache's settings.
    cache : TieredCache
        The cache to pass as ``cache=`` (transformers < 5: ``past_key_values=``) to one
        ``generate`` call; sized to the batch at its first forward.
    """

    def __init__(self, model: torch.nn.Module, policy: Policy, config: CacheConfig) -> None:
        self.model, self.policy, self.config = model, policy, config
        self.policy_name = getattr(policy, "name", type(policy).__name__)
        self.stats_request = StatsRequest.of(policy)
        self._hooks: list[Any] = []
        self._prev_attn: str | None = None
        self._active = False
        self._rows: list[_Row] = []
        self._collector: StatsCollector | None = None
        self._phase: str | None = None  # "prefill" | "step" between a pre-hook and its hook
        self.cache = self.new_cache()
        dtype = next(model.parameters()).dtype
        self.costs = CostModel(self.cache.spec.head_dim, config.quant_group, dtype, config.l2_key_bits)

    # -- context manager ----------------------------------------------------------------------
    def __enter__(self) -> KVPolicy:
        if self._active:
            raise PaskError("this kv_policy block is already active")
        self._prev_attn = enable_pask_attention(self.model)
        try:
            self._hooks = [
                self.model.register_forward_pre_hook(self._before, with_kwargs=True),
                self.model.register_forward_hook(self._after, with_kwargs=True),
            ]
        except BaseException:
            self._restore()
            raise
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        self._restore()
        self._forget_rows()

    def _restore(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._prev_attn is not None:
            self.model.set_attn_implementation(self._prev_attn)
            self._prev_attn = None
        self._active = False
        self._phase = None

    # -- caches and budgets ---------------------------------------------------------------------
    def new_cache(self) -> TieredCache:
        """A fresh cache for the next ``generate`` call (it becomes :attr:`cache`; budgets then describe it)."""
        self._forget_rows()
        self.cache = TieredCache(self.model.config, self.config, batch_size=0)
        self._rows, self._collector, self._phase = [], None, None
        return self.cache

    def _reset(self, row: int) -> None:
        """Drop the policy's state of ``row`` (:meth:`Policy.reset`; a user's object may have none)."""
        reset = getattr(self.policy, "reset", None)
        if callable(reset):
            reset(row)

    def _forget_rows(self) -> None:
        """The rows of the current cache are decided no more: drop the policy's state of them."""
        for b in range(len(self._rows)):
            self._reset(b)

    @property
    def row_budgets(self) -> list[dict]:
        """Measured budget of each row of :attr:`cache` now: ``b_prompt``, ``b_decode``, ``b_total``,
        ``held_bytes`` (see :func:`pask.runtime.session.row_budget`) and ``b_total_avg`` (B averaged
        over the decode steps). Empty before the first forward."""
        if self.cache.mode == "empty":
            return []
        out = []
        for b, row in enumerate(self._rows):
            d = row_budget(self.cache, b)
            d["b_total_avg"] = sum(row.samples) / len(row.samples) if row.samples else d["b_total"]
            out.append(d)
        return out

    @property
    def budget(self) -> float | None:
        """Measured B of :attr:`cache` now (bytes held / Full-KV bytes), the mean over its rows;
        ``None`` before the first forward."""
        rows = self.row_budgets
        return sum(r["b_total"] for r in rows) / len(rows) if rows else None

    # -- hooks ----------------------------------------------------------------------------------
    def _cache_of(self, kwargs: dict):
        for key in _CACHE_KEYS:
            if kwargs.get(key) is not None:
                return kwargs[key]
        return None

    def _before(self, module, args, kwargs):
        cache = self._cache_of(kwargs)
        if cache is not self.cache:
            if cache is not None and not isinstance(cache, TieredCache) and kwargs.get("use_cache", True):
                raise PaskError(
                    f"inside pask.kv_policy, pass cache=kv.cache to generate (got a {type(cache).__name__}); "
                    "after a generate call, take kv.new_cache() for the next one"
                )
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise PaskError("pask.kv_policy needs input_ids (inputs_embeds give the policy no token ids)")
        if cache.mode == "empty":
            return args, self._begin_prefill(cache, ids, kwargs)
        if ids.shape[1] != 1:
            raise PaskError(
                f"a forward of {ids.shape[1]} new tokens on a used pask cache: a cache serves one generate call "
                "(take kv.new_cache() for the next), and beam search / assisted decoding are not supported"
            )
        if ids.shape[0] != cache.num_seqs:
            raise PaskError(f"a batch of {ids.shape[0]} rows fed to a pask cache of {cache.num_seqs} rows")
        for row, t in zip(self._rows, ids[:, 0].tolist(), strict=True):
            row.history.append(t)
        want = torch.tensor([[cache.seq_length(b)] for b in range(cache.num_seqs)])
        pos = kwargs.get("position_ids")
        if pos is None:
            kwargs["position_ids"] = want.to(ids.device)
        elif pos.dim() == 2 and not torch.equal(pos[:, -1:].cpu(), want):
            raise PaskError(
                f"position_ids {pos[:, -1].tolist()} do not continue the cached rows (next positions "
                f"{want[:, 0].tolist()}): a pask cache holds no pads, so each row's next position is its length"
            )
        if self._collector is not None and self.stats_request.step:
            self._collector.begin_step()
        self._phase = "step"
        return args, kwargs

    def _begin_prefill(self, cache: TieredCache, ids: torch.Tensor, kwargs: dict) -> dict:
        batch, width = ids.shape
        mask = kwargs.get("attention_mask")
        pads = left_pad_lengths(mask, batch, width)
        if cache.num_seqs != batch:  # the cache is sized here: re-run its constructor before any use
            TieredCache.__init__(cache, self.model.config, self.config, batch_size=batch)
        cache.begin_prefill(pads)
        rows = ids.tolist()
        self._rows = [_Row(history=r[p:]) for r, p in zip(rows, pads, strict=True)]
        self._collector = None
        if self.stats_request.any:
            self._collector = StatsCollector(self.stats_request, cache.spec.num_layers, batch)
        stats.attach(cache, self._collector)
        if kwargs.get("position_ids") is None and any(pads) and mask is not None:
            kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
        self._phase = "prefill"
        return kwargs

    def _after(self, module, args, kwargs, output):
        phase, self._phase = self._phase, None
        if phase is None or self._cache_of(kwargs) is not self.cache:
            return None
        cache, col = self.cache, self._collector
        cost = self.costs
        with torch.no_grad():  # generate runs under no_grad: tensors made here must not be inference tensors
            ops = [] if phase == "step" else None  # a step's actions of every row, applied at once
            for b, row in enumerate(self._rows):
                extra = {}
                if phase == "prefill":
                    self._reset(b)  # a fresh row: nothing of an earlier row with this seq
                    if col is not None and self.stats_request.prefill:
                        extra["prefill_attention"], extra["prefill_value_norm"] = col.take_prefill(b)
                    decide = self.policy.prefill_actions
                else:
                    if col is not None and self.stats_request.step:
                        extra["step_attention"], extra["step_scores"] = col.take_step(b)
                    decide = self.policy.step_actions
                row.decided = decide_row(
                    cache, b, decide, row.decided, row.history, [], None, cost, extra, seq=b, ops=ops
                )
            if ops is not None:
                if ops:
                    cache.apply_many(ops)
                for b, row in enumerate(self._rows):
                    row.samples.append(row_budget(cache, b)["b_total"])
        return None

    def __repr__(self) -> str:
        state = "active" if self._active else "inactive"
        return f"<pask.KVPolicy {self.policy_name} ({state})>"
