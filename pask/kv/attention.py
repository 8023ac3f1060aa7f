"""The "pask" attention: exact prefill, then decode over a TieredCache's H, INT4 and INT2 streams.

Registration: :func:`register` adds ``"pask"`` to transformers' ``AttentionInterface`` and a
mask function to ``AttentionMaskInterface`` (idempotent). :func:`enable_pask_attention` (or the
context manager :func:`use_pask_attention`) checks the model and calls
``model.set_attn_implementation("pask")``.

Finding the cache: transformers' attention modules consume the ``cache`` argument and do not pass
it to the attention function, so :meth:`TieredCache.update` records, in a thread-local, the layer
it just updated together with the key tensor it returned. The attention function takes that
layer when the ``key`` it receives *is* that tensor (identity check, so a stale record is never
used) and checks ``module.layer_idx``; without a TieredCache it behaves as plain SDPA.

Masks: the mask function builds the usual SDPA mask (causal + left padding) for the first
forward of a cache (``q_offset == 0``) and returns ``None`` afterwards: each sequence's tiers are
exact (pads never stored, released tokens gone), so decode needs no mask, and a multi-token
extend masks causally among its own new tokens, which sit at the tail of the H tier.

Decode math (per sequence): ``q [Hq, D]`` is viewed as ``[Hkv, Hq/Hkv, D]`` (GQA without repeating
K/V); the H tier, the INT4 tier and the INT2 tier (both dequantised ``dequant_block`` tokens at a
time) are merged with one FP32 online softmax (running max, running sum, running output). The scale is
``module.scaling``. Which code computes it, in order of preference (``CacheConfig.fast_path`` /
``native``): the native kernel (:mod:`pask.kv.native_attention`: one call per layer for the whole
batch, bf16 on CPU), PyTorch's fused CPU kernels per sequence (:mod:`pask.kv.fastpath`), the
reference below (any dtype; what the fp32 exactness tests run).

Statistics: when the cache has a :class:`pask.kv.stats.StatsCollector` (a policy asked for
attention statistics), the prefill also records them after SDPA, and a decode step that needs them
runs :func:`pask.kv.stats.explicit_decode` (explicit FP32 scores, one softmax) instead of the fused
path. Without a collector nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from pask.kv import native_attention, native_latent, stats
from pask.kv.actions import Action
from pask.kv.cache import CacheConfig, TieredCache, TieredLayer, active_layer, attention_config, attention_spec
from pask.kv.errors import UnsupportedModelError
from pask.kv.storage import _SeqStore

NAME = "pask"
H_CHUNK = 4096  # H-tier tokens upcast to fp32 at a time by the reference path


class OnlineSoftmax:
    """FP32 running max / sum / output over score blocks (rows = query heads x query tokens)."""

    def __init__(self, heads: int, rows: int, head_dim: int, device=None):
        self.m = torch.full((heads, rows), -torch.inf, device=device)
        self.l = torch.zeros((heads, rows), device=device)
        self.acc = torch.zeros((heads, rows, head_dim), device=device)

    def _rescale(self, m_blk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m_new = torch.maximum(self.m, m_blk)
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(self.m - m_safe)
        self.m = m_new
        return m_safe, alpha

    def update(self, scores: torch.Tensor, values: torch.Tensor) -> None:
        """Add a block: ``scores [Hkv, rows, n]`` (fp32, -inf = masked), ``values [Hkv, n, D]`` (fp32)."""
        if scores.shape[-1] == 0:
            return
        m_safe, alpha = self._rescale(scores.amax(dim=-1))
        p = torch.exp(scores - m_safe[..., None])
        self.l = self.l * alpha + p.sum(dim=-1)
        self.acc = self.acc * alpha[..., None] + torch.matmul(p, values)

    def update_projected(self, scores: torch.Tensor, z: torch.Tensor, project) -> None:
        """Add a block whose values are a linear map of latents ``z [n', hidden]`` (``n' >= n``, the
        scores' count: rows past ``n`` get zero weight, so that the product's shapes can be bucketed):
        the weights sum the latents first and ``project(pz [Hkv, rows, hidden], mass [Hkv, rows])``
        maps the sum once (BellowsKV's values, :meth:`pask.kv.latent.LatentTier.project_values`)."""
        n = scores.shape[-1]
        if n == 0:
            return
        m_safe, alpha = self._rescale(scores.amax(dim=-1))
        p = torch.exp(scores - m_safe[..., None])
        mass = p.sum(dim=-1)
        self.l = self.l * alpha + mass
        pw = p.new_zeros(*p.shape[:-1], z.shape[0], dtype=z.dtype)
        pw[..., :n] = p
        self.acc = self.acc * alpha[..., None] + project(torch.matmul(pw, z), mass)

    def merge(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Add a block already reduced to a normalised output ``[Hkv, rows, D]`` and its log-sum-exp."""
        m_safe, alpha = self._rescale(lse)
        beta = torch.exp(lse - m_safe)
        self.l = self.l * alpha + beta
        self.acc = self.acc * alpha[..., None] + beta[..., None] * out.float()

    def result(self) -> torch.Tensor:
        return self.acc / self.l[..., None]


def tiered_attention_reference(
    q: torch.Tensor, store: _SeqStore, scaling: float, n_new: int = 1, block: int = 256
) -> torch.Tensor:
    """Attention of one sequence's queries ``q [Hq, qn, D]`` over its H, INT4 and INT2 tiers -> ``[qn, Hq, D]``.

    The ``n_new`` newest H slots are the query tokens themselves (causal among them).
    """
    qf, state = _with_h_stream(q, store, scaling, n_new)
    for bits in (4, 2):
        n_l = store.low(bits).n
        for a in range(0, n_l, block):
            k, v = store.low_kv(a, min(n_l, a + block), bits=bits)
            state.update(torch.matmul(qf, k.transpose(1, 2)) * scaling, v)
    return _output(state, q)


def _with_h_stream(q: torch.Tensor, store: _SeqStore, scaling: float, n_new: int) -> tuple[torch.Tensor, OnlineSoftmax]:
    """The queries ``q [Hq, qn, D]`` as fp32 ``[Hkv, rows, D]`` and a softmax state holding the H tier."""
    hq, qn, d = q.shape
    hkv = store.h.heads
    qf = q.float().reshape(hkv, hq // hkv * qn, d)
    state = OnlineSoftmax(hkv, qf.shape[1], d, device=q.device)
    _h_stream(state, qf, store, scaling, qn, n_new)
    return qf, state


def _output(state: OnlineSoftmax, q: torch.Tensor) -> torch.Tensor:
    """The state's result as ``[qn, Hq, D]`` in ``q``'s dtype."""
    hq, qn, d = q.shape
    hkv = state.acc.shape[0]
    out = state.result().reshape(hkv, hq // hkv, qn, d).permute(2, 0, 1, 3).reshape(qn, hq, d)
    return out.to(q.dtype)


def _h_stream(state: OnlineSoftmax, qf: torch.Tensor, store: _SeqStore, scaling: float, qn: int, n_new: int) -> None:
    """Add a sequence's H tier to ``state`` (the ``n_new`` newest slots are the queries: causal among them)."""
    n_h = store.h.n
    if n_h:
        kh, vh = store.h.view("k"), store.h.view("v")
        first_new = n_h - n_new
        # row r = j * qn + i sees slot s iff s <= first_new + i
        row_limit = first_new + torch.arange(qn, device=qf.device).repeat(qf.shape[1] // qn)
        for a in range(0, n_h, H_CHUNK):
            b = min(n_h, a + H_CHUNK)
            s = torch.matmul(qf, kh[:, a:b].float().transpose(1, 2)) * scaling
            if n_new > 1 and b > first_new + 1:
                slot = torch.arange(a, b, device=qf.device)
                s = s.masked_fill(slot[None, None, :] > row_limit[None, :, None], -torch.inf)
            state.update(s, vh[:, a:b].float())


def latent_attention(
    layer: TieredLayer,
    seq: int,
    q: torch.Tensor,
    scaling: float,
    n_new: int = 1,
    keys: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence's decode/extend attention on a latent cache (:mod:`pask.kv.latent`) -> ``[qn, Hq, D]``.

    The layer's H tier as in the reference; then the block's latent tokens, decoded once per
    forward for all the block's layers and rows (:meth:`~pask.kv.cache.TieredCache.latent_rows`):
    keys reconstructed through the layer's projection and rotated at their positions (``keys``:
    the row's slice of :func:`latent_layer`'s keys, computed here when not given; or their
    ``scores [Hkv, rows, m]``, scaled, from :mod:`pask.kv.native_latent`), values folded in
    through :meth:`OnlineSoftmax.update_projected` (the weighted latent sum is projected once,
    instead of every token's values).
    """
    cache = layer.cache
    lat = cache.config.latent
    qf, state = _with_h_stream(q, layer.seqs[seq], scaling, n_new)
    z, cos, sin = cache.latent_block(seq, layer.group)
    if z.shape[0]:
        i = layer.layer_idx
        if scores is None:
            k = lat.keys(i, z, cos, sin) if keys is None else keys
            scores = torch.matmul(qf, k.transpose(1, 2)) * scaling
        values = lat.value_part(cache.latent_padded(seq, layer.group))  # bucketed rows: few GEMM shapes
        state.update_projected(scores, values, lambda pz, mass: lat.project_values(i, pz, mass))
    return _output(state, q)


def latent_layer(layer: TieredLayer, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """A latent cache's decode/extend attention of one layer for the batch ``query [B, Hq, qn, D]`` ->
    ``[B, qn, Hq, D]``: the keys of every row's latent tokens rebuilt in one product (and scored by
    :mod:`pask.kv.native_latent` where it applies), then each row."""
    cache = layer.cache
    lat = cache.config.latent
    bsz, hq, qn, d = query.shape
    out = query.new_zeros(bsz, qn, hq, d)
    z, cos, sin, spans = cache.latent_rows(layer.group)
    keys = scores = None
    if z.shape[0]:
        i = layer.layer_idx
        pre = lat.keys_pre(i, cache.latent_key_rows(layer.group))[: z.shape[0]]  # rows bucketed (row_bucket)
        hkv = lat.kv_heads
        q_all = query.reshape(bsz, hkv, hq // hkv * qn, d)  # row r = j * qn + t, as _with_h_stream
        if cache.config.native and lat.rope_halves and native_latent.applies(pre, q_all):
            starts, at = [0], 0
            for b in range(bsz):
                at = spans[b][1] if b in spans else at
                starts.append(at)
            scores = native_latent.scores(pre, lat.bk[i], cos, sin, starts, q_all, scaling)
        else:
            keys = lat.rope_keys(i, pre, cos, sin)
    for b in range(bsz):
        if layer.seqs[b] is None:
            continue
        a, e = spans.get(b, (0, 0))
        out[b] = latent_attention(
            layer, b, query[b], scaling, qn,
            None if keys is None else keys[:, a:e], None if scores is None else scores[:, :, a:e],
        )  # fmt: skip
    return out


def tiered_attention(layer: TieredLayer, seq: int, q: torch.Tensor, scaling: float, n_new: int) -> torch.Tensor:
    """One sequence's decode/extend attention: fused CPU fast path when it applies, else the reference."""
    store = layer.seqs[seq]
    cfg = layer.cache.config
    if cfg.fast_path and n_new == 1:
        from pask.kv import fastpath

        if fastpath.applies(q, store):
            return fastpath.decode_attention(q, store, scaling)
    return tiered_attention_reference(q, store, scaling, n_new, cfg.dequant_block)


def pask_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface function for ``attn_implementation="pask"`` (output ``[B, q, Hq, D]``)."""
    layer = active_layer(key)
    if layer is None or layer.cache.mode == "prefill":
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        if layer is not None and (col := stats.collector_of(layer.cache)) is not None and col.prefill:
            scale = scaling if scaling is not None else getattr(module, "scaling", query.shape[-1] ** -0.5)
            col.on_prefill(module, layer, query, key, value, scale)
        return out
    if getattr(module, "layer_idx", layer.layer_idx) != layer.layer_idx:
        raise UnsupportedModelError(
            f"pask attention of layer {module.layer_idx} received the cache of layer {layer.layer_idx}"
        )
    scale = scaling if scaling is not None else getattr(module, "scaling", query.shape[-1] ** -0.5)
    bsz, hq, qn, d = query.shape
    out = query.new_zeros(bsz, qn, hq, d)
    col = stats.collector_of(layer.cache)
    explicit = col is not None and col.request.step and qn == 1  # a policy asked for step statistics
    cfg = layer.cache.config
    if cfg.latent is not None:
        if explicit:
            raise UnsupportedModelError("a latent cache (BellowsKV) gives no per-step attention statistics")
        return latent_layer(layer, query, scale), None
    native = qn == 1 and cfg.fast_path and cfg.native and (not explicit or col.native_step)
    if native and native_attention.applies(query, layer):
        if not explicit:
            return native_attention.decode_layer(layer, query, scale), None
        out, probs = native_attention.decode_layer(layer, query, scale, weights=True)  # + the step attention
        for b, p in enumerate(probs):
            if p is not None:
                col.record_step(layer, b, p)
        return out, None
    for b in range(bsz):
        if layer.seqs[b] is None:
            continue
        if explicit:
            out[b] = col.decode(layer, b, query[b], scale)
        else:
            out[b] = tiered_attention(layer, b, query[b], scale, qn)
    return out, None


def pask_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """SDPA mask for a cache's first forward; ``None`` afterwards (tiers are exact)."""
    if isinstance(q_offset, int) and q_offset > 0:
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        **kwargs,
    )


def register() -> None:
    """Register ``"pask"`` in transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(NAME, pask_attention_forward)
    AttentionMaskInterface.register(NAME, pask_mask)


def check_model(model: torch.nn.Module) -> None:
    """Raise UnsupportedModelError unless every attention layer can be served by the pask attention."""
    name = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(f"{name} does not dispatch attention through transformers' AttentionInterface")
    spec = attention_spec(model.config)
    mods = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]
    if len(mods) != spec.num_layers:
        raise UnsupportedModelError(
            f"{name}: found {len(mods)} attention modules with a layer_idx for {spec.num_layers} layers"
        )
    for m in mods:
        missing = [a for a in ("num_key_value_groups", "scaling", "head_dim") if not hasattr(m, a)]
        if missing:
            raise UnsupportedModelError(f"attention class {type(m).__name__} has no {', '.join(missing)}: unsupported")
        if m.num_key_value_groups != spec.num_q_heads // spec.num_kv_heads or m.head_dim != spec.head_dim:
            raise UnsupportedModelError(f"attention class {type(m).__name__} does not match the config's head layout")


def enable_pask_attention(model: torch.nn.Module) -> str:
    """Check the model, register and select ``"pask"``; return the previous implementation."""
    register()
    check_model(model)
    prev = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    return prev


@contextmanager
def use_pask_attention(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Select the pask attention for the duration of the block, then restore the previous one."""
    prev = enable_pask_attention(model)
    try:
        yield model
    finally:
        model.set_attn_implementation(prev)


def native_agreement() -> float | None:
    """The native kernel against :func:`tiered_attention_reference` on random tiers (H, INT4, INT2,
    released): ``None`` if it agrees within bf16 rounding, else the largest error."""
    gen = torch.Generator().manual_seed(0)
    for hkv, grp, d, n, kinds in ((2, 7, 64, 200, 4), (1, 3, 128, 70, 3), (2, 7, 64, 150, 4)):
        cfg = attention_config(hkv, grp, d)
        cache = TieredCache(cfg, CacheConfig(num_groups=1, recent_window=2), 1)
        k = torch.randn(1, hkv, n, d, generator=gen).to(torch.bfloat16)
        v = torch.randn(1, hkv, n, d, generator=gen).to(torch.bfloat16)
        cache.update(k, v, 0)
        tier = torch.randint(0, kinds, (n - 2,), generator=gen)
        for a in (Action.L, Action.L2, Action.R):
            cache.apply(0, 0, torch.nonzero(tier == int(a)).flatten(), a)
        store = cache.layers[0].seqs[0]
        q = torch.randn(1, hkv * grp, 1, d, generator=gen).to(torch.bfloat16)
        want = tiered_attention_reference(q[0], store, d**-0.5).float()[0]
        got = native_attention.decode_layer(cache.layers[0], q, d**-0.5)[0, 0].float()
        err = float((got - want).abs().max())
        if not err <= 0.02 * max(1.0, float(want.abs().max())):
            return err
    return None


native_attention.set_reference_check(native_agreement)
