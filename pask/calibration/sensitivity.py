"""Runtime-V: task-error sensitivity V(q, a) of each bucket q and cheaper action a in {L, R}.

For every candidate (q, a) the task runs on the calibration cases with a single-bucket probe: a
:class:`~pask.policies.pask.PaskPolicy` over a table where only ``q``'s members get ``a`` and
everything else stays H. ``V(q, a) = accuracy(all-H control) - accuracy(probe)`` as a fraction of
the cases (0.05 = 5 pp; negative when the probe happens to do better). With a screen
(:mod:`pask.calibration.screening`) the probes run only the screened control-correct cases and V
is their weighted flips.

Resumable at two levels: ``work_dir/sensitivity.jsonl`` gets one line per finished candidate
(finished candidates are skipped), and each candidate's run directory
``work_dir/sensitivity/<action>-<bucket>/`` is a normal resumable output of the task's runner
(``run_bfcl`` / ``run_sql``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

from pask.calibration.screening import Screen, screen_all
from pask.calibration.tasks import CalibrationTask, default_max_new_tokens, get_task
from pask.evaluation.case_rows import read_done
from pask.policies.pask import PaskPolicy
from pask.policies.table import FrozenTable


def read_records(path: Path) -> dict[tuple[str, str], dict]:
    """Finished candidates of a JSONL file, by (bucket, action); a torn last line is ignored."""
    return read_done(path, key=lambda rec: (rec["bucket"], rec["action"]))


def slug(bucket: str, action: str) -> str:
    """Directory name of a candidate."""
    return f"{action}-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", bucket)


def probe_policy(
    plan, bucket: str, action: str, fingerprint: str, recent_window: int, l2_key_bits: int = 2
) -> PaskPolicy:
    """PASK policy where only ``bucket`` (all its member table keys) gets ``action`` (L2 at ``l2_key_bits``)."""
    acts = dict.fromkeys(plan.members(bucket), action)
    table = FrozenTable(
        acts, fingerprint, num_groups=plan.num_groups, recent_window=recent_window, l2_key_bits=l2_key_bits
    )
    return PaskPolicy(table)


def run_sensitivity(
    lm,
    cases: list,
    control,
    plan,
    candidates: list[tuple[str, str]],
    work_dir: Path,
    batch_size: int = 8,
    max_new_tokens: int | None = None,  # default: the task's (pask.tasks.Task.default_max_new_tokens)
    progress: Callable[[str, int, int], None] | None = None,
    task: CalibrationTask | None = None,
    screen: Screen | None = None,
    l2_key_bits: int = 2,
) -> tuple[dict[tuple[str, str], dict], int]:
    """V(q, a) for every candidate; returns (records by candidate, candidates computed by this call).

    ``screen``: run the probes on its cases only and weigh their flips (default: every case of
    ``cases`` that the control ran, weight 1 / n)."""
    task = task or get_task("bfcl")
    max_new_tokens = max_new_tokens or default_max_new_tokens(task.name)
    n = control.summary["overall"]["n"]
    ctrl = {r.id: r.correct for r in control.rows}
    screen = screen or screen_all([c.id for c in cases if c.id in ctrl], n)
    probed = [c for c in cases if c.id in screen.weights]
    path = work_dir / "sensitivity.jsonl"
    done = read_records(path)
    todo = [c for c in candidates if c not in done]
    if progress:
        progress("sensitivity", len(candidates) - len(todo), len(candidates))
    with open(path, "a") as f:
        for bucket, action in todo:
            t0 = time.perf_counter()
            policy = probe_policy(plan, bucket, action, lm.fingerprint, plan.recent_window, l2_key_bits)
            meta = {"model": lm.name, "policy": f"pask probe {bucket} -> {action}"}
            run_dir = work_dir / "sensitivity" / slug(bucket, action)
            s = task.run(
                lm,
                probed if screen.screened else cases,
                run_dir,
                batch_size,
                max_new_tokens,
                policy,
                None,
                meta,
            )
            rows = read_done(run_dir / "cases.jsonl")
            rec = {
                "bucket": bucket,
                "action": action,
                "v": screen.v(ctrl, {i: bool(r["correct"]) for i, r in rows.items()}),
                "correct": s["overall"]["correct"],
                "control_correct": sum(ctrl[i] for i in screen.weights),
                "n": s["overall"]["n"],
                "measured_b": s["measured_b"],
                "wall_s": round(time.perf_counter() - t0, 3),
            }
            f.write(json.dumps(rec) + "\n")
            f.flush()
            done[(bucket, action)] = rec
            if progress:
                progress("sensitivity", 1, len(candidates))
    return done, len(todo)
