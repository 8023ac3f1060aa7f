"""PaskPolicy: Parser-Aware Structural KV persistence -- an online lookup in a frozen table.

Paper: "Parser Transitions Already Reveal Structural Responsibility: KV Persistence for
Structured Generation" (Wu & Chen, 2026). Each token leaving the recent window gets, in every
layer group ``g``, the action the calibrated table gives its bucket:

- a prompt token (position < ``prompt_len``): bucket ``(prompt label, g)``;
- a generated token: bucket ``(structural tag of that token, g)``.

A token whose bucket the table does not list (or that has no label / tag, e.g. a task without a
labeller) gets the table's ``default_action``. No attention score, no importance estimate: the
online cost is a dictionary lookup per leaving token (see :func:`benchmark_overhead`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pask.errors import PaskError
from pask.kv.actions import Action
from pask.policies.base import ActionSpec, PolicyBase, SeqContext
from pask.policies.table import FrozenTable, parse_action
from pask.structure.tags import Bucket, PromptLabel, Tag

_H = int(Action.H)
_LOSSY = (int(Action.L), int(Action.L2), int(Action.R))  # every action that moves a token out of H


@dataclass
class PaskPolicy(PolicyBase):
    """Frozen-table retention (H / INT4 / INT2 / release per bucket x layer group).

    Parameters
    ----------
    table : FrozenTable
        The calibrated table (:mod:`pask.calibration`). Its ``num_groups`` and ``recent_window``
        must match the cache the policy runs on.
    prefill : bool
        Apply the table to prompt tokens; ``False`` keeps every prompt token H
        ("Decode-only" row of the paper's Table 17).
    decode : bool
        Apply the table to generated tokens; ``False`` keeps every generated token H
        ("Prefill-only" row of Table 17).

    Notes
    -----
    The budget is the table's: ``budget`` is the table's ``target_b`` (``None`` for a table
    calibrated without one) and ``target_b`` falls back to its ``expected_b``, then 1. ``table``
    is PASK's own member, not part of the :class:`~pask.policies.base.Policy` protocol. The policy
    keeps no per-sequence state (``reset`` does nothing): ``_rows`` is the table's lookup.
    """

    table: FrozenTable
    prefill: bool = True
    decode: bool = True
    name: str = "pask"
    needs_tags: bool = True  # run_bfcl attaches a JsonCallTagger and prompt labels to each request
    _rows: dict = field(init=False, repr=False, default_factory=dict)
    _default: tuple[int, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        g = self.table.num_groups
        self._default = (int(parse_action(self.table.default_action)),) * g
        rows: dict[Tag | PromptLabel, list[int]] = {}
        for key, act in self.table.actions.items():
            b = Bucket.parse(key)
            rows.setdefault(b.item, list(self._default))[b.group] = int(parse_action(act))
        self._rows = {item: tuple(acts) for item, acts in rows.items()}
        # saved runs carry tags as strings: "class|role|state|next" finds the same row
        self._rows.update({str(item): acts for item, acts in self._rows.items() if isinstance(item, Tag)})

    @property
    def budget(self) -> float | None:
        """The B the table was calibrated for (``None``: the table gives none)."""
        return self.table.target_b

    @property
    def l2_key_bits(self) -> int:  # type: ignore[override]
        """The table's L2 key width (4: K4V2), which the cache must be built with."""
        return self.table.l2_key_bits

    @property
    def target_b(self) -> float:
        """The table's ``target_b``, else its ``expected_b``, else 1."""
        t = self.table
        b = t.target_b if t.target_b is not None else t.expected_b
        return 1.0 if b is None else float(b)

    # -- lookup ---------------------------------------------------------------------------------
    def actions_of(self, item) -> tuple[int, ...]:
        """Action (as int) per layer group for a tag / prompt label (or its string); default if unknown."""
        return self._rows.get(item, self._default)

    def _item(self, ctx: SeqContext, pos: int):
        if pos < ctx.prompt_len:
            labels = ctx.prompt_labels
            return labels[pos] if labels is not None and pos < len(labels) else None
        i = pos - ctx.prompt_len
        return ctx.tags[i] if i < len(ctx.tags) else None

    def _check(self, ctx: SeqContext) -> None:
        t = self.table
        if ctx.num_groups != t.num_groups or ctx.recent_window != t.recent_window:
            raise PaskError(
                f"table calibrated for {t.num_groups} layer groups / recent window {t.recent_window}, "
                f"but the cache has {ctx.num_groups} groups / window {ctx.recent_window}"
            )

    def _actions(self, ctx: SeqContext) -> list[ActionSpec]:
        pos = ctx.leaving
        n = pos.numel()
        if n == 0:
            return []
        self._check(ctx)
        rows, default = self._rows, self._default
        plist = pos.tolist()
        acts: list[tuple[int, ...]] = []
        keep = []
        for p in plist:
            if not (self.prefill if p < ctx.prompt_len else self.decode):
                continue
            keep.append(p)
            acts.append(rows.get(self._item(ctx, p), default))
        if not keep:
            return []
        if len(keep) == 1:  # the usual decode step: no tensor ops
            out: list[ActionSpec] = []
            p, a = keep[0], acts[0]
            t = None
            for g, act in enumerate(a):
                if act != _H:
                    t = t if t is not None else torch.tensor([p], dtype=torch.long)
                    out.append((g, t, Action(act)))
            return out
        table = torch.tensor(acts, dtype=torch.int8)  # [n, G]
        ptens = torch.tensor(keep, dtype=torch.long)
        out = []
        for g in range(table.shape[1]):
            col = table[:, g]
            for act in _LOSSY:
                sel = ptens[col == act]
                if sel.numel():
                    out.append((g, sel, Action(act)))
        return out

    def prefill_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        return self._actions(ctx)

    def step_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        return self._actions(ctx)


def check_task(table: FrozenTable, task: str, allow_transfer: bool = False) -> bool:
    """Whether ``table`` was calibrated on another task than ``task``: refused (PaskError) unless
    ``allow_transfer`` (a transfer experiment), else True for a transfer, False for the table's own task."""
    if table.task in (None, task):
        return False
    if not allow_transfer:
        raise PaskError(
            f"the PASK table was calibrated for task '{table.task}', not '{task}' "
            "(a transfer experiment needs allow_transfer: --allow-transfer, or allow_transfer = true in a sweep)"
        )
    return True


def make_pask_policy(
    table: FrozenTable | str | Path,
    budget: float | None = None,
    prefill: bool = True,
    decode: bool = True,
    fingerprint: str | None = None,
    allow_transfer: bool = False,
    task: str | None = None,
) -> PaskPolicy:
    """Registry / CLI factory: ``table`` is a :class:`FrozenTable` or the path of a table file.

    ``fingerprint`` (the loaded model's) is checked against the table's (see
    :func:`pask.policies.table.load`), and ``task`` (where given) against the task it was
    calibrated on; ``allow_transfer`` lets a table of another model or task through (a
    transfer experiment: the table's actions for the tags and labels it knows). The budget is the
    table's: a ``budget`` that differs from the table's ``target_b`` is an error (calibrate a table
    for that budget instead).
    """
    from pask.policies.table import load

    if not isinstance(table, FrozenTable):
        table = load(table, fingerprint=fingerprint, allow_transfer=allow_transfer)
    if task is not None:
        check_task(table, task, allow_transfer)
    if budget is not None and table.target_b is not None and abs(budget - table.target_b) > 1e-9:
        raise PaskError(
            f"the PASK table was calibrated for B = {table.target_b}, not {budget}: "
            "calibrate a table for that budget (`pask calibrate --budget`)"
        )
    return PaskPolicy(table, prefill=prefill, decode=decode)


def benchmark_overhead(
    policy: PaskPolicy | None = None,
    steps: int = 2000,
    prompt_len: int = 256,
    recent_window: int = 8,
    num_groups: int = 4,
) -> dict[str, float]:
    """Per-step cost of the policy on a synthetic tagged sequence (no model): µs per decode step.

    Times ``step_actions`` with one leaving token per step (the steady state of decoding), and
    a ``prefill_actions`` call over ``prompt_len - recent_window`` prompt tokens (best of 5). Without a
    policy, one is built over a table that sends half of the buckets to L and half to R.
    """
    from pask.structure.tags import json_tags

    tags = list(json_tags())
    labels = list(PromptLabel)
    if policy is None:
        acts = {}
        for i, item in enumerate([*tags, *labels]):
            for g in range(num_groups):
                acts[str(Bucket(item, g))] = "HLR"[(i + g) % 3]
        policy = PaskPolicy(
            FrozenTable(acts, "synthetic", num_groups=num_groups, recent_window=recent_window, default_action="H")
        )
    prompt_labels = [labels[i % len(labels)] for i in range(prompt_len)]
    gen_tags = [tags[(7 * i) % len(tags)] for i in range(steps + recent_window)]

    def ctx(leaving: torch.Tensor, length: int) -> SeqContext:
        return SeqContext(0, prompt_len, length, recent_window, num_groups, leaving, [], gen_tags, prompt_labels)

    policy.prefill_actions(ctx(torch.arange(2), prompt_len))  # warm-up (first tensor ops)
    prefill_us = math.inf
    for _ in range(5):  # best of 5
        t0 = time.perf_counter()
        policy.prefill_actions(ctx(torch.arange(prompt_len - recent_window), prompt_len))
        prefill_us = min(prefill_us, (time.perf_counter() - t0) * 1e6)
    ctxs = [
        ctx(torch.tensor([prompt_len - recent_window + s]), prompt_len + s + 1) for s in range(steps)
    ]  # built outside the timed loop, as the session builds them
    t0 = time.perf_counter()
    for c in ctxs:
        policy.step_actions(c)
    step_us = (time.perf_counter() - t0) * 1e6 / steps
    return {"step_us": round(step_us, 2), "prefill_us": round(prefill_us, 1), "prefill_tokens": prompt_len}
