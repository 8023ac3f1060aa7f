"""The policy protocol: which tier (H / L / L2 / R) each token gets, per layer group."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from pask.kv.actions import Action
from pask.kv.config import CacheConfig
from pask.kv.latent import LatentSpec

#: One action of a policy: (layer group, positions, action).
ActionSpec = tuple[int, torch.Tensor, Action]


@dataclass
class SeqContext:
    """What a policy sees of one sequence when it decides.

    ``leaving`` holds the positions that get their final action now: at prefill, every prompt
    position outside the recent window; after a decode step, the positions that just left it.
    A policy may also act on older positions it still holds (outside the recent window), e.g. to
    evict a heavy hitter that has cooled down; :meth:`tiers` tells what is held where.

    Statistics (``None`` unless the policy asked for them, see :mod:`pask.kv.stats`):
    ``prefill_attention`` and ``prefill_value_norm`` ``[layers, Hkv, prompt_len]`` at prefill only;
    ``step_attention [layers, Hkv, length]`` and ``step_scores [layers, ..., Hkv, length]`` after
    each decode step (0 at released positions).
    """

    seq: int  # row in the batch
    prompt_len: int  # prompt tokens of this sequence
    length: int  # tokens stored so far (prompt + generated fed to the model)
    recent_window: int
    num_groups: int
    leaving: torch.Tensor  # LongTensor of positions
    token_ids: list[int] = field(default_factory=list)  # prompt + generated tokens so far
    tags: list = field(default_factory=list)  # structural Tag of each generated token so far
    prompt_labels: list | None = None  # PromptLabel of each prompt token (None: task gave none)
    groups: list[range] = field(default_factory=list)  # the model layers of each layer group
    int4_cost: float = 0.3125  # bytes of an L (INT4) token / bytes of an H token (Action.L cost)
    int2_cost: float = 0.1875  # bytes of an L2 (INT2) token / bytes of an H token (Action.L2 cost)
    prefill_attention: torch.Tensor | None = None
    prefill_value_norm: torch.Tensor | None = None
    step_attention: torch.Tensor | None = None
    step_scores: torch.Tensor | None = None
    tier_fn: Callable[[], torch.Tensor] | None = field(default=None, repr=False)

    def tiers(self) -> torch.Tensor:
        """Current tier (``Action`` value, int8) of every position in every group: ``[num_groups, length]``."""
        if self.tier_fn is None:
            raise RuntimeError("this SeqContext was built without access to the cache's tiers")
        return self.tier_fn()


@runtime_checkable
class Policy(Protocol):
    """Decides retention actions; called once at prefill and after every decode step per sequence.

    Every member is explicit (no caller probes with ``getattr``); :class:`PolicyBase` gives the
    defaults of all but ``name``, ``budget`` and the two decision methods.

    Budget. ``budget`` is the target measured B in (0, 1] the policy was built with, ``None`` when
    it has none (Full KV, a static mix). ``target_b`` (read-only) is the B the policy aims at: a
    PASK table's ``target_b`` (else its ``expected_b``), else ``budget``, else 1.0; KV-capacity
    admission reserves a request's bytes at it (:mod:`pask.runtime.capacity`). Only
    :class:`~pask.policies.pask.PaskPolicy` has a ``table`` (its :class:`~pask.policies.table.FrozenTable`);
    it is not part of the protocol.

    ``l2_key_bits``: the key code width the policy's L2 action was calibrated with (4 for a PASK
    K4V2 table: INT4 keys, INT2 values); the decode core builds its cache with it
    (``CacheConfig.l2_key_bits``). ``None``: whatever the cache is configured with (2 by default).

    ``cold_bits``: the code width of the cold tier the policy demotes tokens to (KVFetch,
    :mod:`pask.policies.kvfetch`; ``CacheConfig.cold_bits``). ``None``: the policy uses no cold tier.

    ``latent``: BellowsKV's shared latent (:class:`~pask.kv.latent.LatentSpec`: projections and
    width) the policy's L action keeps; the decode core binds it to the model and builds a latent
    cache (``CacheConfig.latent``, :mod:`pask.kv.latent`). ``None``: L is the INT4 tier.

    ``needs_tags``: the policy reads the structural tags of generated tokens and the labels of
    prompt tokens (PASK), so the caller attaches a tagger and prompt labels to each request.

    Statistics the session computes only when asked (see :mod:`pask.kv.stats` for shapes and cost):
    ``prefill_window`` (attention of the last w prompt queries; ``pask.kv.stats.ALL`` for all of
    them; 0: none), ``prefill_value_norm`` (``‖v W_o‖₁`` per prompt token), ``step_attention`` (the
    new query's attention over the held tokens after every decode step) and ``step_scorer`` (a
    custom score over the held keys per decode step, or ``None``).

    Per-sequence state. A policy instance normally serves one request, seen as row 0
    (``SeqContext.seq``); a replay shares one instance over its rows, numbered by ``seq`` (distinct
    among the live rows). A policy that keeps state per row (accumulated attention, a prefill
    ranking, recurrence statistics) keys it by ``seq`` and drops it in :meth:`reset`. The decode
    core calls ``reset(seq)`` right before a row's ``prefill_actions`` and again when the row
    finishes, so the state of a reused instance stays bounded by its live rows; nothing is
    cleared implicitly (in particular not when a new ``seq == 0`` arrives).
    """

    name: str
    budget: float | None
    needs_tags: bool
    prefill_window: int
    prefill_value_norm: bool
    step_attention: bool
    step_scorer: Callable | None
    l2_key_bits: int | None
    cold_bits: int | None
    latent: LatentSpec | None

    @property
    def target_b(self) -> float:
        """The measured B the policy aims at (see the class docstring)."""
        ...

    def reset(self, seq: int) -> None:
        """Forget the per-sequence state of row ``seq`` (a no-op for stateless policies)."""
        ...

    def ranking(self, ctx: SeqContext) -> torch.Tensor | None:
        """The policy's keep priority of every position ``[G, >= ctx.length]`` (higher kept first) for
        the row of ``ctx``, as its last decision used it; ``None``: it ranks nothing (KVFetch then
        admits released tokens to its cold tier by position)."""
        ...

    def report(self, seq: int) -> dict:
        """Counters the policy kept for row ``seq``'s request (``{}``: none); the decode core calls it
        when the request finishes, before :meth:`reset`, and records them in its budget as ``policy``."""
        ...

    def prefill_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        """Actions for the prompt tokens outside the recent window (``ctx.leaving``)."""
        ...

    def step_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        """Final actions for the tokens that just left the recent window (``ctx.leaving``)."""
        ...


class PolicyBase:
    """Defaults of the :class:`Policy` members, for policies to inherit (no dataclass fields).

    A subclass gives ``name``, ``budget`` (``None``: no target) and the two decision methods, and
    overrides what differs: the statistics it asks for, ``needs_tags``, and
    :meth:`reset` if it keeps per-sequence state. ``budget`` has no default here on purpose: a
    dataclass field inherits a base class attribute as its default, which would make a required
    ``budget`` optional.
    """

    needs_tags: bool = False
    prefill_window: int = 0
    prefill_value_norm: bool = False
    step_attention: bool = False
    step_scorer: Callable | None = None
    l2_key_bits: int | None = None  # the key width its L2 action needs (4: K4V2); None: the cache's own
    cold_bits: int | None = None  # the width of the cold tier it demotes to (KVFetch); None: no cold tier
    latent: LatentSpec | None = None  # BellowsKV's latent its L action keeps; None: L is INT4

    @property
    def target_b(self) -> float:
        """``budget``, or 1.0 for a policy without a target."""
        budget = self.budget  # type: ignore[attr-defined]
        return 1.0 if budget is None else float(budget)

    def reset(self, seq: int) -> None:
        """Forget the per-sequence state of row ``seq``: nothing to forget here."""
        del seq

    def ranking(self, ctx: SeqContext) -> torch.Tensor | None:
        """No ranking."""
        del ctx
        return None

    def report(self, seq: int) -> dict:
        """No counters."""
        del seq
        return {}


def with_key_bits(config: CacheConfig, policy: Policy) -> CacheConfig:
    """``config`` with the L2 key width and cold-tier width ``policy`` needs (its ``l2_key_bits`` and
    ``cold_bits``; each unchanged when ``None``).

    The decode core builds every cache through this, so a K4V2 table always runs on a K4V2 cache
    and its measured B counts the INT4 key bytes.
    """
    changes = {}
    if policy.l2_key_bits is not None and policy.l2_key_bits != config.l2_key_bits:
        changes["l2_key_bits"] = int(policy.l2_key_bits)
    if policy.cold_bits is not None and policy.cold_bits != config.cold_bits:
        changes["cold_bits"] = int(policy.cold_bits)
    return dataclasses.replace(config, **changes) if changes else config
