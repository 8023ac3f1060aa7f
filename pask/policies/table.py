"""FrozenTable: the versioned calibration table file (bucket -> action) the PASK policy looks up.

File format (JSON, ``format_version`` 1)::

    {
      "format_version": 1,
      "model": {"name": "qwen2.5-coder-0.5b", "fingerprint": "qwen2-L24-H896:1d9614638d18"},
      "task": "bfcl",
      "num_groups": 4,
      "recent_window": 8,
      "l2_key_bits": 2,
      "target_b": 0.33,
      "expected_b": 0.318,
      "tolerances": {"alpha_D": 0.05, "alpha_P": 0.02},
      "default_action": "H",
      "actions": {"P|schema_scaffold|g0": "R", "D|pure_scaffold|scaffold_separator|boundary|no_lookahead|g3": "L", ...},
      "calibration": {...}
    }

``l2_key_bits`` (default 2) is the key width of the ``"L2"`` action: 2 for INT2 keys and values, 4
for K4V2 (INT4 keys, INT2 values); the cache is built to match.
``actions`` maps ``str(Bucket)`` (see :class:`pask.structure.tags.Bucket`) to ``"H"`` (BF16), ``"L"``
(INT4), ``"L2"`` (INT2) or ``"R"`` (release). A token whose bucket is not listed -- a tag or
label never seen (or too rare to measure) on the calibration split, or a token without a tag --
gets ``default_action``, which is ``"H"`` unless the calibration chose otherwise: what was not measured is protected.
``calibration`` is free-form metadata (cases, split, wall time, sensitivity / distortion values,
solver trace). A table is tied to the model it was calibrated on: :func:`load` refuses another
model's fingerprint unless ``allow_transfer=True`` (paper Table 4, "calibration transfer"), in
which case the mismatch is recorded in :attr:`FrozenTable.warnings`.
"""

from __future__ import annotations

import json
import warnings as _warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pask.errors import PaskError
from pask.kv.actions import Action
from pask.structure.tags import Bucket

FORMAT_VERSION = 1
ACTION_NAMES = ("H", "L", "L2", "R")


def parse_action(name: str) -> Action:
    """``"H"`` / ``"L"`` / ``"L2"`` / ``"R"`` -> :class:`Action` (PaskError otherwise)."""
    if name not in ACTION_NAMES:
        raise PaskError(f"bad action '{name}' in table: expected one of {', '.join(ACTION_NAMES)}")
    return Action[name]


@dataclass
class FrozenTable:
    """Per-bucket actions for one model and task; see the module docstring for the file format."""

    actions: dict[str, str]
    fingerprint: str
    task: str = "bfcl"
    num_groups: int = 4
    recent_window: int = 8
    target_b: float | None = None
    alpha_d: float = 0.05
    alpha_p: float = 0.02
    default_action: str = "H"
    model_name: str | None = None
    expected_b: float | None = None
    calibration: dict[str, Any] = field(default_factory=dict)
    l2_key_bits: int = 2  # 4: "L2" is K4V2 (INT4 keys, INT2 values; CacheConfig.l2_key_bits)
    format_version: int = FORMAT_VERSION
    warnings: list[str] = field(default_factory=list)  # not saved: set by load(allow_transfer=True)

    def __post_init__(self) -> None:
        parse_action(self.default_action)
        if self.l2_key_bits not in (2, 4):
            raise PaskError(f"bad table: l2_key_bits must be 2 or 4, got {self.l2_key_bits!r}")
        if self.num_groups < 1 or self.recent_window < 0:
            raise PaskError(f"bad table: num_groups {self.num_groups}, recent_window {self.recent_window}")
        for key, act in self.actions.items():
            parse_action(act)
            try:
                b = Bucket.parse(key)
            except (ValueError, KeyError) as e:
                raise PaskError(f"bad bucket '{key}' in table: {e}") from None
            if not 0 <= b.group < self.num_groups:
                raise PaskError(f"bucket '{key}' names group {b.group} but the table has {self.num_groups} groups")

    def action(self, bucket: Bucket | str) -> Action:
        """Action of a bucket (the default action when the table does not list it)."""
        return parse_action(self.actions.get(str(bucket), self.default_action))

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "model": {"name": self.model_name, "fingerprint": self.fingerprint},
            "task": self.task,
            "num_groups": self.num_groups,
            "recent_window": self.recent_window,
            "l2_key_bits": self.l2_key_bits,
            "target_b": self.target_b,
            "expected_b": self.expected_b,
            "tolerances": {"alpha_D": self.alpha_d, "alpha_P": self.alpha_p},
            "default_action": self.default_action,
            "actions": dict(sorted(self.actions.items())),
            "calibration": self.calibration,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FrozenTable:
        try:
            version = data["format_version"]
            if version != FORMAT_VERSION:
                raise PaskError(
                    f"table format_version {version} is not supported (this pask reads version {FORMAT_VERSION}); "
                    "recalibrate with `pask calibrate`"
                )
            tol = data.get("tolerances", {})
            model = data.get("model", {})
            return cls(
                actions=dict(data["actions"]),
                fingerprint=model["fingerprint"],
                model_name=model.get("name"),
                task=data["task"],
                num_groups=int(data["num_groups"]),
                recent_window=int(data["recent_window"]),
                l2_key_bits=int(data.get("l2_key_bits", 2)),
                target_b=data.get("target_b"),
                expected_b=data.get("expected_b"),
                alpha_d=float(tol.get("alpha_D", 0.05)),
                alpha_p=float(tol.get("alpha_P", 0.02)),
                default_action=data.get("default_action", "H"),
                calibration=data.get("calibration", {}),
                format_version=version,
            )
        except (KeyError, TypeError) as e:
            raise PaskError(f"bad table file: missing or malformed field {e}") from None

    def save(self, path: Path | str) -> Path:
        """Write the table as JSON (atomically: a temp file renamed over ``path``)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        tmp.replace(path)
        return path


def load(path: Path | str, fingerprint: str | None = None, allow_transfer: bool = False) -> FrozenTable:
    """Read a table file; check the format version and (when given) the model fingerprint.

    A table calibrated on another model (``fingerprint`` differs) raises :class:`PaskError`
    unless ``allow_transfer`` is true; then the table is returned with a warning in
    ``table.warnings`` (and a Python ``UserWarning``). A table whose calibration found its target
    infeasible (``calibration.feasible`` false: the floors alone exceed it) loads with a warning too,
    unless the calibration fitted it by relaxing floors (``calibration.fitted``: it reaches its target;
    its report names the relaxed floors).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PaskError(f"table file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise PaskError(f"table file {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise PaskError(f"table file {path} does not hold a JSON object")
    table = FrozenTable.from_json(data)
    if fingerprint is not None and table.fingerprint != fingerprint:
        msg = (
            f"table {path} was calibrated on model {table.model_name or '?'} ({table.fingerprint}), "
            f"not on this model ({fingerprint})"
        )
        if not allow_transfer:
            how = "allow_transfer=True; --allow-transfer on the command line"
            raise PaskError(f"{msg}; recalibrate, or allow calibration transfer explicitly ({how})")
        table.warnings.append("calibration transfer: " + msg)
        _warnings.warn(table.warnings[-1], UserWarning, stacklevel=2)
    if table.calibration.get("feasible") is False and not table.calibration.get("fitted"):
        table.warnings.append(
            f"infeasible table: {path} was calibrated for B = {table.target_b}, but its floors alone hold "
            f"B = {table.expected_b} at its tolerances; it runs at about that B"
        )
        _warnings.warn(table.warnings[-1], UserWarning, stacklevel=2)
    return table


#: The committed tables shipped with the package (``pask/tables/*.json``; package data).
TABLES_DIR = Path(__file__).resolve().parents[1] / "tables"
DEFAULT_TASKS = ("bfcl", "sql")  # tasks with default tables (``bfcl4``'s table is an experiment, not a default)


#: Defaults below uniform INT4's floor (issue 29): the K4V2 frontier tables, whose file names say
#: how they were made rather than follow ``{model}-{task}-b{budget}.json``.
INDEXED_DEFAULTS: dict[tuple[str, str, str], str] = {
    ("qwen2.5-coder-0.5b", "bfcl", "0.15"): "qwen2.5-coder-0.5b-bfcl-k4v2-b0.15.json",
    ("qwen2.5-coder-0.5b", "bfcl", "0.2"): "qwen2.5-coder-0.5b-bfcl-k4v2-b0.2.json",
    ("qwen2.5-coder-0.5b", "sql", "0.15"): "qwen2.5-coder-0.5b-sql-cd-k4v2-b0.15.json",
    ("qwen2.5-coder-0.5b", "sql", "0.2"): "qwen2.5-coder-0.5b-sql-cd-k4v2-b0.2.json",
}


def default_table(model: str, task: str, budget: float) -> Path | None:
    """The committed table shipped in ``pask/tables`` for an embedded model name (e.g.
    ``"qwen2.5-coder-0.5b"``), a task (``"bfcl"`` or ``"sql"``) and a budget: the file
    ``{model}-{task}-b{budget:g}.json`` (e.g. ``qwen2.5-coder-0.5b-bfcl-b0.33.json``), else the
    K4V2 frontier table :data:`INDEXED_DEFAULTS` names at B = 0.15 / 0.2, or None if there is none
    (another model, task or budget)."""
    if task not in DEFAULT_TASKS or not model or "/" in model or "\\" in model:
        return None
    path = TABLES_DIR / f"{model}-{task}-b{float(budget):g}.json"
    if not path.is_file() and (name := INDEXED_DEFAULTS.get((model, task, f"{float(budget):g}"))):
        path = TABLES_DIR / name
    return path if path.is_file() else None
