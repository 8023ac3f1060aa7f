"""Errors of the tiered KV cache (all are :class:`pask.errors.PaskError`)."""

from __future__ import annotations

from pask.errors import PaskError


class KVCacheError(PaskError):
    """Base class of tiered-cache errors."""


class UnsupportedModelError(KVCacheError):
    """The model's attention layout cannot be served by the tiered cache."""


class UnknownPositionError(KVCacheError):
    """An action names a position the sequence never stored (or a bad sequence/group)."""


class AlreadyReleasedError(KVCacheError):
    """An action targets a token whose K/V were already released."""


class IrreversibleActionError(KVCacheError):
    """An action asks to move a token back up the harm order (INT4 to BF16, INT2 to INT4 or BF16)."""


class ProtectedTokenError(KVCacheError):
    """An action targets a token inside the protected recent window."""
