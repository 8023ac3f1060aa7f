"""Text-to-SQL task data: Spider dev cases, their SQLite databases and fixed database-disjoint splits.

A data directory holds ``dev.json`` (Spider format: db_id, question, query, parsed ``sql``),
``tables.json`` and ``database/<db_id>/<db_id>.sqlite``. The default is the project copy
``data/spider-dev`` (see its README.md for licence and attribution).

Databases: cases are scored on the original Spider databases. A database is *original* when it
is listed in ``dev_slim_original_dbs.json``, else when ``MANIFEST.json`` marks its fidelity
``original``, else (neither file present) always. In the project copy ``wta_1`` is a partial
reconstruction (its ``rankings`` table is empty): its 62 cases load with ``original_db=False``
and are left out of the splits.

Splits (:func:`split_cases`): whole databases go to ``calibration`` / ``dev`` / ``test`` with
about 20 % / 20 % / 60 % of the questions. With ``seed`` the generator draws
:data:`SPLIT_TRIALS` shuffles of the sorted database ids, fills the splits greedily in each
order (every database goes to the split furthest below its target) and keeps the first
assignment with the smallest largest deviation from the targets. For the project copy and
the default seed this gives (678 questions on 16 databases):

- calibration (136): museum_visit, orchestra, student_transcripts_tracking
- dev (135): course_teach, network_1, real_estate_properties, singer, voter_1
- test (407): battle_death, concert_singer, cre_Doc_Template_Mgt, employee_hire_evaluation,
  flight_2, pets_1, poker_player, tvshow

Difficulty: Spider's hardness buckets of the gold query, see :mod:`pask.tasks.spider_hardness`.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pask.errors import PaskError
from pask.structure.sql_schema import Schema, check_sqlite_file, read_schema
from pask.tasks.spider_hardness import spider_hardness

DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "spider-dev"
SPLITS = ("calibration", "dev", "test")
UNRATED = "unrated"  # the difficulty of a question without Spider's parsed query ("sql") to rate it
SPLIT_FRACTIONS = (0.2, 0.2, 0.6)
SPLIT_SEED = 0
SPLIT_TRIALS = 256


@dataclass(frozen=True)
class Case:
    """One question: ``id`` is ``dev-NNNN``, the position in dev.json."""

    id: str
    db_id: str
    question: str
    gold_sql: str
    difficulty: str
    original_db: bool = True


def _dir(data_dir: Path | str | None) -> Path:
    return Path(data_dir) if data_dir is not None else DEFAULT_DATA_DIR


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise PaskError(f"missing text-to-SQL data file: {path}") from e
    except json.JSONDecodeError as e:
        raise PaskError(f"bad JSON in {path}: {e}") from e


@lru_cache(maxsize=8)
def _known_db_ids(data_dir: Path) -> frozenset[str]:
    return frozenset(entry["db_id"] for entry in _read_json(data_dir / "tables.json"))


@lru_cache(maxsize=8)
def original_db_ids(data_dir: Path | str | None = None) -> frozenset[str] | None:
    """Databases marked original (see module doc); ``None`` when the directory marks none."""
    d = _dir(data_dir)
    if (d / "dev_slim_original_dbs.json").is_file():
        return frozenset(e["db_id"] for e in _read_json(d / "dev_slim_original_dbs.json"))
    if (d / "MANIFEST.json").is_file():
        per_db = _read_json(d / "MANIFEST.json").get("per_db", {})
        return frozenset(db for db, info in per_db.items() if info.get("fidelity") == "original")
    return None


def load_cases(data_dir: Path | str | None = None) -> list[Case]:
    """All cases of ``dev.json`` in file order (including those on non-original databases)."""
    d = _dir(data_dir)
    originals = original_db_ids(d)
    cases = []
    for i, e in enumerate(_read_json(d / "dev.json")):
        try:
            cases.append(
                Case(
                    id=f"dev-{i:04d}",
                    db_id=e["db_id"],
                    question=e["question"],
                    gold_sql=e["query"],
                    difficulty=spider_hardness(e["sql"]) if "sql" in e else UNRATED,
                    original_db=originals is None or e["db_id"] in originals,
                )
            )
        except (KeyError, TypeError, IndexError) as err:
            raise PaskError(f"malformed entry {i} in {d / 'dev.json'}: {err!r}") from err
    return cases


def db_path(db_id: str, data_dir: Path | str | None = None) -> Path:
    """The SQLite file of ``db_id``; :class:`PaskError` for an unknown id or a missing/invalid file."""
    d = _dir(data_dir)
    if db_id not in _known_db_ids(d):
        raise PaskError(f"unknown db_id {db_id!r} (not in {d / 'tables.json'})")
    path = d / "database" / db_id / f"{db_id}.sqlite"
    check_sqlite_file(path)
    return path


def load_schema(db_id: str, data_dir: Path | str | None = None) -> Schema:
    """The schema of ``db_id``, read from its SQLite file."""
    return _load_schema(db_id, _dir(data_dir).resolve())


@lru_cache(maxsize=64)
def _load_schema(db_id: str, data_dir: Path) -> Schema:
    return read_schema(db_path(db_id, data_dir), db_id)


def _greedy(order: list[str], sizes: Counter, targets: list[float]) -> tuple[dict[str, str], float]:
    filled = [0] * len(SPLITS)
    assignment = {}
    for db in order:
        k = max(range(len(SPLITS)), key=lambda j: targets[j] - filled[j])
        filled[k] += sizes[db]
        assignment[db] = SPLITS[k]
    return assignment, max(abs(t - f) for t, f in zip(targets, filled, strict=True))


def assign_databases(
    cases: list[Case], seed: int = SPLIT_SEED, fractions: tuple[float, float, float] = SPLIT_FRACTIONS
) -> dict[str, str]:
    """Map every database of ``cases`` to one of :data:`SPLITS` (deterministic for a seed)."""
    sizes = Counter(c.db_id for c in cases)
    total = sum(sizes.values())
    targets = [f * total for f in fractions]
    rng = random.Random(seed)
    best: tuple[dict[str, str], float] | None = None
    for _ in range(SPLIT_TRIALS):
        order = sorted(sizes)
        rng.shuffle(order)
        candidate = _greedy(order, sizes, targets)
        if best is None or candidate[1] < best[1]:
            best = candidate
    return best[0] if best else {}


def split_cases(
    cases: list[Case], seed: int = SPLIT_SEED, fractions: tuple[float, float, float] = SPLIT_FRACTIONS
) -> dict[str, list[Case]]:
    """Database-disjoint calibration / dev / test splits of the cases on original databases."""
    kept = [c for c in cases if c.original_db]
    assignment = assign_databases(kept, seed, fractions)
    splits: dict[str, list[Case]] = {s: [] for s in SPLITS}
    for c in kept:
        splits[assignment[c.db_id]].append(c)
    return splits
