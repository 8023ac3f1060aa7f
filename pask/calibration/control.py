"""The all-H control run of calibration: accuracy, tags, token ids and attention captures in one pass.

Every case runs through the engine on the tiered cache with nothing compressed (a PASK table
whose every bucket is H), with its tagger and prompt labels attached, exactly as the probes run.
Per batch it writes, resumably, under ``work_dir/control/``:

- ``batches.json``: the case ids of each batch (fixed at the first call: distortion probes replay
  the same batches, so their forward passes match the control's bit for bit);
- ``cases.jsonl``: one task row per case (``run_bfcl`` / ``run_sql`` CaseResult) plus the
  generated ``token_ids``, with tags and prompt labels (the ``--save-tags`` fields);
- ``capture-NNNN.pt``: per case the attention outputs of its decode steps ``[steps, layers, hidden]``
  in the model dtype (about ``steps x layers x hidden x 2`` bytes per case in bf16);
- ``summary.json`` / ``summary.md``: as ``pask eval`` writes them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pask.calibration.buckets import ControlRow
from pask.calibration.distortion import AttnCapture, forced_capture
from pask.calibration.tasks import CalibrationTask, default_max_new_tokens, get_task
from pask.evaluation.case_rows import read_done
from pask.policies.pask import PaskPolicy
from pask.policies.table import FrozenTable
from pask.runtime.engine import generate


def all_h_policy(fingerprint: str, num_groups: int, recent_window: int) -> PaskPolicy:
    """The control policy: an empty table whose default is H (tags attached, nothing compressed)."""
    return PaskPolicy(FrozenTable({}, fingerprint, num_groups=num_groups, recent_window=recent_window))


@dataclass
class ControlRun:
    """A finished control run."""

    dir: Path
    rows: list[ControlRow]
    batches: list[list[str]]
    prompts: dict[str, list[int]]
    summary: dict
    wall_s: float
    batches_run: int  # by this call
    by_id: dict[str, ControlRow] = field(init=False)

    def __post_init__(self) -> None:
        self.by_id = {r.id: r for r in self.rows}

    @property
    def accuracy(self) -> float:
        """Fraction of correct cases (schema-error cases count as wrong, as in evaluation)."""
        return self.summary["overall"]["correct"] / max(self.summary["overall"]["n"], 1)

    def load_capture(self, batch: list[str]) -> dict[str, torch.Tensor]:
        return torch.load(self.dir / _capture_name(self.batches.index(batch)), weights_only=True)


def _capture_name(k: int) -> str:
    return f"capture-{k:04d}.pt"


def _remake_capture(lm, rows: list[dict], chunk: list, policy, path: Path) -> None:
    """The capture of a finished batch, made again by teacher-forcing its recorded tokens (all H).

    Generating the batch again could pick other tokens (another machine or thread count changes
    bf16 sums), whose capture would not match the recorded rows; the rows stay as they are.
    """
    crows = [ControlRow.from_json(r) for r in rows]
    caps = forced_capture(
        lm.model,
        [req.prompt_ids for _, req, _ in chunk],
        [r.token_ids[: r.n_fed] for r in crows],
        policy,
        [[] for _ in crows],
        [None for _ in crows],
    )
    torch.save({r.id: t for r, t in zip(crows, caps, strict=True)}, path)


def run_control(
    lm,
    cases: list,
    work_dir: Path,
    batch_size: int = 8,
    max_new_tokens: int | None = None,  # default: the task's (pask.tasks.Task.default_max_new_tokens)
    num_groups: int = 4,
    recent_window: int = 8,
    progress: Callable[[str, int, int], None] | None = None,
    task: CalibrationTask | None = None,
    captures: Collection[int] | None = None,
) -> ControlRun:
    """Run (or resume) the control; see the module docstring for the files. ``task``: BFCL by default.

    ``captures``: the batches whose attention capture must exist (None: all). A batch whose rows
    are done but whose needed capture is missing (captures are large and not committed) gets it
    again by teacher-forcing its recorded tokens (its rows are kept, never regenerated); ``()``
    only needs the rows, so a finished work dir re-solves without them."""
    task = task or get_task("bfcl")
    max_new_tokens = max_new_tokens or default_max_new_tokens(task.name)
    out = work_dir / "control"
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "cases.jsonl"
    prepared = {c.id: (c, *task.prepare(lm, c, max_new_tokens, True)) for c in cases}
    bfile = out / "batches.json"
    if bfile.exists():
        batches = json.loads(bfile.read_text())
        if sorted(i for b in batches for i in b) != sorted(i for i, p in prepared.items() if p[2] is None):
            from pask.errors import PaskError

            raise PaskError(f"{out} holds a control run of other cases; use another --out")
    else:
        runnable = sorted((p for p in prepared.values() if p[2] is None), key=lambda p: len(p[1].prompt_ids))
        batches = [[c.id for c, *_ in runnable[i : i + batch_size]] for i in range(0, len(runnable), batch_size)]
        bfile.write_text(json.dumps(batches) + "\n")
    done = read_done(jsonl)
    policy = all_h_policy(lm.fingerprint, num_groups, recent_window)
    wall_file = out / "wall.json"
    wall = json.loads(wall_file.read_text())["wall_s"] if wall_file.exists() else 0.0
    total = len(batches)
    need = range(len(batches)) if captures is None else set(captures)
    todo = [
        k
        for k, b in enumerate(batches)
        if not all(i in done for i in b) or (k in need and not (out / _capture_name(k)).exists())
    ]
    if progress:
        progress("control", total - len(todo), total)
    with open(jsonl, "a") as f:
        for c, req, err in prepared.values():  # schema errors: scored as wrong, never run
            if err is not None and c.id not in done:
                f.write(json.dumps(task.error_row(c, req, err)) + "\n")
        for k in todo:
            t0 = time.perf_counter()
            chunk = [prepared[i] for i in batches[k]]
            if all(i in done for i in batches[k]):  # rows done, capture missing: replay the recorded tokens
                _remake_capture(lm, [done[i] for i in batches[k]], chunk, policy, out / _capture_name(k))
                if progress:
                    progress("control", 1, total)
                continue
            with AttnCapture(lm.model) as cap:
                gens = generate(lm, [r for _, r, _ in chunk], policy=policy)
            rows = []
            for (c, r, _), g in zip(chunk, gens, strict=True):
                row = task.score_row(c, g, r)
                row["token_ids"] = list(g.token_ids)
                rows.append(row)
            n_fed = [ControlRow.from_json(row).n_fed for row in rows]
            caps = cap.per_row(n_fed)
            torch.save({row["id"]: t for row, t in zip(rows, caps, strict=True)}, out / _capture_name(k))
            for row in rows:
                f.write(json.dumps(row) + "\n")
            f.flush()
            wall += time.perf_counter() - t0
            wall_file.write_text(json.dumps({"wall_s": round(wall, 3)}) + "\n")
            if progress:
                progress("control", 1, total)
    all_rows = read_done(jsonl)
    wanted = [c.id for c in cases]
    rows = [all_rows[i] for i in wanted]
    summary = task.summarize(rows)
    meta = {"model": lm.name, "policy": "pask all-H control"}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(task.table_markdown(summary, meta))
    run_ids = {i for b in batches for i in b}
    return ControlRun(
        dir=out,
        rows=[ControlRow.from_json(r) for r in rows if r["id"] in run_ids],
        batches=batches,
        prompts={i: prepared[i][1].prompt_ids for i in run_ids},
        summary=summary,
        wall_s=wall,
        batches_run=len(todo),
    )
