"""Hyper-parameter search for the baselines over the Table 8 grids, resumable, on the dev split.

:func:`tune` walks the Cartesian product of a grid in a fixed order, calls ``evaluate_fn`` for
every configuration not yet in its JSONL log (one line per finished configuration, flushed as it
finishes, so an interrupted search resumes where it stopped), picks the best score (ties: the
first in grid order) and records it in the task's configuration file as
``{policy: {budget: params}}``: ``configs.json`` for function calling (BFCL), ``configs_sql.json``
for text-to-SQL (:func:`configs_path_for`; a configuration tuned on one task's dev split is not
applied to another). :func:`tuned_config` reads it back.

Strictness: the configuration files ship with the package (package data); a missing file is a
broken install and raises :class:`PaskError`. A policy with a non-empty Table 8 grid that has no
entry at the requested budget raises too (it would silently run untuned), unless the caller gives
its own configuration (``--policy-config``, a sweep's ``policy_config``) or ``PASK_ALLOW_UNTUNED=1``
is set; both opt-outs run the policy's defaults under the user's parameters, as before. Policies
without a grid (MiKV, KIVI, Full, PASK) have nothing to tune and never need an entry.

The grids use the policies' parameter names. Table 8 knobs without a counterpart here: MiKV's
high-precision ratio (set by the budget: ``(B - c) / (1 - c)``) and its group sizes 64/128 (the
cache's low tiers have one group size); its low-tier width is ``bits`` (4 or 2), set per budget by
the frontier configs, so MiKV has no grid.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pask.errors import PaskError
from pask.policies import get_policy

CONFIGS_PATH = Path(__file__).with_name("configs.json")  # function calling (BFCL), and tasks without their own
SQL_CONFIGS_PATH = Path(__file__).with_name("configs_sql.json")  # text-to-SQL

#: Table 8 of the paper, in the policies' parameter names.
TABLE8_GRIDS: dict[str, dict[str, list]] = {
    "h2o": {"sink": [2, 4, 8], "recent": [16, 32, 64, 128]},
    "snapkv": {"window": [16, 32, 64, 128], "pooling": ["avg", "max"], "kernel": [3, 5, 7]},
    "mikv": {},
    "rocketkv": {"window": [16, 32, 64, 128], "kernel": [31, 63, 127], "prefill_ratio": [0.20, 0.25, 0.30, 0.35]},
    "criticalkv": {
        "first_stage_ratio": [0.25, 0.40, 0.50, 0.70],
        "epsilon": [1e-5, 1e-4, 1e-3],
        "window": [16, 32, 64],
    },
    "lazyeviction": {"window": [8, 16, 32, 64], "alpha": [1e-5, 1e-4, 3e-4, 1e-3]},
    "kivi-4": {},
    "kivi-2": {},
    "kivi-mix": {},
}

EvaluateFn = Callable[[str, float, dict], float | Mapping[str, Any]]


def parse_grid(policy_name: str, budget: float, text: str) -> dict[str, list]:
    """A search grid from JSON ``{"param": [values], ...}`` (``pask tune --grid``), checked against the policy.

    :class:`PaskError` for text that is not such an object, an empty value list, or a parameter or
    value the policy rejects.
    """
    try:
        grid = json.loads(text)
    except json.JSONDecodeError as e:
        raise PaskError(f"--grid is not valid JSON: {e}") from None
    if not isinstance(grid, dict) or not grid:
        raise PaskError('--grid must be a non-empty JSON object {"param": [values], ...}')
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise PaskError(f"--grid: '{key}' needs a non-empty list of values, got {values!r}")
    for params in grid_configs(grid):
        try:
            get_policy(policy_name, budget=budget, **params)
        except (TypeError, ValueError, PaskError) as e:
            raise PaskError(f"--grid: {policy_name} rejects {params}: {e}") from None
    return grid


def grid_configs(grid: Mapping[str, Sequence]) -> list[dict]:
    """Every configuration of ``grid`` (keys in the given order, last key varying fastest)."""
    keys = list(grid)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*(grid[k] for k in keys))]


def coordinate_configs(grid: Mapping[str, Sequence], base: Mapping[str, Any]) -> list[dict]:
    """One-knob-at-a-time search: ``base`` (each key's default) plus every grid value of one key at a time.

    ``sum(len(values)) - len(grid) + 1`` configurations instead of ``prod(len(values))``: the grid's
    Cartesian product is too large for a 2-core CPU (e.g. RocketKV's 48 configurations of the dev
    split), and the knobs of these methods interact weakly. Base values not in the grid are kept.
    """
    missing = [k for k in grid if k not in base]
    if missing:
        raise PaskError(f"coordinate search needs a base value for {missing}")
    out = [dict(base)]
    for key, values in grid.items():
        for v in values:
            cfg = {**base, key: v}
            if cfg not in out:
                out.append(cfg)
    return [{k: c[k] for k in grid} for c in out]


def policy_defaults(policy_name: str, keys: Sequence[str]) -> dict:
    """The policy dataclass's default value of each of ``keys``."""
    import dataclasses

    from pask.policies import _REGISTRY

    fields = {f.name: f.default for f in dataclasses.fields(_REGISTRY[policy_name])}
    return {k: fields[k] for k in keys}


def _key(params: Mapping) -> str:
    return json.dumps(params, sort_keys=True)


def budget_key(budget: float) -> str:
    return f"{float(budget):g}"


def _read_log(path: Path, policy: str, budget: float) -> dict[str, dict]:
    done: dict[str, dict] = {}
    if not path.exists():
        return done
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):  # the last line, cut by an interruption: evaluate it again
                continue
            raise PaskError(f"{path}:{i}: not a JSON line") from None
        if rec.get("policy") == policy and budget_key(rec.get("budget", -1)) == budget_key(budget):
            done[_key(rec["params"])] = rec
    return done


def tune(
    policy_name: str,
    budget: float,
    grid: Mapping[str, Sequence] | None,
    evaluate_fn: EvaluateFn,
    out_path: str | os.PathLike,
    configs_path: str | os.PathLike = CONFIGS_PATH,
    search: str = "grid",
) -> dict:
    """Search ``grid`` for ``policy_name`` at ``budget``; return the chosen parameters.

    Parameters
    ----------
    policy_name : str
        A registered policy name.
    budget : float
        Target budget passed to every configuration.
    grid : mapping of parameter name to candidate values, or None
        None takes :data:`TABLE8_GRIDS` for the policy.
    evaluate_fn : callable
        ``evaluate_fn(policy_name, budget, params)`` -> score (higher is better), or a mapping
        with a ``"score"`` entry (other entries, e.g. the measured B, are logged too). Run on the
        dev split.
    out_path : path
        JSONL log of finished configurations; an existing log is resumed (its configurations are
        not evaluated again).
    configs_path : path
        JSON file of chosen configurations, ``{policy: {budget: params}}``; other entries are kept.
    search : {"grid", "coordinate"}
        The full Cartesian product, or one knob at a time around the policy's defaults
        (:func:`coordinate_configs`).
    """
    if grid is None:
        if policy_name not in TABLE8_GRIDS:
            raise PaskError(f"no Table 8 grid for policy '{policy_name}'")
        grid = TABLE8_GRIDS[policy_name]
    if search == "grid":
        configs = grid_configs(grid)
    elif search == "coordinate":
        configs = coordinate_configs(grid, policy_defaults(policy_name, list(grid))) if grid else [{}]
    else:
        raise PaskError(f"unknown search '{search}': choose grid or coordinate")
    for params in configs:  # bad keys or values fail before any evaluation
        get_policy(policy_name, budget=budget, **params)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = _read_log(out, policy_name, budget)
    for params in configs:
        if _key(params) in done:
            continue
        t0 = time.perf_counter()
        result = evaluate_fn(policy_name, budget, dict(params))
        rec = dict(result) if isinstance(result, Mapping) else {"score": result}
        if "score" not in rec:
            raise PaskError("evaluate_fn must return a score or a mapping with a 'score' entry")
        rec = {"policy": policy_name, "budget": budget, "params": params, **rec}
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        with out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        done[_key(params)] = rec
    best = max(configs, key=lambda p: (float(done[_key(p)]["score"]), -configs.index(p)))
    _write_choice(Path(configs_path), policy_name, budget, best)
    return best


def _write_choice(path: Path, policy: str, budget: float, params: dict) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault(policy, {})[budget_key(budget)] = params
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


ALLOW_UNTUNED_ENV = "PASK_ALLOW_UNTUNED"


def allow_untuned() -> bool:
    """Whether ``PASK_ALLOW_UNTUNED=1`` lets baselines run their defaults where nothing was tuned."""
    return os.environ.get(ALLOW_UNTUNED_ENV, "0") == "1"


def tuned_config(policy: str, budget: float, configs_path: str | os.PathLike = CONFIGS_PATH) -> dict:
    """The tuned parameters of ``policy`` at ``budget`` (``{}`` when none were recorded).

    :class:`PaskError` when the file does not exist (a broken install: the files are package data),
    unless ``PASK_ALLOW_UNTUNED=1`` (then ``{}``), or is not a JSON object.
    """
    path = Path(configs_path)
    if not path.exists():
        if allow_untuned():
            return {}
        raise PaskError(
            f"the tuned baseline configurations {path} are missing (package data of pask: reinstall it); "
            f"{ALLOW_UNTUNED_ENV}=1 runs the baselines with their untuned defaults"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PaskError(f"tuned configurations {path} are not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise PaskError(f"tuned configurations {path} do not hold a JSON object")
    return dict(data.get(policy, {}).get(budget_key(budget), {}))


def configs_path_for(task: str) -> Path:
    """The file of tuned configurations of ``task``: SQL has its own, every other task BFCL's."""
    return SQL_CONFIGS_PATH if task == "sql" else CONFIGS_PATH


def effective_config(policy: str, budget: float, user: Mapping[str, Any] | None = None, task: str = "bfcl") -> dict:
    """The parameters a policy runs with on ``task``: its tuned configuration at ``budget`` under ``user``'s.

    :class:`PaskError` when a policy with a Table 8 grid has no tuned entry at ``budget`` for
    ``task`` and ``user`` is empty, unless ``PASK_ALLOW_UNTUNED=1`` (see the module docstring).
    """
    path = configs_path_for(task)
    tuned = tuned_config(policy, budget, path)
    if not tuned and not user and TABLE8_GRIDS.get(policy) and not allow_untuned():
        raise PaskError(
            f"no tuned configuration of {policy} at B={budget:g} for task {task} in {path.name}: tune it "
            f"(`pask tune --task {task} --policy {policy} --budget {budget:g}`), give the parameters "
            f"(--policy-config or a sweep's policy_config), or set {ALLOW_UNTUNED_ENV}=1 to run its defaults"
        )
    return {**tuned, **(user or {})}
