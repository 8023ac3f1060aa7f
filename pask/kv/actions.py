"""Retention actions for one token in one layer group."""

from __future__ import annotations

from enum import IntEnum


class Action(IntEnum):
    """What the cache keeps of a token's K/V in a layer group.

    ``H`` keeps it in the model dtype (BF16 in production), ``L`` keeps it packed
    as INT4 (irreversible: INT4 never goes back to ``H``), ``R`` releases it.
    """

    H = 0
    L = 1
    R = 2
