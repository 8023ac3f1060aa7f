"""Retention actions for one token in one layer group."""

from __future__ import annotations

from enum import IntEnum


class Action(IntEnum):
    """What the cache keeps of a token's K/V in a layer group.

    ``H`` keeps it in the model dtype (BF16 in production), ``L`` keeps it packed as INT4, ``L2``
    packed as INT2, ``R`` releases it. Harm grows ``H < L < L2 < R``; a token only moves down
    that chain (INT4 never goes back to ``H``, INT2 never back to INT4 or ``H``). The values are
    storage codes, not the order (``L2`` came last, so tables and tier codes written before it
    keep their meaning); :data:`HARM_ORDER` gives the order.
    """

    H = 0
    L = 1
    R = 2
    L2 = 3


#: Actions from least to most harmful (the direction a token may move in).
HARM_ORDER = (Action.H, Action.L, Action.L2, Action.R)

#: Code width of each low-bit action.
LOW_BITS = {Action.L: 4, Action.L2: 2}


def harm(action: Action | int) -> int:
    """Rank of ``action`` in :data:`HARM_ORDER` (0 = H ... 3 = R)."""
    return HARM_ORDER.index(Action(int(action)))


class ColdOp(IntEnum):
    """KVFetch's operations on the cold tier (:mod:`pask.policies.kvfetch`), beside the retention actions.

    A policy returns them in its action list like an :class:`Action`; the cache applies them with
    :meth:`pask.kv.cache.TieredCache.recall`. ``DEMOTE``: copy held tokens into the cold tier
    (``CacheConfig.cold_bits`` codes, never read by attention) and release them from attention.
    ``FETCH``: dequantise demoted tokens back into the H tier (a fetch slot: the one move up the
    harm chain, and only for a token that has a cold copy). ``UNFETCH``: release fetched tokens
    again; their cold copy stays.
    """

    DEMOTE = 10
    FETCH = 11
    UNFETCH = 12
