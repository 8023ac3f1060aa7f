"""Policy overhead per decode step: what a retention policy adds to a real decode on real prompts.

The same BFCL cases are decoded (grammar-constrained, greedy, one batch at a time) with each policy
in one process, calls interleaved policy by policy per batch so machine noise hits all alike.
Per decode step (total decode wall time / steps) the time is split into

* ``decide_ms``: the policy's own decisions (``step_actions`` calls);
* ``apply_ms``: the cache carrying them out (:meth:`TieredCache.apply` / ``apply_many``: packing to INT4, releases);
  prefill-time decisions and actions are excluded (``prefill_ms`` per batch reports them);
* ``rest_ms``: everything else: the model forward (incl. the attention statistics a policy asked
  for, which replace the fused attention path), grammar masks, sampling.

References in the same run: Full KV on ``DynamicCache`` (``full``) and the tiered cache with every
token kept H (``tiered-all-h``: the tiered backend's own cost with no policy work). Timings are
ratios within one run; absolute values depend on the machine's load.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pask.kv.cache import TieredCache


@dataclass
class _Clock:
    """Decision and apply time of decode steps (prefill-time work is kept apart)."""

    decide_s: float = 0.0
    apply_s: float = 0.0
    prefill_s: float = 0.0
    phase: str = "step"


def _through(name: str) -> property:
    """A read-only property that reads ``name`` of the wrapped policy."""
    return property(lambda self: getattr(self._policy, name), doc=f"The wrapped policy's ``{name}``.")


class TimedPolicy:
    """Delegates to ``policy`` and times its decision calls.

    The :class:`~pask.policies.base.Policy` members pass through explicitly (a runtime protocol
    check on Python >= 3.12 does not see attributes served by ``__getattr__``); any other attribute
    (e.g. PASK's ``table``) passes through ``__getattr__``.
    """

    name = _through("name")
    budget = _through("budget")
    target_b = _through("target_b")
    needs_tags = _through("needs_tags")
    prefill_window = _through("prefill_window")
    prefill_value_norm = _through("prefill_value_norm")
    step_attention = _through("step_attention")
    step_scorer = _through("step_scorer")
    l2_key_bits = _through("l2_key_bits")

    def __init__(self, policy, clock: _Clock) -> None:
        self._policy, self._clock = policy, clock

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_policy", "_clock"):
            raise AttributeError(name)
        return getattr(self._policy, name)

    def __deepcopy__(self, memo: dict):
        """A copy per request (the decode core's rule) that still reports to the same clock."""
        import copy

        return type(self)(copy.deepcopy(self._policy, memo), self._clock)

    def _timed(self, fn, ctx, phase: str):
        self._clock.phase = phase
        t0 = time.perf_counter()
        try:
            return fn(ctx)
        finally:
            dt = time.perf_counter() - t0
            if phase == "step":
                self._clock.decide_s += dt
            else:
                self._clock.prefill_s += dt

    def reset(self, seq: int) -> None:
        self._policy.reset(seq)

    def prefill_actions(self, ctx):
        return self._timed(self._policy.prefill_actions, ctx, "prefill")

    def step_actions(self, ctx):
        return self._timed(self._policy.step_actions, ctx, "step")


@contextmanager
def timed_apply(clock: _Clock):
    """Time :meth:`TieredCache.apply` and :meth:`TieredCache.apply_many` (a decode step's decisions
    of every row at once, which calls ``apply`` for what it does not batch: only the outer call
    counts) for the duration of the block (restored afterwards)."""
    originals = {name: getattr(TieredCache, name) for name in ("apply", "apply_many")}
    depth = [0]

    def timed(original):
        def run(self, *args, **kwargs):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    dt = time.perf_counter() - t0
                    if clock.phase == "step":
                        clock.apply_s += dt
                    else:
                        clock.prefill_s += dt

        return run

    for name, original in originals.items():
        setattr(TieredCache, name, timed(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(TieredCache, name, original)


@dataclass
class OverheadRow:
    """Accumulated timings of one policy."""

    policy: str
    steps: int = 0
    batches: int = 0
    decode_s: float = 0.0
    clock: _Clock = field(default_factory=_Clock)
    b_total: list[float] = field(default_factory=list)

    def result(self) -> dict:
        n = max(self.steps, 1)
        step = self.decode_s / n * 1e3
        decide = self.clock.decide_s / n * 1e3
        apply = self.clock.apply_s / n * 1e3
        return {
            "policy": self.policy,
            "steps": self.steps,
            "step_ms": round(step, 3),
            "decide_ms": round(decide, 3),
            "apply_ms": round(apply, 3),
            "rest_ms": round(step - decide - apply, 3),
            "prefill_policy_ms_per_batch": round(self.clock.prefill_s / max(self.batches, 1) * 1e3, 3),
            "measured_b": round(sum(self.b_total) / len(self.b_total), 4) if self.b_total else 1.0,
        }


def bench_policy_overhead(
    lm,
    policies: Sequence[str],
    budget: float,
    cases: list,
    batch_size: int = 8,
    max_new_tokens: int | None = None,  # default: BFCL's (pask.tasks.bfcl)
    table=None,
) -> dict:
    """Decode ``cases`` with every policy (plus the two references); per-step timings per policy.

    ``table``: the frozen table (or its path) for ``pask``, checked against the model.
    """
    from pask.evaluation.run_bfcl import prepare
    from pask.policies import get_policy
    from pask.policies.factory import make_policy
    from pask.runtime.engine import generate

    names = ["full", "tiered-all-h", *[p for p in policies if p not in ("full", "tiered-all-h")]]
    rows = {n: OverheadRow(n) for n in names}
    for i in range(0, len(cases), batch_size):
        chunk = cases[i : i + batch_size]
        for name in names:
            row = rows[name]
            if name == "full":
                policy = None
            elif name == "tiered-all-h":
                policy = TimedPolicy(get_policy("full"), row.clock)
            elif name == "pask":
                from pask.policies.pask import make_pask_policy

                policy = TimedPolicy(make_pask_policy(table, budget, fingerprint=lm.fingerprint), row.clock)
            else:
                policy = TimedPolicy(make_policy(name, budget), row.clock)
            tagging = policy is not None and policy.needs_tags
            reqs = [prepare(lm, c, max_new_tokens, tagging=tagging)[0] for c in chunk]
            with timed_apply(row.clock):
                gens = generate(lm, reqs, policy=policy)
            steps = max(len(g.token_ids) for g in gens) - 1  # decode forwards: the last token is not fed
            row.steps += steps
            row.batches += 1
            row.decode_s += gens[0].tpot_ms * steps / 1e3  # tpot: decode wall time / forwards of the batch
            row.b_total += [g.extra["budget"]["b_total"] for g in gens if "budget" in g.extra]
    out = [rows[n].result() for n in names]
    ref = out[0]["step_ms"]
    ref_tiered = out[1]["step_ms"]
    for r in out:
        r["step_vs_full"] = round(r["step_ms"] / ref, 3) if ref else None
        r["step_vs_tiered_all_h"] = round(r["step_ms"] / ref_tiered, 3) if ref_tiered else None
        r["policy_share_of_step"] = round((r["decide_ms"] + r["apply_ms"]) / r["step_ms"], 4) if r["step_ms"] else 0
    return {"model": lm.name, "budget": budget, "cases": len(cases), "batch_size": batch_size, "rows": out}


def overhead_markdown(result: dict, command: str = "") -> str:
    """The per-step table (one row per policy)."""
    lines = [
        f"# Policy overhead per decode step: {result['model']}, B = {result['budget']}, "
        f"{result['cases']} BFCL cases, batch {result['batch_size']}",
        "",
    ]
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += [
        "| Policy | B | step ms | decide ms | apply ms | rest ms | policy share | vs Full KV | vs tiered all-H |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['policy']} | {r['measured_b']:.3f} | {r['step_ms']:.1f} | {r['decide_ms']:.2f} | "
            f"{r['apply_ms']:.2f} | {r['rest_ms']:.1f} | {100 * r['policy_share_of_step']:.1f} % | "
            f"{r['step_vs_full']:.2f}x | {r['step_vs_tiered_all_h']:.2f}x |"
        )
    lines += [
        "",
        "decide: the policy's own calls; apply: the cache packing / releasing what it decided; rest: model forward "
        "(with any attention statistics the policy asked for), grammar masks, sampling. Per decode step of a batch.",
    ]
    return "\n".join(lines) + "\n"


def write(result: dict, out_dir: Path, command: str = "", allow_dirty: bool = False) -> tuple[Path, Path | None]:
    """``out_dir/policy_overhead.json`` and ``.md`` with their provenance
    (:func:`pask.experiments.provenance.write_result`)."""
    from pask.experiments.provenance import write_result

    data = {**result, "command": command}
    md = overhead_markdown(result, command)
    return write_result(out_dir / "policy_overhead", data, md, command=command or None, allow_dirty=allow_dirty)
