"""Scale-out of a sweep on a Ray cluster (``pask sweep --ray local|auto|ADDRESS``).

The remaining cases of every unfinished cell are cut into shards; each shard is one Ray task that
loads its model once, runs the cell's task runner on the shard into its own directory
``<cell>/shards/NNNN/`` and returns the rows. The driver appends the rows to the cell's
``cases.jsonl`` as shards finish (skipping ids already there) and, after the cell's last shard,
writes the summary and marks ``cell.json`` done -- the same layout and resume rules as
in-process. A sweep killed mid-way keeps every merged row; rows of unfinished shards that reached
the results directory (local cluster or shared file system) are folded in by the next run.

Workers need pask (and the models' packages) installed in the same environment as the driver.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from pask.errors import PaskError
from pask.evaluation.case_rows import read_done
from pask.experiments.sweep import (
    SHARDS_DIR,
    TASKS,
    Cell,
    CellPlan,
    TaskSpec,
    default_loader,
    finish_cell,
    merge_rows,
    run_cases,
    set_threads,
    start_cell,
)


def connect(address: str) -> bool:
    """Join (``auto`` / an address) or start (``local``) a Ray cluster; True if this call started Ray."""
    try:
        import ray
    except ImportError:
        raise PaskError("--ray needs the optional dependency ray: pip install 'pask[ray]'") from None
    if ray.is_initialized():
        return False
    try:
        if address == "local":
            ray.init(include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except ConnectionError as e:
        raise PaskError(f"cannot reach a Ray cluster at '{address}': {e} (use --ray local to start one)") from None
    return True


def run_shard(cell: Cell, task: TaskSpec, case_ids: list[str], shard_dir: str) -> list[dict]:
    """Ray task body: load the model once, run the shard's cases into ``shard_dir``, return their rows.

    ``task`` travels with the shard, so tasks registered at run time work on the workers too.
    """
    TASKS.setdefault(task.name, task)
    set_threads(cell.threads)
    lm = default_loader(cell.model, cell.dtype, cell.weights)
    wanted = set(case_ids)
    cases = [c for c in cell.load_cases() if c.id in wanted]
    run_cases(cell, lm, cases, Path(shard_dir))
    rows = read_done(Path(shard_dir) / "cases.jsonl")
    return [rows[i] for i in case_ids if i in rows]


@dataclass
class _Active:
    plan: CellPlan
    manifest: dict
    started: float
    shards: int
    left: int
    merged: int
    running: dict[str, Path] = field(default_factory=dict)  # shard name -> dir


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


def _cause(err: Exception) -> str:
    cause = getattr(err, "cause", None)
    return str(cause) if cause is not None else str(err).strip().splitlines()[-1]


def run_cells_ray(plans, config, version, address, tracker, cell_done, shard_size: int | None) -> None:
    """Run the unfinished cells of ``plans`` as sharded Ray tasks (see the module docstring)."""
    import ray

    if shard_size is not None and shard_size < 1:
        raise PaskError(f"--shard-size must be >= 1, got {shard_size}")
    started_ray = connect(address)
    pending: dict = {}  # ObjectRef -> (cell name, shard name, shard dir)
    active: dict[str, _Active] = {}
    try:
        remote = ray.remote(run_shard)
        cpus = ray.cluster_resources().get("CPU", 1)
        for p in [p for p in plans if p.state != "done"]:
            man = start_cell(p, version, "ray")
            done = set(read_done(p.dir / "cases.jsonl"))
            todo = [c.id for c in p.cases if c.id not in done]
            threads = p.cell.threads or 1
            size = shard_size or max(1, math.ceil(len(todo) / max(1, int(cpus // threads))))
            chunks = [todo[i : i + size] for i in range(0, len(todo), size)]
            st = _Active(p, man, time.perf_counter(), len(chunks), len(chunks), len(p.cases) - len(todo))
            active[p.cell.name] = st
            tracker.set(p, st.merged)
            if not chunks:
                _finish(st, tracker, cell_done)
                continue
            for k, ids in enumerate(chunks):
                sd = p.dir / SHARDS_DIR / f"{k:04d}"
                task = remote.options(num_cpus=threads, name=f"pask-sweep {p.cell.name} #{k}")
                ref = task.remote(p.cell, TASKS[p.cell.task], ids, str(sd))
                pending[ref] = (p.cell.name, sd.name, sd)
                st.running[sd.name] = sd
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            for ref in ready:
                name, shard, sd = pending.pop(ref)
                st = active[name]
                try:
                    rows = ray.get(ref)
                except ray.exceptions.RayError as e:
                    raise PaskError(f"cell {name}: shard {shard} failed: {_cause(e)}") from None
                st.merged += merge_rows(st.plan.dir, rows, {c.id for c in st.plan.cases})
                st.running.pop(shard)
                shutil.rmtree(sd, ignore_errors=True)
                st.left -= 1
                if st.left == 0:
                    _finish(st, tracker, cell_done)
            for st in active.values():  # per-case progress from the shards' files (local / shared disks)
                if st.left:
                    tracker.set(st.plan, st.merged + sum(_lines(d / "cases.jsonl") for d in st.running.values()))
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
        if started_ray:
            ray.shutdown()


def _finish(st: _Active, tracker, cell_done) -> None:
    p = st.plan
    run_cases(p.cell, None, p.cases, p.dir)  # every case has a row: writes the summary only
    wall = time.perf_counter() - st.started
    summary = finish_cell(p, st.manifest, wall, {"shards": st.shards})
    shutil.rmtree(p.dir / SHARDS_DIR, ignore_errors=True)
    tracker.set(p, len(p.cases))
    cell_done(p, summary, wall, len(p.cases) - st.manifest["runs"][-1]["cases_before"])


__all__ = ["connect", "run_cells_ray", "run_shard"]
