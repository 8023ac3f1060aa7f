"""FullPolicy: keep every token in full precision (the reference budget B = 1)."""

from __future__ import annotations

from pask.policies.base import ActionSpec, PolicyBase, SeqContext


class FullPolicy(PolicyBase):
    """Everything stays H: no action is ever issued (no budget target: ``target_b`` is 1)."""

    name = "full"
    budget: float | None = None

    def prefill_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        return []

    def step_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        return []
