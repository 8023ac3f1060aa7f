"""CacheConfig: the tiered cache's settings (its own module: the storage layer below the cache reads it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pask.kv.errors import KVCacheError

if TYPE_CHECKING:
    from pask.kv.latent import LatentTier


@dataclass
class CacheConfig:
    """Tiered-cache settings."""

    num_groups: int = 4  # contiguous layer groups sharing one action per token
    recent_window: int = 8  # last tokens of each sequence, always H, no action allowed
    quant_group: int = 32  # INT4 scale/zero group along head_dim
    initial_capacity: int = 64  # tokens per tier at first allocation
    shrink_below: float = 0.5  # reallocate a tier to 1.25 x its live slots when live < capacity * shrink_below
    dequant_block: int = 256  # INT4 tokens dequantised at a time by the reference attention
    fast_path: bool = True  # use a fused CPU decode path when one applies (bf16 on CPU)
    native: bool = True  # prefer the compiled kernel (native_attention.cpp) over PyTorch's fused kernels
    key_balance: bool = True  # balance INT4 keys per channel before quantising (see storage.key_balance)
    headroom: int = 0  # spare slots of a tier's first allocation (0: doubling from initial_capacity)
    l2_key_bits: int = 2  # key code width of the L2 tier: 2 (INT2 keys and values) or 4 (K4V2: INT4 keys, INT2 values)
    cold_bits: int = 2  # code width of KVFetch's cold tier (pask.policies.kvfetch): 2 or 4
    latent: LatentTier | None = None  # BellowsKV: L keeps one latent per layer block (pask.kv.latent)

    def __post_init__(self) -> None:
        if self.num_groups < 1:
            raise KVCacheError(f"num_groups must be >= 1, got {self.num_groups}")
        if self.recent_window < 0:
            raise KVCacheError(f"recent_window must be >= 0, got {self.recent_window}")
        if self.initial_capacity < 1 or self.dequant_block < 1:
            raise KVCacheError("initial_capacity and dequant_block must be >= 1")
        if self.headroom < 0:
            raise KVCacheError(f"headroom must be >= 0, got {self.headroom}")
        if self.l2_key_bits not in (2, 4):
            raise KVCacheError(f"l2_key_bits must be 2 or 4, got {self.l2_key_bits!r}")
        if self.cold_bits not in (2, 4):
            raise KVCacheError(f"cold_bits must be 2 or 4, got {self.cold_bits!r}")
        if self.latent is not None and self.num_groups != len(self.latent.groups):
            raise KVCacheError(
                f"a latent cache has one layer group per latent block: num_groups must be {len(self.latent.groups)}"
            )
        if not 0.0 <= self.shrink_below < 0.8:
            raise KVCacheError(f"shrink_below must be in [0, 0.8), got {self.shrink_below}")
