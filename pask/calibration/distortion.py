"""Runtime-D: attention-output distortion of a single-bucket probe vs the all-H control.

The attention output of layer ``l`` is the input of its ``self_attn.o_proj`` (all heads
concatenated, before the output projection), captured by a forward pre-hook at every decode
step. The control run (:mod:`pask.calibration.control`) stores, per case, the capture of each
decode step ``[steps, layers, hidden]``. A probe replays the same cases in the same batches with
teacher forcing: :func:`pask.runtime.runner.decode_with_policy` on a real :class:`TieredCache`
(INT4 packing and release are real), its ``next_token_fn`` returning the control's generated
tokens, so every step sees exactly the control's sequence and only the cache differs.

Per decode step ``t`` of a case and layer ``l``:
``e(t, l) = ||out_probe(t, l) - out_full(t, l)||_2 / ||out_full(t, l)||_2`` (fp32).
Pooled over every decode step of every case (each step weighs the same):

- ``d``: mean of ``e`` over the layers of the probed bucket's layer group (the layers whose
  cache the probe changed) -- the value the solver ranks by;
- ``d_all``: mean over all layers (includes the downstream effect on later groups);
- ``d_per_group``: mean per layer group.

Prefill outputs are not compared: actions are applied after the prefill forward.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from pask.kv.cache import CacheConfig, layer_groups
from pask.policies.base import ActionSpec, Policy, PolicyBase, SeqContext
from pask.runtime.runner import decode_with_policy

FORCED_STOP = -1  # returned by the forcing next_token_fn once a row's tokens are used up


class AttnCapture:
    """Forward pre-hooks on every layer's ``self_attn.o_proj`` collecting decode-step inputs.

    A forward of one query position is a decode step: it adds one entry ``[layers, batch, hidden]``.
    Longer forwards are prefills and are not kept, nor counted (a prefill loaded from the prefill
    store runs no forward at all). Use as a context manager.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.projs = [layer.self_attn.o_proj for layer in model.model.layers]
        self.handles: list = []
        self.reset()

    def reset(self) -> None:
        self.steps: list[list[torch.Tensor | None]] = []
        self._decoding = False

    def _hook(self, idx: int):
        def f(module, args):
            if idx == 0:
                self._decoding = args[0].shape[1] == 1
                if self._decoding:
                    self.steps.append([None] * len(self.projs))
            if self._decoding:
                self.steps[-1][idx] = args[0][:, -1, :].detach().clone()

        return f

    def __enter__(self) -> AttnCapture:
        self.reset()
        self.handles = [p.register_forward_pre_hook(self._hook(i)) for i, p in enumerate(self.projs)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def per_row(self, n_steps: list[int]) -> list[torch.Tensor]:
        """Row ``r``'s captures of its first ``n_steps[r]`` decode steps: ``[n, layers, hidden]``.

        A step's batch holds either every row, or only the rows still decoding (finished rows leave
        the batch, the others keep their order): row ``r``'s place is then its rank among the rows
        with ``n_steps > t``. Any other batch size is an error, never a silent misalignment."""
        for r, n in enumerate(n_steps):
            if n > len(self.steps):
                raise RuntimeError(f"row {r} needs {n} decode steps, only {len(self.steps)} were captured")
        place: list[dict[int, int]] = []
        for t, step in enumerate(self.steps):
            live = [r for r, n in enumerate(n_steps) if n > t]
            size = step[0].shape[0]
            if size == len(n_steps):
                place.append({r: r for r in live})
            elif size == len(live):
                place.append({r: i for i, r in enumerate(live)})
            else:
                raise RuntimeError(
                    f"decode step {t} captured {size} rows; expected {len(n_steps)} (all) "
                    f"or {len(live)} (still decoding)"
                )
        out = []
        for r, n in enumerate(n_steps):
            rows = [torch.stack([layer[place[t][r]] for layer in self.steps[t]]) for t in range(n)]
            hidden = len(self.projs), self.projs[0].in_features
            out.append(torch.stack(rows) if rows else torch.empty((0, *hidden)))
        return out


@dataclass
class ForcedContext(PolicyBase):
    """Wraps a policy so it sees known tags / prompt labels (teacher forcing gives it none).

    A :class:`~pask.policies.base.Policy` itself: its budget and per-row reset are the wrapped
    policy's; it asks for no statistics and no tags (the replay supplies the tags).
    """

    policy: Policy
    tags: list[list]
    labels: list[list | None]
    name: str = "forced"
    needs_tags: bool = False

    @property
    def budget(self) -> float | None:
        return self.policy.budget

    @property
    def target_b(self) -> float:
        return self.policy.target_b

    @property
    def l2_key_bits(self) -> int | None:  # type: ignore[override]
        return self.policy.l2_key_bits

    def reset(self, seq: int) -> None:
        self.policy.reset(seq)

    def _ctx(self, ctx: SeqContext) -> SeqContext:
        return replace(ctx, tags=self.tags[ctx.seq], prompt_labels=self.labels[ctx.seq])

    def prefill_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        return self.policy.prefill_actions(self._ctx(ctx))

    def step_actions(self, ctx: SeqContext) -> list[ActionSpec]:
        return self.policy.step_actions(self._ctx(ctx))


def forced_capture(
    model: torch.nn.Module,
    prompts: list[list[int]],
    tokens: list[list[int]],
    policy,
    tags: list[list],
    labels: list[list | None],
    cache_config: CacheConfig | None = None,
) -> list[torch.Tensor]:
    """Replay ``prompts`` + forced ``tokens`` under ``policy``; captures ``[len(tokens[r]), layers, hidden]``."""
    picked = [0] * len(prompts)

    def force(row: int, logits: torch.Tensor) -> int:
        k = picked[row]
        picked[row] += 1
        return tokens[row][k] if k < len(tokens[row]) else FORCED_STOP

    with AttnCapture(model) as cap:
        decode_with_policy(
            model,
            prompts,
            ForcedContext(policy, tags, labels),
            max_new_tokens=max((len(t) for t in tokens), default=0) + 1,
            cache_config=cache_config,
            next_token_fn=force,
            stop_token_ids=(FORCED_STOP,),
        )
    return cap.per_row([len(t) for t in tokens])


@dataclass
class DistortionSum:
    """Running sums of the relative error per layer over decode steps."""

    num_layers: int
    err: torch.Tensor = field(init=False)
    steps: int = 0

    def __post_init__(self) -> None:
        self.err = torch.zeros(self.num_layers, dtype=torch.float64)

    def add(self, probe: torch.Tensor, full: torch.Tensor) -> None:
        """``probe``, ``full``: ``[steps, layers, hidden]`` of one case."""
        if full.shape[0] == 0:
            return
        p, f = probe.float(), full.float()
        e = (p - f).norm(dim=-1) / f.norm(dim=-1).clamp_min(1e-12)  # [steps, layers]
        self.err += e.sum(0).double()
        self.steps += f.shape[0]

    def result(self, group: int, num_groups: int) -> dict:
        per_layer = (self.err / max(self.steps, 1)).tolist()
        groups = layer_groups(self.num_layers, num_groups)
        per_group = [sum(per_layer[i] for i in r) / len(r) for r in groups]
        return {
            "d": per_group[group],
            "d_all": sum(per_layer) / len(per_layer),
            "d_per_group": per_group,
            "steps": self.steps,
        }


def spaced(items: list, k: int | None) -> list:
    """``k`` evenly spaced elements of ``items`` (all of them when ``k`` is None or large enough)."""
    n = len(items)
    if k is None or k >= n:
        return list(items)
    if k < 1:
        raise ValueError(f"need at least one batch, got {k}")
    return [items[(2 * i + 1) * n // (2 * k)] for i in range(k)]


def run_distortion(
    lm,
    control,
    plan,
    candidates: list[tuple[str, str]],
    work_dir: Path,
    make_policy: Callable[[str, str], object],
    cache_config: CacheConfig | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    max_batches: int | None = None,
) -> tuple[dict[tuple[str, str], dict], int]:
    """D(q, a) for every candidate (bucket, action), resumable from ``work_dir/distortion.jsonl``.

    ``max_batches``: replay only that many of the control's batches, evenly spaced (D is a mean
    over decode steps and needs fewer cases than V's accuracy). Returns (records by candidate,
    candidates computed by this call).
    """
    from pask.calibration.sensitivity import read_records

    path = work_dir / "distortion.jsonl"
    done = read_records(path)
    todo = [c for c in candidates if c not in done]
    if progress:
        progress("distortion", len(candidates) - len(todo), len(candidates))
    num_layers = lm.num_layers
    groups = {name: g for name, _, g, _ in plan.buckets()}
    batches = spaced(control.batches, max_batches)
    with open(path, "a") as f:
        for bucket, action in todo:
            t0 = time.perf_counter()
            acc = DistortionSum(num_layers)
            policy = make_policy(bucket, action)
            for batch in batches:
                rows = [control.by_id[i] for i in batch]
                probe = forced_capture(
                    lm.model,
                    [control.prompts[r.id] for r in rows],
                    [r.token_ids[: r.n_fed] for r in rows],
                    policy,
                    [r.tags or [] for r in rows],
                    [r.prompt_labels for r in rows],
                    cache_config,
                )
                full = control.load_capture(batch)
                for r, p in zip(rows, probe, strict=True):
                    acc.add(p, full[r.id])
            rec = {"bucket": bucket, "action": action, **acc.result(groups.get(bucket, 0), plan.num_groups)}
            rec["wall_s"] = round(time.perf_counter() - t0, 3)
            f.write(json.dumps(rec) + "\n")
            f.flush()
            done[(bucket, action)] = rec
            if progress:
                progress("distortion", 1, len(candidates))
    return done, len(todo)
