"""KV-capacity admission: a fixed logical capacity in tokens of Full KV (the paper's Table 3 setting).

The server holds at most ``capacity_tokens`` tokens' worth of Full-KV bytes. A request reserves
the bytes it would hold at the policy's target budget, ``(prompt + max_new_tokens) x bytes per
token x B``, and is admitted when the reservations of the running requests plus its own fit: a
policy at B = 0.33 admits about three times as many concurrent requests as Full KV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pask.errors import PaskError
from pask.policies.base import Policy


class CapacityError(PaskError):
    """A request that can never be admitted (it alone exceeds the KV capacity or the model's context)."""


@dataclass(frozen=True)
class KVCapacity:
    """Admission rule of one server.

    Parameters
    ----------
    bytes_per_token : int
        Full-precision K+V bytes of one token over all layers (the model dtype).
    target_b : float
        The policy's target KV budget B (1 for Full KV).
    tokens : int | None
        Logical capacity in Full-KV tokens; ``None``: unlimited.
    """

    bytes_per_token: int
    target_b: float = 1.0
    tokens: int | None = None

    def __post_init__(self) -> None:
        if self.bytes_per_token < 1:
            raise PaskError(f"bytes_per_token must be >= 1, got {self.bytes_per_token}")
        if not 0 < self.target_b <= 1:
            raise PaskError(f"target budget must be in (0, 1], got {self.target_b}")
        if self.tokens is not None and self.tokens < 1:
            raise PaskError(f"capacity must be >= 1 token, got {self.tokens}")

    @property
    def capacity_bytes(self) -> int | None:
        return None if self.tokens is None else self.tokens * self.bytes_per_token

    def cost(self, prompt_len: int, max_new_tokens: int) -> int:
        """Bytes a request reserves: its tokens at the target budget."""
        return math.ceil((prompt_len + max_new_tokens) * self.bytes_per_token * self.target_b)

    def fits(self, reserved: int) -> bool:
        cap = self.capacity_bytes
        return cap is None or reserved <= cap

    def max_new_tokens(self, prompt_len: int) -> int | None:
        """The most new tokens a request of ``prompt_len`` may ask for (None: unlimited)."""
        if self.tokens is None:
            return None
        return max(0, math.floor(self.tokens / self.target_b + 1e-9) - prompt_len)

    def check(self, prompt_len: int, max_new_tokens: int) -> int:
        """The request's reservation; CapacityError when it alone exceeds the capacity."""
        cost = self.cost(prompt_len, max_new_tokens)
        if not self.fits(cost):
            raise CapacityError(
                f"prompt of {prompt_len} tokens + max_tokens {max_new_tokens} needs "
                f"{(prompt_len + max_new_tokens) * self.target_b:.0f} tokens of KV at B = {self.target_b:g}, "
                f"over the server's capacity of {self.tokens} tokens"
            )
        return cost


def kv_bytes_per_token(model_config, dtype: torch.dtype) -> int:
    """Full-precision K+V bytes of one token over all layers of a decoder."""
    cfg = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * heads * head_dim * torch.empty((), dtype=dtype).element_size()


def policy_target_b(policy: Policy) -> float:
    """The budget a policy aims at: its :attr:`Policy.target_b <pask.policies.base.Policy>` (a PASK
    table's target (or expected) B, else its ``budget``, else 1)."""
    return float(policy.target_b)
