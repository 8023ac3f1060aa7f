"""The candidate configurations of MetaKV: each a named (policy, budget, table / configuration).

A candidate is what a user could run alone: Full KV, a PASK table at its budget, KIVI-4 / KIVI-2,
an eviction baseline at a budget with its dev-tuned configuration. ``name`` is how results and
responses refer to it: ``full``, ``kivi-4@0.33``, ``pask-k4v2@0.2``, ``snapkv@0.33``.
A PASK table is kept as its file name when it is one of the committed tables (``pask/tables/``,
shipped with the package) and as an absolute path otherwise, with its sha256, which
:meth:`Candidate.build` checks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pask.errors import PaskError
from pask.policies.table import TABLES_DIR

PASK_POLICIES = ("pask", "pask-3a", "pask-k4v2")  # PASK with a table (three / four actions, K4V2)


def candidate_name(policy: str, budget: float | None) -> str:
    """``policy@budget`` (``full`` alone)."""
    return policy if budget is None or policy == "full" else f"{policy}@{budget:g}"


def _sha256(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        raise PaskError(f"table file {path} does not exist") from None


@dataclass(frozen=True)
class Candidate:
    """One configuration a request may get (see the module docstring)."""

    policy: str
    budget: float | None = None
    table: str | None = None  # PASK: a committed table's file name, or an absolute path
    table_sha256: str | None = None
    policy_config: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return candidate_name(self.policy, self.budget)

    @classmethod
    def of(cls, policy: str, budget: float | None, table: str | Path | None = None, policy_config=None) -> Candidate:
        """A candidate from a sweep cell's fields; a table under ``pask/tables/`` is kept by name."""
        if policy in PASK_POLICIES and table is None:
            raise PaskError(f"candidate {candidate_name(policy, budget)}: PASK needs a table")
        name = None
        if table is not None:
            path = Path(table).resolve()
            name = path.name if path.parent == TABLES_DIR.resolve() else str(path)
            sha = _sha256(path)
        return cls(policy, budget, name, sha if table is not None else None, dict(policy_config or {}))

    def table_path(self) -> Path | None:
        if self.table is None:
            return None
        path = Path(self.table)
        return path if path.is_absolute() else TABLES_DIR / path

    def build(self, task: str, fingerprint: str | None = None):
        """The policy object of this candidate (None: Full KV); a changed table is refused."""
        if self.policy in PASK_POLICIES:
            from pask.policies.pask import make_pask_policy

            path = self.table_path()
            if _sha256(path) != self.table_sha256:
                raise PaskError(f"candidate {self.name}: table {path} changed since the predictor was fitted")
            return make_pask_policy(path, self.budget, fingerprint=fingerprint)
        from pask.policies.factory import make_policy

        config = json.dumps(self.policy_config) if self.policy_config else None
        return make_policy(self.policy, self.budget, config, task)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Candidate:
        try:
            return cls(
                str(data["policy"]),
                None if data.get("budget") is None else float(data["budget"]),
                data.get("table"),
                data.get("table_sha256"),
                dict(data.get("policy_config") or {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PaskError(f"bad MetaKV candidate {data!r}: {e}") from None


def cache_key_bits(policies: dict[str, Any]) -> int | None:
    """The L2 key width one running cache must have for all ``policies`` (name -> policy or None).

    A running batch holds one cache layout; a policy that needs INT4 L2 keys (a K4V2 PASK table) and
    one that needs INT2 keys (KIVI-2, MiKV) cannot share it: :class:`PaskError` naming both.
    None: no policy needs a particular width.
    """
    need: dict[int, str] = {}
    for name, policy in policies.items():
        bits = None if policy is None else policy.l2_key_bits
        if bits is not None:
            need.setdefault(int(bits), name)
    if len(need) > 1:
        (a, na), (b, nb) = sorted(need.items())[:2]
        raise PaskError(
            f"candidates {na} (INT{a} L2 keys) and {nb} (INT{b} L2 keys) cannot share one running cache: "
            "serve a subset that agrees (--meta-candidates)"
        )
    return next(iter(need), None)


def names(candidates: Sequence[Candidate]) -> list[str]:
    out = [c.name for c in candidates]
    if len(set(out)) != len(out):
        raise PaskError(f"duplicate MetaKV candidates: {out}")
    return out
