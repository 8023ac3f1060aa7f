"""Where pask keeps what it builds: converted models, native libraries, prefill stores."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """XDG cache directory for converted models and native builds (``$PASK_CACHE`` overrides)."""
    if env := os.environ.get("PASK_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pask"
