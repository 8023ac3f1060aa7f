"""The per-case rows of a resumable run: one JSON object per line of ``cases.jsonl``.

Kept free of model imports so that reading results (reports, sweep bookkeeping) stays light.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def repair_jsonl(path: Path) -> None:
    """Drop a torn last line (a run killed mid-write), so that appended rows start on their own line."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def read_done(path: Path, key: Callable[[dict], object] = lambda row: row["id"]) -> dict:
    """Finished records of a resumable JSONL file by ``key`` (case id by default); a torn last line is ignored."""
    done: dict = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[key(row)] = row
    return done
