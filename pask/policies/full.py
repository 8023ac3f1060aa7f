"""FullPolicy: keep every token in full precision (the reference budget B = 1)."""

from __future__ import annotations

from pask.policies.base import ActionSpec, SeqContext


class FullPolicy:
    """Everything stays H: no action is ever issued."""

    name = "full"

    def prefill_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        return []

    def step_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        return []
