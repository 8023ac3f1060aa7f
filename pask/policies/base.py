"""The policy protocol: which tier (H / L / R) each token gets, per layer group."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from pask.kv.actions import Action

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
    int4_cost: float = 0.3125  # bytes of an L token (INT4; INT2 in a 2-bit cache) / bytes of an H token (Action.L cost)
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

    Optional attributes ask the session for attention statistics, computed only when asked (absent
    means not asked; see :mod:`pask.kv.stats` for shapes and cost): ``prefill_window: int = 0``
    (attention of the last w prompt queries; ``pask.kv.stats.ALL`` for all of them),
    ``prefill_value_norm: bool = False`` (``‖v W_o‖₁`` per prompt token), ``step_attention: bool =
    False`` (the new query's attention over the held tokens after every decode step) and
    ``step_scorer: Callable | None = None`` (a custom score over the held keys per decode step).
    ``low_bits: int`` asks for a cache whose L tier holds codes of that width (4 by default; 2 for
    KIVI-2, see :func:`pask.kv.cache.config_for`).
    """

    name: str

    def prefill_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        """Actions for the prompt tokens outside the recent window (``ctx.leaving``)."""
        ...

    def step_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        """Final actions for the tokens that just left the recent window (``ctx.leaving``)."""
        ...
