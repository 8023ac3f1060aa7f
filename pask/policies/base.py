"""The policy protocol: which tier (H / L / R) each token gets, per layer group."""

from __future__ import annotations

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


@runtime_checkable
class Policy(Protocol):
    """Decides retention actions; called once at prefill and after every decode step per sequence."""

    name: str

    def prefill_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        """Actions for the prompt tokens outside the recent window (``ctx.leaving``)."""
        ...

    def step_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        """Final actions for the tokens that just left the recent window (``ctx.leaving``)."""
        ...
