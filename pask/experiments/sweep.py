"""Evaluation sweeps: models x tasks x policies x budgets x splits from a TOML file, run cell by cell.

Config file (``tomllib``; relative paths are relative to the config file)::

    results_dir = "results/paper"
    dtype = "bf16"                 # bf16 | fp32
    weights = "bf16"               # bf16 | int8 | int4: the linear layers' format (pask.cpu.weights)
    threads = 2                    # torch threads per process (per Ray task)
    models = ["qwen2.5-coder-0.5b"]
    tasks = ["bfcl"]
    splits = ["test"]
    policies = ["full", "pask", "h2o"]
    budgets = [0.33]               # needed when a policy other than full is listed

    [[grid]]                       # more products; a key it lacks takes the top-level value
    tasks = ["sql"]
    policies = ["pask"]
    budgets = [0.6, 0.5]

    [bfcl]                         # options of one task (COMMON_OPTIONS + the task's own)
    categories = ["simple", "multiple", "parallel", "parallel_multiple"]
    limit = 10                     # bfcl: cases per category; sql: first N cases of the split
    batch_size = 8
    batching = "static"            # static | continuous (a finished row takes the next case)
    max_new_tokens = 384
    [bfcl.tables."qwen2.5-coder-0.5b"]
    "0.33" = "tables/qwen-bfcl-0.33.json"   # PASK table per (model, budget)
    "pask-3a@0.33" = "tables/qwen-bfcl3-0.33.json"   # pask-3a: a three-action table (no INT2)
    [bfcl.policy_config.h2o]
    recent = 32                    # overrides the tuned configuration

    [[grid]]                       # a variant: the same policy with other options, a cell of its own
    policies = ["fetch-snapkv~grammar"]
    [bfcl.policy_config."fetch-snapkv~grammar"]
    trigger = "grammar"            # on top of fetch-snapkv's own policy_config

A policy written ``<policy>~<variant>`` (variant: lower-case letters, digits, ``_``; not ``full``)
is that policy with the options of its ``policy_config`` key ``"<policy>~<variant>"`` on top of
the policy's own, as a separate cell beside the plain one (compare two settings of one method in
one results dir and report); the variant needs options of its own. Each cell writes
``results_dir/<model>/<task>/<split>/<policy>[~<variant>]-b<budget>/`` (Full KV is
``full-b1``) through its task runner, which keeps the per-case rows in a resumable
``cases.jsonl`` and writes ``summary.json`` / ``summary.md``. ``cell.json`` records the cell, a
hash of everything that changes its results (``config_hash``), the code version, timing and, per
run, its provenance (command, code version, machine, ``PASK_*`` environment:
:mod:`pask.experiments.provenance`).
A rerun skips finished cells and resumes unfinished ones; a cell made by another code version
or configuration is refused (:class:`PaskError`) unless ``overwrite=True`` (``--force``), which
deletes and reruns it. ``results_dir/sweep-<config stem>.json`` records the last sweep of a config: status and timing
per cell. Policies ``pask-prefill`` / ``pask-decode`` are PASK with the table applied to the
prompt only / to generated tokens only (the paper's Table 17 ablation). ``pask-3a`` is PASK with a
three-action table (BF16 / INT4 / release: calibrated with ``--actions L,R``), given under the key
``"pask-3a@<budget>"``, beside the four-action ``pask`` tables on the same frontier; ``pask-k4v2``
likewise with a K4V2 table (``--l2-key-bits 4``: its L2 action keeps INT4 keys), key
``"pask-k4v2@<budget>"``.

Tasks are those of the registry :data:`pask.tasks.TASKS` (``bfcl``, ``sql``, and any task registered
there): each takes the options of :data:`COMMON_OPTIONS` (``max_new_tokens`` defaulting to the
task's own) plus its own (:attr:`pask.tasks.Task.options`, e.g. BFCL ``categories``, SQL
``data_dir``), and runs through :func:`pask.evaluation.runner.run_task`. The sweep's view of a task
is a :class:`TaskSpec` (:data:`TASKS`); a spec set there directly brings a runner of its own.
Runners share one contract:
``run(lm, cases, out_dir, batch_size, max_new_tokens, policy, progress, meta, save_tags, **extra)``
resumes from ``out_dir/cases.jsonl`` (one row per case, key ``id``) and returns the summary; given
only finished cases it writes the summary without touching ``lm`` (so shards run elsewhere can be
merged, see :mod:`pask.experiments.ray_shards`).
"""

from __future__ import annotations

import gc
import hashlib
import importlib
import itertools
import json
import re
import shutil
import sys
import time
import tomllib
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from pask.errors import PaskError
from pask.evaluation.case_rows import read_done, repair_jsonl
from pask.evaluation.continuous import BATCHING
from pask.experiments.provenance import code_version, default_command, machine, pask_env, versions

CELL_FILE = "cell.json"
SWEEP_FILE = "sweep.json"  # the record's name for a config given without a file


def record_path(config: SweepConfig) -> Path:
    """Where a sweep's record goes: ``sweep-<config stem>.json`` (configs sharing a results dir keep
    their own records), ``sweep.json`` for a config without a file."""
    name = f"sweep-{Path(config.source).stem}.json" if config.source else SWEEP_FILE
    return config.results_dir / name


SHARDS_DIR = "shards"
ABLATIONS = {
    "pask": (True, True),
    "pask-prefill": (True, False),
    "pask-decode": (False, True),
    "pask-3a": (True, True),
    "pask-k4v2": (True, True),
    "fetch-pask": (True, True),  # KVFetch around PASK (policy_config: the wrapper's options)
}
#: PASK variants whose table is their own (key ``"<policy>@<budget>"``), not the ``pask`` table.
#: ``fetch-pask``'s is a table fitted to the hot budget KVFetch leaves it (docs/kvfetch.md).
OWN_TABLES = ("pask-3a", "pask-k4v2", "fetch-pask")
DTYPES = ("bf16", "fp32")
_PRODUCT_KEYS = ("models", "tasks", "splits", "policies", "budgets")
_TOP_KEYS = {"results_dir", "dtype", "weights", "threads", "grid", *_PRODUCT_KEYS}

Progress = Callable[[int, int, str], None]  # (cases completed, cases in the sweep, current cell)


# -- task registry ------------------------------------------------------------------------------
# Options every task takes in a sweep config (besides ``tables``, ``policy_config``, ``threads``);
# ``max_new_tokens`` defaults to the task's own allowance.
COMMON_OPTIONS: dict[str, Any] = {
    "limit": None,
    "batch_size": 8,
    "batching": "static",
    "max_new_tokens": None,
    "save_tags": False,
    "allow_transfer": False,
}
COMMON_HASHED = ("limit", "max_new_tokens", "save_tags", "allow_transfer")


@dataclass(frozen=True)
class TaskSpec:
    """How the sweep runs one task (for a registered :class:`pask.tasks.Task`: :meth:`of`).

    Parameters
    ----------
    name : str
        Task name in configs and result paths.
    runner : str or callable
        The task runner, or ``"module:function"`` naming it (imported when a cell runs).
    loader : str or callable
        Takes ``(split, options)`` and returns cases (each with ``.id``); or its ``"module:function"``.
    splits : tuple of str
        Splits the task knows.
    defaults : dict
        Option -> default value; the task's allowed option keys (besides ``tables``,
        ``policy_config`` and ``threads``).
    hashed : tuple of str
        Options that change results (part of the cell's config hash); ``batch_size``,
        ``batching`` and ``threads`` are not (batched greedy decoding equals one request at a
        time; each run of a cell records its batching in ``cell.json``).
    runner_kwargs : tuple of str
        Options passed to the runner as keyword arguments.
    paths : tuple of str
        Options that are file paths, resolved against the config file's directory.
    """

    name: str
    runner: str | Callable
    loader: str | Callable
    splits: tuple[str, ...]
    defaults: dict[str, Any]
    hashed: tuple[str, ...]
    runner_kwargs: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()

    @classmethod
    def of(cls, task) -> TaskSpec:
        """The spec of a registered task: the common options plus the task's own (all of them hashed),
        run by :func:`pask.evaluation.runner.run_task`."""
        own = {k: list(v) if isinstance(v, list) else v for k, v in task.options.items()}
        return cls(
            name=task.name,
            runner=partial(_run_task, task),
            loader=partial(_load_task_cases, task),
            splits=tuple(task.splits),
            defaults={**own, **COMMON_OPTIONS, "max_new_tokens": task.default_max_new_tokens},
            hashed=(*own, *COMMON_HASHED),
            runner_kwargs=(*own, "batching"),
            paths=tuple(task.path_options),
        )

    def run_fn(self) -> Callable:
        return _import(self.runner, self.name)

    def load_cases(self, split: str, options: dict) -> list:
        return _import(self.loader, self.name)(split, options)


def _run_task(task, *args, **kwargs) -> dict:
    from pask.evaluation.runner import run_task

    return run_task(task, *args, **kwargs)


def _load_task_cases(task, split: str, options: dict) -> list:
    return task.cases(split, options["limit"], **{k: options[k] for k in task.options})


def _import(target: str | Callable, task: str) -> Callable:
    if callable(target):
        return target
    module, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as e:
        raise PaskError(f"task '{task}' needs {module}, which this version of pask lacks ({e})") from None
    except AttributeError:
        raise PaskError(f"task '{task}': {module} has no {attr}") from None


class TaskTable(MutableMapping[str, TaskSpec]):
    """The sweep's tasks: :meth:`TaskSpec.of` every task of the registry (:data:`pask.tasks.TASKS`,
    looked up when used, so a task registered there is a sweep task too), unless a spec of its own
    was set here (``TASKS[name] = spec``: a runner of its own, e.g. a model-free test task, or the
    spec a Ray shard brought along)."""

    def __init__(self) -> None:
        self._own: dict[str, TaskSpec] = {}

    @staticmethod
    def _registry():
        from pask.tasks import TASKS as registry

        return registry

    def __getitem__(self, name: str) -> TaskSpec:
        if name in self._own:
            return self._own[name]
        registry = self._registry()
        if name not in registry:
            raise KeyError(name)
        return TaskSpec.of(registry[name])

    def __setitem__(self, name: str, spec: TaskSpec) -> None:
        self._own[name] = spec

    def __delitem__(self, name: str) -> None:
        del self._own[name]

    def __contains__(self, name: object) -> bool:  # without importing the task
        return name in self._own or name in self._registry()

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*self._registry(), *self._own]))

    def __len__(self) -> int:
        return len(dict.fromkeys([*self._registry(), *self._own]))


TASKS = TaskTable()


# -- cells ----------------------------------------------------------------------------------------
def budget_label(budget: float | None) -> str:
    return "1" if budget is None else f"{budget:g}"


def safe_name(model: str) -> str:
    """A model name as one path component (hub ids and local paths lose their separators)."""
    return model.strip("/").replace("/", "_").replace("\\", "_").replace(":", "_")


@dataclass
class Cell:
    """One (model, task, split, policy, budget) of a sweep with its task options."""

    model: str
    task: str
    split: str
    policy: str
    budget: float | None  # None: Full KV
    dtype: str = "bf16"
    options: dict[str, Any] = field(default_factory=dict)  # the task's options, defaults filled in
    policy_config: dict[str, Any] = field(default_factory=dict)
    table: str | None = None  # PASK table file
    threads: int | None = None
    variant: str | None = None  # ``<policy>~<variant>``: the policy with the variant's own options
    weights: str = "bf16"  # the linear layers' format (pask.cpu.weights)

    @property
    def method(self) -> str:
        """The policy as the config names it: ``<policy>`` or ``<policy>~<variant>``."""
        return policy_id(self.policy, self.variant)

    @property
    def key(self) -> tuple:
        return (self.model, self.task, self.split, self.method, self.budget)

    @property
    def rel_dir(self) -> Path:
        return Path(safe_name(self.model), self.task, self.split, f"{self.method}-b{budget_label(self.budget)}")

    @property
    def name(self) -> str:
        return str(self.rel_dir)

    def spec(self) -> dict:
        """Everything that changes the cell's results (hashed into ``config_hash``)."""
        task = TASKS[self.task]
        return {
            "model": self.model,
            "dtype": self.dtype,
            "task": self.task,
            "split": self.split,
            "policy": self.policy,
            "budget": self.budget,
            "options": {k: self.options[k] for k in task.hashed},
            "policy_config": self.policy_config,
            "table_sha256": file_sha256(Path(self.table)) if self.table else None,
            **({"variant": self.variant} if self.variant else {}),
            **({"weights": self.weights} if self.weights != "bf16" else {}),
        }

    def config_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.spec(), sort_keys=True).encode()).hexdigest()[:16]

    def meta(self) -> dict:
        return {
            "model": self.model,
            "policy": self.policy,
            **({"variant": self.variant} if self.variant else {}),
            **({"weights": self.weights} if self.weights != "bf16" else {}),
            "budget": self.budget,
            "split": self.split,
            "task": self.task,
            "cell": self.name,
            **({"categories": self.options["categories"]} if "categories" in self.options else {}),
            **({"limit": self.options["limit"]} if self.options.get("limit") is not None else {}),
        }

    def load_cases(self) -> list:
        cases = TASKS[self.task].load_cases(self.split, self.options)
        if not cases:
            raise PaskError(f"cell {self.name}: no cases (check split, categories and limit)")
        ids = [c.id for c in cases]
        if len(set(ids)) != len(ids):
            raise PaskError(f"cell {self.name}: duplicate case ids")
        return cases


VARIANT_SEP = "~"
_VARIANT = re.compile(r"^[a-z0-9_]+$")


def policy_id(policy: str, variant: str | None) -> str:
    """``<policy>`` or ``<policy>~<variant>``."""
    return f"{policy}{VARIANT_SEP}{variant}" if variant else policy


def split_policy(name: str) -> tuple[str, str | None]:
    """``"fetch-snapkv~grammar"`` -> ``("fetch-snapkv", "grammar")``; a bad variant raises PaskError."""
    policy, sep, variant = name.partition(VARIANT_SEP)
    if not sep:
        return name, None
    if not _VARIANT.match(variant) or policy == "full":
        raise PaskError(
            f"bad policy variant {name!r}: write <policy>~<variant>, the variant of lower-case letters, digits "
            "and _ (Full KV has no variants)"
        )
    return policy, variant


def file_sha256(path: Path) -> str:
    """sha256 of a file (a PASK table); PaskError when it does not exist."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        raise PaskError(f"table file {path} does not exist") from None


@dataclass
class SweepConfig:
    """A parsed sweep: where results go, and the cells in run order."""

    results_dir: Path
    cells: list[Cell]
    dtype: str = "bf16"
    threads: int | None = None
    source: str | None = None  # config file path
    sha256: str | None = None  # of the config file
    only: list[str] | None = None  # cell filters (select_cells): the other cells are left as they are


def load_config(path: Path | str, results_dir: Path | str | None = None, threads: int | None = None) -> SweepConfig:
    """Read and check a sweep config file (``results_dir`` / ``threads`` override the file's)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise PaskError(f"sweep config {path} does not exist") from None
    try:
        data = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise PaskError(f"sweep config {path} is not valid TOML: {e}") from None
    cfg = parse_config(data, path.parent, results_dir, threads)
    cfg.source, cfg.sha256 = str(path), hashlib.sha256(raw).hexdigest()
    return cfg


FILTER_KEYS = ("model", "task", "split", "policy", "budget")


def select_cells(config: SweepConfig, only: list[str]) -> SweepConfig:
    """The config restricted to the cells matching every ``KEY=V1,V2`` filter (keys: model, task,
    split, policy, budget; a policy as the config writes it, ``<policy>~<variant>`` for a variant; a
    budget as written in cell names, ``1`` for Full KV)."""
    cells = config.cells
    for f in only:
        key, sep, values = f.partition("=")
        wanted = {v.strip() for v in values.split(",") if v.strip()}
        if not sep or key not in FILTER_KEYS or not wanted:
            raise PaskError(f"bad cell filter {f!r}: use KEY=V1,V2 with KEY one of {', '.join(FILTER_KEYS)}")
        cells = [c for c in cells if _filter_value(c, key) in wanted]
    if not cells:
        raise PaskError(f"no cell of {config.source or 'the config'} matches {' and '.join(only)}")
    return replace(config, cells=cells, only=list(only))


def _filter_value(cell: Cell, key: str) -> str:
    if key == "budget":
        return budget_label(cell.budget)
    return cell.method if key == "policy" else getattr(cell, key)


def _list(block: dict, key: str, kind: type | tuple, where: str) -> list:
    value = block[key]
    if not isinstance(value, list) or not value:
        raise PaskError(f"{where}: '{key}' must be a non-empty list")
    for v in value:
        if not isinstance(v, kind) or isinstance(v, bool):
            raise PaskError(f"{where}: '{key}' has a bad entry {v!r}")
    return value


def check_model(name: str) -> None:
    """An embedded model name, a local directory or a hub id ``org/name`` (not loaded here)."""
    from pask.runtime.models import EMBEDDED

    p = Path(name)
    if name in EMBEDDED or p.is_dir() or ("/" in name and not p.exists() and not name.startswith(("/", "."))):
        return
    raise PaskError(f"unknown model '{name}': not an embedded model ({', '.join(EMBEDDED)}), a directory or a hub id")


def _check_policy(name: str) -> None:
    from pask.policies import policy_names
    from pask.policies.factory import FETCH_INNER, FETCH_PREFIX

    name, _ = split_policy(name)
    fetch = {FETCH_PREFIX + p for p in FETCH_INNER if p != "pask"}  # KVFetch around a baseline
    known = {*policy_names(), "kivi", *ABLATIONS, *fetch}
    if name not in known:
        raise PaskError(f"unknown policy '{name}'; known policies: {', '.join(sorted(known))}")


def _task_options(data: dict, task: str, base: Path) -> tuple[dict, dict, dict, int | None]:
    spec = TASKS[task]
    block = data.get(task, {})
    if not isinstance(block, dict):
        raise PaskError(f"[{task}] must be a table of options")
    allowed = {*spec.defaults, "tables", "policy_config", "threads"}
    if unknown := sorted(set(block) - allowed):
        raise PaskError(f"[{task}]: unknown option(s) {unknown}; allowed: {sorted(allowed)}")
    opts = {**spec.defaults, **{k: v for k, v in block.items() if k in spec.defaults}}
    for k in ("batch_size", "max_new_tokens"):
        if not isinstance(opts[k], int) or isinstance(opts[k], bool) or opts[k] < 1:
            raise PaskError(f"[{task}] {k} must be an integer >= 1, got {opts[k]!r}")
    lim = opts["limit"]
    if lim is not None and (not isinstance(lim, int) or isinstance(lim, bool) or lim < 1):
        raise PaskError(f"[{task}] limit must be an integer >= 1, got {lim!r}")
    if "batching" in opts and opts["batching"] not in BATCHING:
        raise PaskError(f"[{task}] batching must be one of {list(BATCHING)}, got {opts['batching']!r}")
    for k, default in spec.defaults.items():  # a task option with a list default takes a list of that kind
        if isinstance(default, list):
            _list(opts, k, tuple({type(v) for v in default}) or str, f"[{task}]")
    for k in spec.paths:  # file paths: relative to the config file
        if opts.get(k) is not None:
            if not isinstance(opts[k], str):
                raise PaskError(f"[{task}] {k} must be a path (string), got {opts[k]!r}")
            opts[k] = str((base / opts[k]).resolve())
    tables = block.get("tables", {})
    if not isinstance(tables, dict) or not all(isinstance(v, dict) for v in tables.values()):
        raise PaskError(f'[{task}.tables] must map model -> {{"budget" = "table file"}}')
    pcfg = block.get("policy_config", {})
    if not isinstance(pcfg, dict) or not all(isinstance(v, dict) for v in pcfg.values()):
        raise PaskError(
            f"[{task}.policy_config] must map policy (or policy@budget, policy~variant) -> table of parameters"
        )
    return opts, tables, pcfg, _threads(block.get("threads"), f"[{task}]")


def _table_for(tables: dict, model: str, budget: float, task: str, base: Path, policy: str = "pask") -> str:
    per_model = tables.get(model, {})
    want = policy if policy in OWN_TABLES else None
    for key, path in per_model.items():
        owner, _, b_text = key.rpartition("@")
        if owner and owner not in OWN_TABLES:
            raise PaskError(
                f'[{task}.tables."{model}"]: key {key!r}: only {", ".join(OWN_TABLES)} take "<policy>@<budget>"'
            )
        try:
            b = float(b_text)
        except ValueError:
            raise PaskError(f'[{task}.tables."{model}"]: key {key!r} is not a budget') from None
        if (owner or None) == want and abs(b - budget) < 1e-9:
            p = (base / path).resolve()
            if not p.is_file():
                raise PaskError(f"PASK table {p} (model {model}, budget {budget:g}) does not exist")
            return str(p)
    key = f"{want}@{budget:g}" if want else f"{budget:g}"
    raise PaskError(
        f"policy {policy} on {model} at budget {budget:g} needs a table: add "
        f'[{task}.tables."{model}"] "{key}" = "FILE" (made by `pask calibrate`)'
    )


def _threads(value, where: str) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise PaskError(f"{where}: threads must be an integer >= 1, got {value!r}")
    return value


def parse_config(
    data: dict, base: Path | str = ".", results_dir: Path | str | None = None, threads: int | None = None
) -> SweepConfig:
    """Check a config (the parsed TOML) and expand it into cells; see the module docstring."""
    base = Path(base)
    if unknown := sorted(set(data) - _TOP_KEYS - set(TASKS)):
        raise PaskError(f"unknown config key(s) {unknown}; known: {sorted(_TOP_KEYS)} and task names {sorted(TASKS)}")
    if results_dir is None:
        if "results_dir" not in data:
            raise PaskError("config is missing 'results_dir' (where the cells are written)")
        results_dir = base / str(data["results_dir"])
    dtype = data.get("dtype", "bf16")
    if dtype not in DTYPES:
        raise PaskError(f"unknown dtype '{dtype}'; choose one of {', '.join(DTYPES)}")
    from pask.cpu.weights import FORMATS as WEIGHT_FORMATS

    weights = data.get("weights", "bf16")
    if weights not in WEIGHT_FORMATS:
        raise PaskError(f"unknown weights '{weights}'; choose one of {', '.join(WEIGHT_FORMATS)}")
    top_threads = _threads(threads if threads is not None else data.get("threads"), "config")
    grids = data.get("grid", [])
    if not isinstance(grids, list) or not all(isinstance(g, dict) for g in grids):
        raise PaskError("'grid' must be an array of tables ([[grid]])")
    blocks = (
        [({k: data[k] for k in _PRODUCT_KEYS if k in data}, "config")] if any(k in data for k in _PRODUCT_KEYS) else []
    )
    for i, g in enumerate(grids):
        if unknown := sorted(set(g) - set(_PRODUCT_KEYS)):
            raise PaskError(f"[[grid]] #{i + 1}: unknown key(s) {unknown}; allowed: {list(_PRODUCT_KEYS)}")
        blocks.append(({**{k: data[k] for k in _PRODUCT_KEYS if k in data}, **g}, f"[[grid]] #{i + 1}"))
    if not blocks:
        raise PaskError(f"config has no cells: give {', '.join(_PRODUCT_KEYS)} (top level or in [[grid]])")
    task_opts: dict[str, tuple] = {}
    cells: dict[tuple, Cell] = {}
    for block, where in blocks:
        models, tasks, splits, policies, budgets = _product(block, where)
        for t in tasks:
            task_opts.setdefault(t, _task_options(data, t, base))
        for m, t, s, p in itertools.product(models, tasks, splits, policies):
            opts, tables, pcfg, t_threads = task_opts[t]
            name, variant = split_policy(p)
            if variant and p not in pcfg:
                raise PaskError(
                    f'{where}: the variant {p} has no options of its own in [{t}.policy_config."{p}"] (without '
                    f"them it is the cell of {name})"
                )
            for b in [None] if p == "full" else budgets:
                # the policy's options, then (a variant) the variant's; "@<budget>" keys: that cell's own
                names = [name, f"{name}@{b:g}"] if b is not None else [name]
                if variant:
                    names += [p, f"{p}@{b:g}"]
                pc = {k: v for n in names for k, v in pcfg.get(n, {}).items()}
                cell = Cell(m, t, s, name, b, dtype, dict(opts), pc, variant=variant, weights=weights)
                # --threads beats the task's threads, which beat the top-level threads
                cell.threads = top_threads if threads is not None else (t_threads or top_threads)
                if name in ABLATIONS:
                    cell.table = _table_for(tables, m, b, t, base, name)
                cells.setdefault(cell.key, cell)
    out = sorted(cells.values(), key=_order(list(cells)))
    for c in out:
        _check_cell_policy(c)
    return SweepConfig(Path(results_dir), out, dtype, top_threads)


def _product(block: dict, where: str) -> tuple[list, list, list, list, list[float]]:
    """The checked lists of one product (top level or a [[grid]] block)."""
    for key in ("models", "tasks", "splits", "policies"):
        if key not in block:
            raise PaskError(f"{where}: missing key '{key}'")
    models = _list(block, "models", str, where)
    tasks = _list(block, "tasks", str, where)
    splits = _list(block, "splits", str, where)
    policies = _list(block, "policies", str, where)
    budgets: list = []
    if "budgets" in block:
        budgets = _list(block, "budgets", (int, float), where)
        from pask.kv.budget import check_budget

        for b in budgets:
            check_budget(b, f"{where}: budgets")
    if any(p != "full" for p in policies) and not budgets:
        raise PaskError(f"{where}: missing key 'budgets' (needed by policies other than full)")
    for m in models:
        check_model(m)
    for t in tasks:
        if t not in TASKS:
            raise PaskError(f"{where}: unknown task '{t}'; known tasks: {', '.join(sorted(TASKS))}")
        if bad := [s for s in splits if s not in TASKS[t].splits]:
            raise PaskError(f"{where}: unknown split(s) {bad} for task {t}; choose from {list(TASKS[t].splits)}")
    for p in policies:
        _check_policy(p)
    return models, tasks, splits, policies, [float(b) for b in budgets]


def _order(keys: list[tuple]) -> Callable[[Cell], tuple]:
    """Run order: grouped by model (loaded once), otherwise in config order."""
    first_model = {}
    for i, k in enumerate(keys):
        first_model.setdefault(k[0], i)
    index = {k: i for i, k in enumerate(keys)}
    return lambda c: (first_model[c.model], index[c.key])


def _check_cell_policy(cell: Cell) -> None:
    """Build the policy once (no model) so that bad budgets / parameters fail before any model loads."""
    if cell.policy in ABLATIONS:
        from pask.policies.pask import make_pask_policy

        if cell.policy == "fetch-pask":
            from pask.policies.factory import fetch_pask_options

            try:
                fetch_pask_options(json.dumps(cell.policy_config or {}))
            except PaskError as e:
                raise PaskError(f"cell {cell.name}: {e}") from None
        elif cell.policy_config:
            raise PaskError(f"cell {cell.name}: PASK takes its actions from the table, not from policy_config")
        # fetch-pask: the table is fitted to the hot budget KVFetch leaves, not to the cell's B
        policy = make_pask_policy(
            cell.table,
            None if cell.policy == "fetch-pask" else cell.budget,
            fingerprint=None,
            allow_transfer=bool(cell.options.get("allow_transfer")),
            task=cell.task,
        )
        if cell.policy == "pask-3a" and "L2" in policy.table.actions.values():
            raise PaskError(f"cell {cell.name}: pask-3a needs a three-action table; {cell.table} uses INT2 (L2)")
        if cell.policy == "pask-k4v2" and policy.table.l2_key_bits != 4:
            raise PaskError(
                f"cell {cell.name}: pask-k4v2 needs a K4V2 table (calibrated with --l2-key-bits 4); {cell.table} is not"
            )
    else:
        proj = (cell.policy_config or {}).get("projections")
        if isinstance(proj, str) and not Path(proj).is_file():
            return  # BellowsKV's fitted file (not committed): the cell refuses to start without it
        make_cell_policy(cell, None)


def make_cell_policy(cell: Cell, lm):
    """The KV policy object of a cell (``None`` for Full KV); ``lm`` checks a PASK table's model."""
    if cell.policy in ABLATIONS:
        from pask.policies.pask import make_pask_policy

        prefill, decode = ABLATIONS[cell.policy]
        policy = make_pask_policy(
            cell.table,
            None if cell.policy == "fetch-pask" else cell.budget,  # its table: fitted to the hot budget
            prefill=prefill,
            decode=decode,
            fingerprint=lm.fingerprint if lm is not None else None,
            allow_transfer=bool(cell.options.get("allow_transfer")),
            task=cell.task,
        )
        if cell.policy == "fetch-pask":
            from pask.policies.factory import make_fetch

            return make_fetch(cell.policy, cell.budget, dict(cell.policy_config or {}), cell.task, inner=policy)
        return policy
    from pask.policies.factory import make_policy

    config = json.dumps(cell.policy_config) if cell.policy_config else None
    try:
        return make_policy(cell.policy, cell.budget, config, cell.task)
    except PaskError as e:
        raise PaskError(f"cell {cell.name}: {e}") from None


# -- code version and manifests -------------------------------------------------------------------
# code_version(): the code a cell was made with; cells are compared by its ``key`` (the git tree
# hashes of CODE_PATHS, ``+dirty`` for uncommitted changes under them), so committing results (or
# docs) does not invalidate finished cells but a code change does. Both live in provenance.


def reuse_key(man: dict) -> str | None:
    """The code version key a finished cell is compared by: its own, or for an adopted cell the
    version that adopted it (adopting vouches that the code did not change the results since; the
    cell's ``code_version`` stays the producing run's)."""
    adopted = man.get("adopted") or {}
    version = adopted.get("by_code_version") or man.get("code_version") or {}
    return version.get("key")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def read_manifest(cell_dir: Path) -> dict | None:
    path = cell_dir / CELL_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PaskError(f"{path} is not valid JSON ({e}); delete the cell or rerun with --force") from None
    if not isinstance(data, dict):
        raise PaskError(f"{path} does not hold a JSON object; delete the cell or rerun with --force")
    return data


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically (a killed sweep never leaves half a manifest)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def merge_rows(cell_dir: Path, rows: list[dict], wanted: set[str]) -> int:
    """Append rows of ``wanted`` cases not yet in the cell's ``cases.jsonl``; return how many were added."""
    jsonl = cell_dir / "cases.jsonl"
    repair_jsonl(jsonl)
    done = read_done(jsonl)
    new = []
    for r in rows:
        if r.get("id") in wanted and r["id"] not in done:
            done[r["id"]] = r
            new.append(r)
    if new:
        with open(jsonl, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in new)
    return len(new)


def merge_shards(cell_dir: Path, wanted: set[str]) -> int:
    """Fold rows left in ``shards/*/cases.jsonl`` (an interrupted Ray run) into the cell; remove the shards."""
    shards = cell_dir / SHARDS_DIR
    if not shards.is_dir():
        return 0
    added = 0
    for jsonl in sorted(shards.glob("*/cases.jsonl")):
        added += merge_rows(cell_dir, list(read_done(jsonl).values()), wanted)
    shutil.rmtree(shards)
    return added


@dataclass
class CellPlan:
    """A cell with its cases and what this sweep does with it: ``done`` | ``resume`` | ``new``
    (``refused`` in a dry run: made by another code version or config)."""

    cell: Cell
    dir: Path
    cases: list
    state: str
    n_done: int = 0


def adopt_cell(cell: Cell, cell_dir: Path, cases: list, version: dict, write: bool = True) -> str | None:
    """Give finished ``pask eval`` results in ``cell_dir`` a manifest; return why not (or None).

    Adopted when ``summary.json``'s run record names this cell's model, policy, budget, split (and
    BFCL categories), the PASK table matches (by the hash the run recorded, else by the file its
    command names) and ``cases.jsonl`` holds a row for every case of the cell (rows of other cases,
    e.g. of a larger run the cell is a subset of, stay and are not counted). The summary is
    rewritten from the cell's rows (as a sweep would) and the manifest is marked ``adopted`` with
    the eval's own command, machine and code version: the manifest's ``code_version`` is the
    producing run's (from its summary's run record; ``{"commit": "unknown"}`` when it kept none),
    ``adopted.by_code_version`` the current one, which later sweeps compare with (:func:`reuse_key`:
    adopting vouches that the code did not change the results since; a later code change makes the
    cell refuse as usual). ``adopted.rows_not_counted``: rows of other cases left in ``cases.jsonl``.
    ``write=False`` only checks.
    """
    try:
        run = json.loads((cell_dir / "summary.json").read_text()).get("run", {})
    except (OSError, json.JSONDecodeError):
        return "no readable summary.json"
    want = {"model": cell.model, "policy": cell.policy, "variant": cell.variant, "budget": cell.budget}
    want["split"] = cell.split
    if "categories" in cell.options:
        want["categories"] = list(cell.options["categories"])
    if diff := [f"{k} {run.get(k)!r} != {v!r}" for k, v in want.items() if run.get(k) != v]:
        return "its summary is another run: " + ", ".join(diff)
    if cell.table:  # the same PASK table: by hash when the run recorded one, else by the file named
        sha, name = file_sha256(Path(cell.table)), Path(cell.table).name
        named = any(Path(a).name == name for a in str(run.get("command", "")).split())
        if run.get("table_sha256", sha) != sha or ("table_sha256" not in run and not named):
            return f"it was not made with the table {cell.table}"
    rows, ids = read_done(cell_dir / "cases.jsonl"), {c.id for c in cases}
    if not ids <= set(rows):
        return f"its cases.jsonl holds {len(set(rows) & ids)}/{len(ids)} of the cell's cases"
    if not write:
        return None
    summary = run_cases(cell, None, cases, cell_dir)  # the cell's own summary, from its cases' rows only
    produced = run.get("code_version") or {"commit": "unknown"}  # the eval's own record, if it kept one
    man = new_manifest(cell, len(cases), produced, wall_s=float(run.get("wall_s_this_run") or 0.0))
    man["adopted"] = {
        "command": run.get("command"),
        "code_version": produced,
        "machine": run.get("machine") or "unknown",
        "by_code_version": version,  # the sweep's code that adopted it: what later sweeps compare with
        "by_command": default_command(),
        "at": _now(),
        "accuracy": _cell_record(summary, 0.0, 0)["accuracy"],  # BFCL accuracy or SQL EX
    }
    if extra := len(set(rows) - ids):  # rows of other cases (a larger run): kept, not counted
        man["adopted"]["rows_not_counted"] = extra
    man.update(status="done", finished=_now())
    write_json(cell_dir / CELL_FILE, man)
    return None


def plan(
    config: SweepConfig, version: dict, overwrite: bool = False, dry_run: bool = False, adopt: bool = False
) -> list[CellPlan]:
    """Check every cell's manifest against this config and code version, then classify the cells.

    All conflicts are reported at once, before anything runs or is deleted (``dry_run``: they are
    returned as state ``refused`` and nothing is deleted). ``adopt``: finished ``pask eval``
    results without a manifest become done cells (:func:`adopt_cell`; state ``adopt`` in a dry run).
    """
    entries, conflicts, loaded = [], [], {}
    for cell in config.cells:
        key = (cell.task, cell.split, json.dumps(cell.options, sort_keys=True))
        if key not in loaded:
            loaded[key] = cell.load_cases()
        cell_dir = config.results_dir / cell.rel_dir
        man = read_manifest(cell_dir)
        problem, adoptable = None, False
        if man is not None:
            if man.get("config_hash") != cell.config_hash():
                problem = f"made with another configuration (hash {man.get('config_hash')} != {cell.config_hash()})"
            elif reuse_key(man) != version["key"]:
                problem = f"made by code version {reuse_key(man)} (this is {version['key']})"
        elif cell_dir.is_dir() and any(cell_dir.iterdir()):
            problem = f"holds results without {CELL_FILE} (not made by a sweep)"
            if adopt:
                if why := adopt_cell(cell, cell_dir, loaded[key], version, write=not dry_run):
                    problem += f"; not adopted: {why}"
                elif dry_run:
                    problem, adoptable = None, True
                else:
                    problem, man = None, read_manifest(cell_dir)
        if problem:
            conflicts.append((cell_dir, problem))
        entries.append((cell, cell_dir, loaded[key], man, problem, adoptable))
    if conflicts and not overwrite and not dry_run:
        lines = [f"  {d}: {p}" for d, p in conflicts[:10]]
        more = f"\n  ... and {len(conflicts) - 10} more" if len(conflicts) > 10 else ""
        raise PaskError(
            f"{len(conflicts)} cell(s) cannot be reused:\n" + "\n".join(lines) + more + "\n"
            "rerun with --force to delete and recompute them (or use another results_dir)"
        )
    out = []
    for cell, cell_dir, cases, man, problem, adoptable in entries:
        if adoptable:
            out.append(CellPlan(cell, cell_dir, cases, "adopt", len(cases)))
            continue
        if problem and dry_run:
            out.append(CellPlan(cell, cell_dir, cases, "refused" if not overwrite else "new"))
            continue
        if problem:
            shutil.rmtree(cell_dir)
            man = None
        ids = {c.id for c in cases}
        if man is not None and man.get("status") == "done" and (cell_dir / "summary.json").exists():
            out.append(CellPlan(cell, cell_dir, cases, "done", len(cases)))
            continue
        n = len(ids & set(read_done(cell_dir / "cases.jsonl"))) if cell_dir.is_dir() else 0
        for jsonl in (cell_dir / SHARDS_DIR).glob("*/cases.jsonl"):
            n += len(ids & set(read_done(jsonl)))
        out.append(CellPlan(cell, cell_dir, cases, "resume" if n else "new", min(n, len(cases))))
    return out


def run_provenance(version: dict) -> dict:
    """What a run of a cell records about itself (:mod:`pask.experiments.provenance`): the command
    (``pask sweep ...``, ``make run`` included), its code version, the machine (CPU, BF16 arithmetic,
    matmul mode, native kernels), every ``PASK_*`` variable and the library versions."""
    return {
        "command": default_command(),
        "code_version": version,
        "machine": machine(),
        "env": pask_env(),
        "versions": versions(),
    }


def new_manifest(cell: Cell, n_cases: int, version: dict, wall_s: float = 0.0) -> dict:
    """A cell's ``cell.json`` before its first run: coordinates, spec, config hash, code version."""
    return {
        "cell": {
            **{k: getattr(cell, k) for k in ("model", "task", "split", "policy", "budget")},
            **({"variant": cell.variant} if cell.variant else {}),
        },
        "spec": cell.spec(),
        "config_hash": cell.config_hash(),
        "code_version": version,
        "n_cases": n_cases,
        "created": _now(),
        "wall_s": wall_s,
        "runs": [],
    }


def start_cell(p: CellPlan, version: dict, mode: str) -> dict:
    """Prepare the cell dir (fold shard leftovers, repair the JSONL) and mark the manifest running."""
    p.dir.mkdir(parents=True, exist_ok=True)
    ids = {c.id for c in p.cases}
    merge_shards(p.dir, ids)
    repair_jsonl(p.dir / "cases.jsonl")
    man = read_manifest(p.dir) or new_manifest(p.cell, len(p.cases), version)
    man["status"] = "running"
    before = len(ids & set(read_done(p.dir / "cases.jsonl")))
    run = {"started": _now(), "mode": mode, "cases_before": before, **run_provenance(version)}
    if "batching" in p.cell.options:
        run["batching"] = p.cell.options["batching"]
    if p.cell.policy.startswith("fetch-"):  # the wrapper's options and its inner policy's
        from pask.policies.factory import fetch_params

        run["policy_params"] = fetch_params(p.cell.policy, p.cell.budget, p.cell.policy_config, p.cell.task)
    elif p.cell.policy not in ABLATIONS and p.cell.policy != "full":  # what make_policy applies
        from pask.policies.tuning import effective_config

        run["policy_params"] = effective_config(p.cell.policy, p.cell.budget, p.cell.policy_config, p.cell.task)
        proj = run["policy_params"].get("projections")  # BellowsKV: the fitted file the cell ran with
        if isinstance(proj, str) and Path(proj).is_file():
            run["projections_sha256"] = file_sha256(Path(proj))
    man["runs"].append(run)
    write_json(p.dir / CELL_FILE, man)
    return man


def finish_cell(p: CellPlan, man: dict, wall: float, extra: dict | None = None) -> dict:
    """Check the cell has exactly one row per case, then mark the manifest done; return the summary."""
    rows = read_done(p.dir / "cases.jsonl")
    ids = [c.id for c in p.cases]
    if missing := [i for i in ids if i not in rows]:
        raise PaskError(f"cell {p.cell.name}: {len(missing)} case(s) have no result row, e.g. {missing[:3]}")
    summary = json.loads((p.dir / "summary.json").read_text())
    run = man["runs"][-1]
    run.update({"finished": _now(), "wall_s": round(wall, 2), "cases_run": len(ids) - run["cases_before"]})
    run.update(extra or {})
    man.update({"status": "done", "finished": _now(), "wall_s": round(man["wall_s"] + wall, 2)})
    write_json(p.dir / CELL_FILE, man)
    return summary


def run_cases(cell: Cell, lm, cases: list, out_dir: Path, progress: Callable[[int], None] | None = None) -> dict:
    """Run a cell's task runner on ``cases`` into ``out_dir`` (resuming there); ``lm=None`` only summarises."""
    task = TASKS[cell.task]
    run = task.run_fn()
    policy = make_cell_policy(cell, lm) if lm is not None else None
    extra = {k: cell.options[k] for k in task.runner_kwargs if cell.options.get(k) is not None}
    o = cell.options
    args = (o["batch_size"], o["max_new_tokens"], policy, progress, cell.meta(), o["save_tags"])
    return run(lm, cases, out_dir, *args, **extra)


def set_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def default_loader(model: str, dtype: str, weights: str = "bf16"):
    from pask.runtime.models import load_model

    return load_model(model, dtype=torch_dtype(dtype), weights=weights)


# -- the sweep ------------------------------------------------------------------------------------
def run_sweep(
    config: SweepConfig,
    overwrite: bool = False,
    progress: Progress | None = None,
    ray_address: str | None = None,
    shard_size: int | None = None,
    load: Callable[[str, str], Any] | None = None,
    adopt: bool = False,
    ray_runner: Callable[..., None] | None = None,
) -> dict:
    """Run every unfinished cell (in-process, or as Ray tasks when ``ray_address`` is given).

    ``ray_runner``: :func:`pask.experiments.ray_shards.run_cells_ray` (required with ``ray_address``;
    passed in, since the Ray module builds on this one).

    ``load(model, dtype)`` loads a model (default :func:`pask.runtime.models.load_model`); in-process each
    model is loaded once for all its cells. Writes and returns the record (:func:`record_path`).
    """
    if ray_address and ray_runner is None:
        raise PaskError("a Ray sweep needs ray_runner=pask.experiments.ray_shards.run_cells_ray")
    version = code_version()
    plans = plan(config, version, overwrite, adopt=adopt)
    config.results_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "config": config.source,
        "config_sha256": config.sha256,
        **run_provenance(version),  # command (`make run` too: it runs pask sweep), code, machine, env
        "mode": "ray" if ray_address else "local",
        "started": _now(),
        "cells": {p.cell.name: {"state": p.state, "n": len(p.cases)} for p in plans},
    }
    if config.only:  # a partial run updates its cells in the record of the same config
        record["only"] = config.only
        old = record_path(config)
        prev = json.loads(old.read_text()) if old.exists() else {}
        if prev.get("config_sha256") == config.sha256:
            record["cells"] = {**prev.get("cells", {}), **record["cells"]}
    tracker = _Tracker(plans, progress)
    t0 = time.perf_counter()

    def cell_done(p: CellPlan, summary: dict, wall: float, ran: int) -> None:
        tracker.cell_finished(p, summary, wall, ran)
        record["cells"][p.cell.name].update(_cell_record(summary, wall, ran))
        record["wall_s"] = round(time.perf_counter() - t0, 2)
        write_json(record_path(config), record)

    for p in plans:
        if p.state == "done":
            summary = json.loads((p.dir / "summary.json").read_text())
            record["cells"][p.cell.name].update(_cell_record(summary, 0.0, 0))
    try:
        if ray_address:
            ray_runner(plans, config, version, ray_address, tracker, cell_done, shard_size)
        else:
            _run_cells_local(plans, config, version, tracker, cell_done, load or default_loader)
    finally:
        for c in record["cells"].values():
            if "cases_run" not in c:  # the sweep stopped (error, kill) before this cell finished
                c["state"] = "unfinished"
        record["finished"] = _now()
        record["wall_s"] = round(time.perf_counter() - t0, 2)
        write_json(record_path(config), record)
    return record


def _cell_record(summary: dict, wall: float, ran: int) -> dict:
    o = summary.get("overall", {})
    acc = o.get("accuracy", o.get("ex"))
    return {"cases_run": ran, "wall_s": round(wall, 2), "accuracy": acc, "measured_b": summary.get("measured_b")}


_now = time.monotonic  # the progress lines' clock (tests replace it)


class _Tracker:
    """Overall progress: cases finished across all cells (a cell's runner reports its own count).

    Without a terminal (output to a file or a CI log, where the progress bar draws nothing) it
    also prints plain lines to stdout: the cells to run at the start, a running cell's count, rate
    and time left at most every ``every`` seconds (a BFCL-600 cell can take hours on two cores),
    then one line per finished cell (name, cases, score, measured B, wall time).
    """

    every = 60.0  # seconds between a running cell's progress lines

    def __init__(self, plans: list[CellPlan], progress: Progress | None) -> None:
        self.total = sum(len(p.cases) for p in plans)
        self.per_cell = {p.cell.name: p.n_done for p in plans}
        self.progress = progress
        self.lines = not (_isatty(sys.stdout) and _isatty(sys.stderr))
        self.started: dict[str, tuple[float, int]] = {}  # cell -> (first report's time, its count)
        self.last_line = _now()
        self.to_run = sum(p.state != "done" for p in plans)
        self.finished = 0
        if self.lines:
            cases = sum(len(p.cases) - p.n_done for p in plans if p.state != "done")
            _say(f"sweep: {self.to_run} of {len(plans)} cells to run ({cases} cases)")
        self.show("")

    def show(self, desc: str) -> None:
        if self.progress:
            self.progress(sum(self.per_cell.values()), self.total, desc)

    def set(self, p: CellPlan, n: int) -> None:
        name, n = p.cell.name, min(n, len(p.cases))
        self.per_cell[name] = n
        self.show(name)
        now = _now()
        t0, n0 = self.started.setdefault(name, (now, n))
        if self.lines and n < len(p.cases) and now - self.last_line >= self.every:
            self.last_line = now
            rate = (n - n0) / (now - t0) * 60 if now > t0 else 0.0
            left = f", ~{(len(p.cases) - n) / rate:.0f} min left" if rate > 0 else ""
            _say(f"  {name}: {n} / {len(p.cases)} cases, {rate:.1f} a minute{left}")

    def cell_finished(self, p: CellPlan, summary: dict, wall: float, ran: int) -> None:
        self.finished += 1
        if self.lines:
            _say(cell_line(p.cell.name, len(p.cases), ran, summary, wall, f"{self.finished}/{self.to_run}"))


def cell_line(name: str, n: int, ran: int, summary: dict, wall: float, count: str = "") -> str:
    """One finished cell as a plain log line.

    ``[1/3] m/bfcl/test/pask-b0.33: 600 cases (600 run now), accuracy 70.20, B 0.331, 812.4 s``
    """
    overall = summary.get("overall", {})
    key = next((k for k in ("accuracy", "ex", "score") if isinstance(overall.get(k), (int, float))), None)
    score = f"{'EX' if key == 'ex' else key} {overall[key]:.2f}" if key else "no score"
    b = summary.get("measured_b")
    b_text = f"B {b:.3f}" if isinstance(b, (int, float)) else "B –"
    head = f"[{count}] " if count else ""
    return f"{head}{name}: {n} cases ({ran} run now), {score}, {b_text}, {wall:.1f} s"


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _say(line: str) -> None:
    print(line, file=sys.stdout, flush=True)


def _run_cells_local(plans, config, version, tracker, cell_done, load) -> None:
    todo = [p for p in plans if p.state != "done"]
    set_threads(config.threads)
    for model, weights in dict.fromkeys((p.cell.model, p.cell.weights) for p in todo):
        lm = load(model, config.dtype) if weights == "bf16" else load(model, config.dtype, weights)
        for p in [p for p in todo if (p.cell.model, p.cell.weights) == (model, weights)]:
            set_threads(p.cell.threads)
            man = start_cell(p, version, "local")
            before = man["runs"][-1]["cases_before"]
            seen = 0

            def advance(n: int, p=p) -> None:
                nonlocal seen
                seen += n
                tracker.set(p, seen)

            tracker.set(p, before)
            t = time.perf_counter()
            run_cases(p.cell, lm, p.cases, p.dir, advance)
            wall = time.perf_counter() - t
            summary = finish_cell(p, man, wall)
            tracker.set(p, len(p.cases))
            cell_done(p, summary, wall, len(p.cases) - before)
        del lm
        gc.collect()
