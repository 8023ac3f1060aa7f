"""KV benchmark: bytes held and decode-attention time of a mixed tiered cache vs a full BF16 cache.

For each context length, synthetic random K/V with the model's real shapes (layers, kv heads,
head_dim; BF16) fill a TieredCache whose tokens outside the recent window get a static
H / INT4 / release (/ INT2) mix, and a full-precision reference (plain tensors for one layer,
transformers' DynamicCache for the whole model). Measured, in the same process:

* bytes: held (live K/V incl. INT4 scales/zeros) vs full BF16, the cost model's prediction and
  the bytes actually allocated (tensor ``numel * element_size``);
* one-layer decode attention, batch 1, one query token: the mixed path (the fused CPU path when
  available) vs ``torch.nn.functional.scaled_dot_product_attention`` over the full BF16 K/V of the
  same logical context (``enable_gqa=True``, what transformers runs at decode, and a stronger
  variant with the query packed per kv head), timed interleaved, medians and their ratios;
* one whole-model decode step at that context (random K/V in every layer), tiered vs DynamicCache,
  up to ``model_step_max_context`` (longer contexts are skipped and reported as such).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from pask.kv.actions import Action
from pask.kv.attention import enable_pask_attention, tiered_attention
from pask.kv.budget import CostModel
from pask.kv.cache import CacheConfig, TieredCache, attention_spec
from pask.policies.static_mix import StaticMixPolicy


def median_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall time of each function, calls interleaved round-robin (same conditions for all)."""
    for f in fns.values():  # warm up
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def _fill_tiered(config, cache_config: CacheConfig, kv: list[tuple[torch.Tensor, torch.Tensor]], mix) -> TieredCache:
    cache = TieredCache(config, cache_config, batch_size=1)
    for layer, (k, v) in enumerate(kv):
        cache.update(k, v, layer)
    n = kv[0][0].shape[2]
    outside = torch.arange(max(0, n - cache_config.recent_window))
    acts = StaticMixPolicy(*mix).assign(outside)
    for g in range(len(cache.groups)):
        for a in (Action.L, Action.L2, Action.R):
            cache.apply(0, g, outside[acts == int(a)], a)
    return cache


def bench_context(
    model, spec, n: int, mix: Sequence[float], repeats: int, model_step: bool, cache_config: CacheConfig, seed: int = 0
) -> dict:
    """All measurements at one context length."""
    gen = torch.Generator().manual_seed(seed)
    shape = (1, spec.num_kv_heads, n, spec.head_dim)
    kv = [
        (torch.randn(shape, generator=gen).to(torch.bfloat16), torch.randn(shape, generator=gen).to(torch.bfloat16))
        for _ in range(spec.num_layers)
    ]
    t0 = time.perf_counter()
    cache = _fill_tiered(model.config, cache_config, kv, mix)
    fill_s = time.perf_counter() - t0
    alloc_steady = cache.allocated_bytes()  # after the tiers' own shrinking, before compact()
    cache.compact()
    cm = CostModel(spec.head_dim, cache_config.quant_group, torch.bfloat16)
    held, full, alloc = cache.held_bytes(), cache.full_bytes(), cache.allocated_bytes()
    w = min(n, cache_config.recent_window)
    predicted = full * (w + (n - w) * cm.mix_cost(*mix)) / n
    st = cache.layers[0].seqs[0]
    out = {
        "context": n,
        "tokens_per_layer": {"H": st.h.n, "L": st.l.n, "L2": st.l2.n, "R": n - st.h.n - st.l.n - st.l2.n},
        "full_bytes": full,
        "held_bytes": held,
        "allocated_bytes": alloc,
        "predicted_bytes": round(predicted),
        "b_measured": held / full,
        "b_cost_model": predicted / full,
        "cost_model_discrepancy": (held - predicted) / predicted,
        "allocated_over_held": alloc / held,
        "allocated_bytes_before_compact": alloc_steady,
        "cost_model_vs_allocated": (alloc - predicted) / predicted,
        "fill_and_actions_s": round(fill_s, 2),
    }
    # one-layer decode attention
    layer0 = cache.layers[0]
    q = torch.randn(1, spec.num_q_heads, 1, spec.head_dim, generator=gen).to(torch.bfloat16)
    k0, v0 = kv[0]
    scale = spec.head_dim**-0.5
    from pask.kv import fastpath, native_attention

    sdpa = torch.nn.functional.scaled_dot_product_attention
    q_packed = q.reshape(1, spec.num_kv_heads, -1, spec.head_dim)  # GQA as [B, Hkv, group, D]: no K/V repeat
    native = cache.config.fast_path and cache.config.native and native_attention.applies(q, layer0)
    fns = {
        "full_sdpa": lambda: sdpa(q, k0, v0, scale=scale, enable_gqa=True),  # what transformers runs at decode
        "full_sdpa_packed_gqa": lambda: sdpa(q_packed, k0, v0, scale=scale),
        # the path the model runs: the native kernel when it applies, else the per-sequence path
        "mixed": (lambda: native_attention.decode_layer(layer0, q, scale))
        if native
        else (lambda: tiered_attention(layer0, 0, q[0], scale, 1)),
    }
    fused = fastpath.applies(q[0], st)
    if fused:  # PyTorch's fused kernels (the path before the native kernel) and their two streams
        qg = q[0].reshape(spec.num_kv_heads, -1, spec.head_dim)
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        hk, hv = st.h.view("k")[None], st.h.view("v")[None]
        fns["torch_fused"] = lambda: fastpath.decode_attention(q[0], st, scale)
        fns["h_stream"] = lambda: flash(qg[None], hk, hv, 0.0, False, scale=scale)
        fns["int4_stream"] = lambda: fastpath.int4_stream(qg, st, scale)
    ms = median_ms(fns, repeats)
    mixed_out = fns["mixed"]().float()
    out["attention_ms"] = {k: round(v, 4) for k, v in ms.items()}
    out["attention_speedup"] = ms["full_sdpa"] / ms["mixed"]
    out["attention_speedup_vs_packed_gqa"] = ms["full_sdpa_packed_gqa"] / ms["mixed"]
    out["fused_path"] = fused
    out["native_kernel"] = native
    if fused and st.l.n and st.h.n:
        per_h = ms["h_stream"] / st.h.n
        out["int4_token_cost_vs_h_token"] = (ms["int4_stream"] / st.l.n) / per_h
        out["h_stream_share_of_full"] = ms["h_stream"] / ms["full_sdpa"]
    out["mixed_output_rms"] = float(mixed_out.pow(2).mean().sqrt())
    if model_step:
        out["model_step_ms"] = _model_step(model, cache, kv, n, max(3, repeats // 10))
        out["model_step_speedup_vs_full_tiered"] = out["model_step_ms"]["full_tiered"] / out["model_step_ms"]["tiered"]
        out["model_step_speedup_vs_dynamic"] = out["model_step_ms"]["full_dynamic"] / out["model_step_ms"]["tiered"]
    del cache, kv
    return out


def _model_step(model, cache: TieredCache, kv, n: int, repeats: int) -> dict[str, float]:
    """Whole-model decode step: mixed tiered cache, all-H tiered cache, DynamicCache (each step appends)."""
    from transformers import DynamicCache

    dyn = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(kv):
        dyn.update(k, v, layer)
    full = _fill_tiered(model.config, cache.config, kv, (1.0, 0.0, 0.0))
    tok = torch.tensor([[1]])

    def step(c, impl):
        model.config._attn_implementation_internal = impl
        pos = torch.tensor([[c.get_seq_length()]])
        return model(input_ids=tok, position_ids=pos, cache=c, use_cache=True, logits_to_keep=1)

    prev = enable_pask_attention(model)
    try:
        fns = {
            "full_dynamic": lambda: step(dyn, "sdpa"),
            "full_tiered": lambda: step(full, "pask"),
            "tiered": lambda: step(cache, "pask"),
        }
        ms = median_ms(fns, repeats)
    finally:
        model.set_attn_implementation(prev)
    return {k: round(v, 2) for k, v in ms.items()}


def bench_kv(
    model_name: str = "smollm2-135m",
    contexts: Sequence[int] = (2048, 8192, 32768),
    mix: Sequence[float] = (0.34, 0.33, 0.33),
    repeats: int = 30,
    model_step_max_context: int = 32768,
    threads: int = 1,
    cache_config: CacheConfig | None = None,
) -> dict:
    """Run the benchmark for each context; returns a JSON-able dict (see the module docstring)."""
    from pask.runtime.models import load_model

    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lm = load_model(model_name, dtype=torch.bfloat16)
        cache_config = cache_config or CacheConfig()
        spec = attention_spec(lm.model.config, cache_config.quant_group)
        results = {
            "model": model_name,
            "shapes": {
                "layers": spec.num_layers,
                "q_heads": spec.num_q_heads,
                "kv_heads": spec.num_kv_heads,
                "head_dim": spec.head_dim,
            },
            "mix_h_l_r": list(mix[:3]),
            "mix_l2": float(mix[3]) if len(mix) > 3 else 0.0,
            "int4_ratio": CostModel(spec.head_dim, cache_config.quant_group, torch.bfloat16).l_ratio,
            "threads": threads,
            "repeats": repeats,
            "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
            "model_step_max_context": model_step_max_context,
            "contexts": [],
        }
        with torch.no_grad():
            for n in contexts:
                step = n <= model_step_max_context
                results["contexts"].append(bench_context(lm.model, spec, n, mix, repeats, step, cache_config))
        return results
    finally:
        torch.set_num_threads(prev_threads)
