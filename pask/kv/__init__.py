"""Tiered KV cache: BF16 (H), packed INT4 (L), packed INT2 (L2) or released (R) per token × layer group.

Typical use (see :mod:`pask.runtime.runner` for a complete loop)::

    from pask.kv import Action, CacheConfig, TieredCache, use_pask_attention

    with use_pask_attention(model):               # registers and selects attn_implementation="pask"
        cache = TieredCache(model.config, CacheConfig(), batch_size=B)
        cache.begin_prefill(pad_lengths)          # left padding of each row (pads are not stored)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
        cache.apply(seq=0, group=1, positions=torch.tensor([3, 4]), action=Action.L)
        # decode: one token per row, explicit positions [B, 1] = cache.seq_length(row)
        out = model(input_ids=next_ids, position_ids=positions, cache=cache, use_cache=True)
        cache.sample_budget()                     # once per decode step (time-averaged B)
        print(cache.budget())                     # Budget(b_prompt, b_decode, b_total, b_total_avg, ...)
        cache.drop(row)                           # a finished row: frees its bytes
"""

from pask.kv.actions import Action
from pask.kv.attention import enable_pask_attention, register, use_pask_attention
from pask.kv.budget import Budget, BudgetMeter, CostModel
from pask.kv.cache import CacheConfig, TieredCache, TieredLayer, layer_groups
from pask.kv.errors import (
    AlreadyReleasedError,
    IrreversibleActionError,
    KVCacheError,
    ProtectedTokenError,
    UnknownPositionError,
    UnsupportedModelError,
)
from pask.kv.quant import Int4Tensor, dequantize_int4, quantize_int4

__all__ = [
    "Action",
    "AlreadyReleasedError",
    "Budget",
    "BudgetMeter",
    "CacheConfig",
    "CostModel",
    "Int4Tensor",
    "IrreversibleActionError",
    "KVCacheError",
    "ProtectedTokenError",
    "TieredCache",
    "TieredLayer",
    "UnknownPositionError",
    "UnsupportedModelError",
    "dequantize_int4",
    "enable_pask_attention",
    "layer_groups",
    "quantize_int4",
    "register",
    "use_pask_attention",
]
