"""BellowsKV's shared latent tier: one vector per token per group of adjacent layers.

A *latent cache* (``CacheConfig.latent`` set to a :class:`LatentTier`) groups the model's layers
in blocks of ``n`` (the last one shorter when ``n`` does not divide the layer count) and gives the
``L`` action a different meaning there: instead of INT4 K/V in every layer of the block, the cache
keeps one latent vector per token for the whole block, the normed input of the block's *source*
layer (:func:`source`), stored at ``bits`` (16: the model dtype; 8 / 4 / 2: codes with a bf16
scale and zero per ``quant_group`` values). Each layer of the block reads its keys and values from
it through its own affine projection (the source's own ``k_proj`` / ``v_proj``, the others' fitted
by :mod:`pask.calibration.bellows`), RoPE applied after reconstruction at the token's position.

What the cache holds, per sequence and block (see :mod:`pask.kv.cache`):

* H tokens (the recent window, and whatever a policy keeps exact): every layer's exact K/V, and in
  the source layer's H tier the token's latent as well (parts ``z`` or ``zq`` / ``zs`` beside
  ``k`` / ``v``, held and counted from the token's forward on), so that moving the token to the
  latent tier later copies codes and quantises nothing again;
* L tokens: the latent only, in the source layer's L tier (the other layers of the block hold
  nothing for them);
* R tokens: nothing.

The latent of a forward's tokens is taken from a forward hook on the source layer's input norm
(:func:`capture`), installed once per model by :meth:`LatentTier.bind`.

The projections file (:class:`LatentProjections`, ``pask-bellows/1``) is written by ``pask
calibrate-bellows`` and tied to the model's fingerprint like a PASK table.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pask.errors import PaskError
from pask.kv.errors import KVCacheError, UnsupportedModelError
from pask.kv.quant import dequantize_codes, pack_pairs, pack_quads, quantize_codes, unpack_pairs, unpack_quads

FORMAT = "pask-bellows/1"
SCALE_DTYPE = torch.bfloat16  # scales and zeros of quantised latents (as the K/V tiers')
LATENTS = ("first", "middle", "pca")
LATENT_BITS = (16, 8, 4, 2)


def source(layers: range, latent: str = "first") -> int:
    """The layer whose normed input is the group's latent: its first (``"first"``) or its lower
    middle layer (``"middle"``: ``start + (len - 1) // 2``); for ``"pca"`` (the block's K/V on their
    principal directions) the first layer, which holds the block's latents."""
    if latent not in LATENTS:
        raise PaskError(f"--latent must be one of {', '.join(LATENTS)}, got {latent!r}")
    return layers.start + (len(layers) - 1) // 2 if latent == "middle" else layers.start


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's half rotation ``[-x2, x1]`` of the last dimension (the HF layout): ``x cos + rotate_half(x)
    sin`` rotates by each position's angle, ``x cos - rotate_half(x) sin`` back."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def groups(num_layers: int, n: int) -> list[range]:
    """The layer groups of size ``n`` (the last one shorter if ``n`` does not divide ``num_layers``)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= num_layers:
        raise PaskError(f"--n must be an integer in [1, {num_layers}] (the model's layers), got {n!r}")
    return [range(s, min(s + n, num_layers)) for s in range(0, num_layers, n)]


@dataclass(eq=False)
class LatentProjections:
    """A projections file: per layer ``[hidden + 1, 2 kv_dim]`` float32 (the bias in the last row)."""

    model_name: str
    fingerprint: str
    n: int
    ridge: float
    weights: dict[int, torch.Tensor]
    errors: list[dict]  # per layer: group, own (the source), fit / held-out relative errors of K and V
    meta: dict = field(default_factory=dict)
    latent: str = "first"
    path: str | None = None
    encoders: dict[int, torch.Tensor] = field(default_factory=dict)  # pca: block -> [n 2kv_dim + 1, dim]

    def __deepcopy__(self, memo) -> LatentProjections:
        """Shared, not copied: a file's projections are read-only (per-request policy copies would
        otherwise each hold the model's full set of projection weights)."""
        return self

    @property
    def hidden(self) -> int:
        """The latent's dimension (the model's hidden size, or the principal directions kept for ``"pca"``)."""
        return int(next(iter(self.weights.values())).shape[0]) - 1

    @property
    def kv_dim(self) -> int:
        return int(next(iter(self.weights.values())).shape[1]) // 2

    @property
    def key_dim(self) -> int | None:
        """A split ``"pca"`` latent's keys part: keys read its first ``key_dim`` values only, values
        the rest (``calibrate-bellows --key-dim``); None: every value feeds both."""
        kd = self.meta.get("key_dim")
        return None if kd is None else int(kd)

    def groups(self) -> list[range]:
        return groups(len(self.weights), self.n)

    def truncated(self, dim: int) -> LatentProjections:
        """A ``"pca"`` latent cut to its ``dim`` leading principal directions (the basis is stored
        leading direction first, so this is the ``dim``-dimensional PCA latent of the same fit; a
        split latent (:attr:`key_dim`) loses values' directions only)."""
        if self.latent != "pca":
            raise PaskError(f"only a pca latent can be cut to fewer dimensions, not a {self.latent!r} one")
        if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= self.hidden:
            raise PaskError(f"dim must be an integer in [1, {self.hidden}] (the file's latent size), got {dim!r}")
        if self.key_dim is not None and dim <= self.key_dim:
            raise PaskError(f"a split latent keeps its {self.key_dim} keys' dimensions: dim must be more, got {dim}")
        if dim == self.hidden:
            return self
        weights = {i: torch.cat([w[:dim], w[-1:]]) for i, w in self.weights.items()}
        encoders = {g: e[:, :dim].contiguous() for g, e in self.encoders.items()}
        meta = {**self.meta, "dim": dim, "truncated_from": self.hidden}
        return LatentProjections(self.model_name, self.fingerprint, self.n, self.ridge, weights, [], meta,
                                 self.latent, self.path, encoders)  # fmt: skip

    def save(self, path: Path | str) -> None:
        from safetensors.torch import save_file

        header = {
            "format": FORMAT,
            "model": self.model_name,
            "fingerprint": self.fingerprint,
            "n": str(self.n),
            "latent": self.latent,
            "ridge": repr(self.ridge),
            "errors": json.dumps(self.errors),
            "meta": json.dumps(self.meta),
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tensors = {f"weight.{i}": w.contiguous() for i, w in self.weights.items()}
        tensors |= {f"encoder.{g}": e.contiguous() for g, e in self.encoders.items()}
        save_file(tensors, str(path), metadata=header)


def load(path: Path | str, fingerprint: str | None = None) -> LatentProjections:
    """A projections file, checked against the loaded model's fingerprint (None: not checked)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise PaskError(f"BellowsKV projections file {path} does not exist (make one with `pask calibrate-bellows`)")
    try:
        with safe_open(str(path), "pt") as f:
            head = f.metadata() or {}
            names = list(f.keys())
            weights = {int(k.split(".")[1]): f.get_tensor(k) for k in names if k.startswith("weight.")}
            encoders = {int(k.split(".")[1]): f.get_tensor(k) for k in names if k.startswith("encoder.")}
    except (SafetensorError, OSError, ValueError) as e:
        raise PaskError(f"{path} is not a BellowsKV projections file: {e}") from None
    if head.get("format") != FORMAT:
        raise PaskError(f"{path} is not a BellowsKV projections file (format {head.get('format')!r})")
    proj = LatentProjections(head["model"], head["fingerprint"], int(head["n"]), float(head["ridge"]), weights,
                             json.loads(head["errors"]), json.loads(head.get("meta", "{}")),
                             head.get("latent", "first"), str(path), encoders)  # fmt: skip
    if proj.latent == "pca" and len(encoders) != len(proj.groups()):
        raise PaskError(f"{path}: a pca latent needs an encoder per block ({len(encoders)} of {len(proj.groups())})")
    check_fingerprint(proj, fingerprint)
    return proj


def check_fingerprint(proj: LatentProjections, fingerprint: str | None) -> None:
    """PaskError unless ``proj`` was fitted for the model of ``fingerprint`` (None: not checked)."""
    if fingerprint is not None and proj.fingerprint != fingerprint:
        raise PaskError(
            f"{proj.path or 'the projections'} were fitted for model {proj.model_name} ({proj.fingerprint}), "
            f"not this model ({fingerprint}): fit projections for it (`pask calibrate-bellows`)"
        )


def latent_bytes(hidden: int, bits: int, quant_group: int = 32, dtype_bytes: int = 2) -> int:
    """Bytes of one stored latent: ``hidden`` values at ``bits`` (16: the model dtype), plus a bf16
    scale and zero per ``quant_group`` values below 16 bits."""
    if bits not in LATENT_BITS:
        raise PaskError(f"latent bits must be one of {', '.join(map(str, LATENT_BITS))}, got {bits!r}")
    if bits == 16:
        return hidden * dtype_bytes
    return hidden * bits // 8 + (hidden // quant_group) * 4


@dataclass(frozen=True, eq=False)
class LatentSpec:
    """What a BellowsKV policy asks of the decode core: these projections, latents at ``bits``."""

    projections: LatentProjections
    bits: int = 4

    def __post_init__(self) -> None:
        latent_bytes(self.projections.hidden, self.bits)  # checks bits

    def ratio(self, quant_group: int = 32) -> float:
        """Bytes of a latent over its block's Full-KV bytes (BF16), for a full block of ``n`` layers."""
        p = self.projections
        return latent_bytes(p.hidden, self.bits, quant_group) / (p.n * 2 * p.kv_dim * 2)


# -- capture of the source layers' normed inputs ----------------------------------------------
_NORMED = threading.local()
_HOOKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {layer: hook handle}


def _decoder_layers(model) -> list:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no decoder layers (model.model.layers)")
    return list(layers)


def capture(model, layers: list[int]) -> None:
    """Record the output of the input norm of ``layers`` at every forward (idempotent per model)."""
    hooked = _HOOKED.setdefault(model, {})
    decoder = _decoder_layers(model)
    for i in layers:
        if i in hooked:
            continue
        norm = getattr(decoder[i], "input_layernorm", None)
        if norm is None:
            raise UnsupportedModelError(f"layer {i} of {type(model).__name__} has no input_layernorm")

        def hook(module, args, out, i=i) -> None:
            if not hasattr(_NORMED, "out"):
                _NORMED.out = {}
            _NORMED.out[i] = out

        hooked[i] = norm.register_forward_hook(hook)


def normed_input(layer: int, batch: int, tokens: int) -> torch.Tensor:
    """The normed input ``[batch, tokens, hidden]`` of ``layer`` in this thread's current forward."""
    out = getattr(_NORMED, "out", {}).get(layer)
    if out is None or out.shape[0] != batch or out.shape[1] != tokens:
        raise KVCacheError(
            f"the latent of layer {layer} was not captured in this forward: a latent cache needs its tier "
            "bound to the model (LatentTier.bind)"
        )
    return out


# -- the tier --------------------------------------------------------------------------------
@dataclass(eq=False)
class LatentTier:
    """A latent cache's layout and projections, bound to one model (see the module docstring)."""

    projections: LatentProjections
    bits: int
    groups: list[range]
    sources: list[int]
    hidden: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    quant_group: int
    wk: dict[int, torch.Tensor]  # layer -> [hidden, Hkv * D] (compute dtype)
    bk: dict[int, torch.Tensor]  # layer -> [Hkv * D]
    wv: dict[int, torch.Tensor]  # layer -> [Hkv, hidden, D]
    bv: dict[int, torch.Tensor]  # layer -> [Hkv, D]
    rotary: torch.nn.Module
    encoders: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # pca: block -> (W, b)
    key_dim: int | None = None  # a split latent: keys read z[:, :key_dim], values z[:, key_dim:]
    rope_halves: bool = True  # the model's RoPE table repeats one angle per half (what native_latent reads)

    @property
    def captures(self) -> bool:
        """The latent is a layer's normed input, captured at the forward (not ``"pca"``, encoded from K/V)."""
        return self.projections.latent != "pca"

    @classmethod
    def bind(
        cls, proj: LatentProjections, model, bits: int = 4, fingerprint: str | None = None, quant_group: int = 32
    ) -> LatentTier:
        """The tier for ``model`` (checked against the file: fingerprint, layers, shapes); hooks the capture."""
        check_fingerprint(proj, fingerprint)
        latent_bytes(proj.hidden, bits, quant_group)  # checks bits
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        layers = int(cfg.num_hidden_layers)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        want_dim = proj.hidden if proj.latent == "pca" else cfg.hidden_size
        if len(proj.weights) != layers or proj.hidden != want_dim or proj.kv_dim != kv_heads * head_dim:
            raise PaskError(
                f"{proj.path or 'the projections'} do not fit this model: {len(proj.weights)} layers, hidden "
                f"{proj.hidden}, kv {proj.kv_dim} (model: {layers}, {cfg.hidden_size}, {kv_heads * head_dim})"
            )
        if bits < 16 and (proj.hidden % kv_heads or (proj.hidden // kv_heads) % quant_group):
            raise UnsupportedModelError(
                f"a {bits}-bit latent needs hidden / kv_heads ({proj.hidden} / {kv_heads}) divisible by the "
                f"quantisation group {quant_group}"
            )
        dtype = next(model.parameters()).dtype
        grp = proj.groups()
        sources = [source(r, proj.latent) for r in grp]
        kv = kv_heads * head_dim
        kd = proj.key_dim
        ks, vs = (slice(0, -1), slice(0, -1)) if kd is None else (slice(0, kd), slice(kd, -1))
        wk, bk, wv, bv = {}, {}, {}, {}
        for i, w in proj.weights.items():
            w = w.to(dtype)
            wk[i], bk[i] = w[ks, :kv].contiguous(), w[-1, :kv].contiguous()
            wv[i] = w[vs, kv:].reshape(-1, kv_heads, head_dim).permute(1, 0, 2).contiguous()
            bv[i] = w[-1, kv:].reshape(kv_heads, head_dim).contiguous()
        inner = getattr(model, "model", model)
        rotary = getattr(inner, "rotary_emb", None)
        if rotary is None:
            raise UnsupportedModelError(f"{type(model).__name__} has no rotary_emb: the latent tier needs RoPE")
        encoders = {}
        if proj.latent == "pca":
            encoders = {g: (e[:-1].float().contiguous(), e[-1].float().contiguous()) for g, e in proj.encoders.items()}
        else:
            capture(model, sources)
        tier = cls(proj, bits, grp, sources, proj.hidden, kv_heads, head_dim, dtype, quant_group,
                   wk, bk, wv, bv, rotary, encoders, kd)  # fmt: skip
        cos, sin = tier.rope(torch.tensor([0, 1, 7, 100, 4099]))
        half = head_dim // 2
        tier.rope_halves = bool(torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:]))
        return tier

    def __deepcopy__(self, memo) -> LatentTier:
        """Shared, not copied: bound, read-only state (a copied cache keeps the same tier, so its
        rows can join the original's caches)."""
        return self

    # -- storage parts (the source layer's H and L tiers; see pask.kv.storage._Plain) -----------
    def part_shapes(self, heads: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The storage parts of one latent per slot, split over the tier's ``heads`` rows: name ->
        (per-row shape, dtype); :mod:`pask.kv.storage` lays them out."""
        per = self.hidden // heads
        if self.bits == 16:
            return {"z": ((per,), self.dtype)}
        return {"zq": ((per * self.bits // 8,), torch.uint8), "zs": ((per // self.quant_group, 2), SCALE_DTYPE)}

    def encode(self, z: torch.Tensor, heads: int) -> dict[str, torch.Tensor]:
        """Latents ``[n, hidden]`` -> the parts ``[heads, n, ...]`` (quantised below 16 bits)."""
        n = z.shape[0]
        rows = z.reshape(n, heads, self.hidden // heads).transpose(0, 1)  # [heads, n, per]
        if self.bits == 16:
            return {"z": rows.to(self.dtype)}
        codes, scale, zero = quantize_codes(rows, self.quant_group, 0, SCALE_DTYPE, self.bits)
        pack = {8: lambda c: c, 4: pack_pairs, 2: pack_quads}[self.bits]
        return {"zq": pack(codes), "zs": torch.stack([scale, zero], dim=-1)}

    def decode(self, parts: dict[str, torch.Tensor], dtype=torch.float32) -> torch.Tensor:
        """Parts ``[heads, m, ...]`` -> latents ``[m, hidden]``."""
        if self.bits == 16:
            rows = parts["z"].to(dtype)
        else:
            unpack = {8: lambda c: c, 4: unpack_pairs, 2: unpack_quads}[self.bits]
            sz = parts["zs"]
            rows = dequantize_codes(unpack(parts["zq"]), sz[..., 0], sz[..., 1], dtype)
        heads, m, per = rows.shape
        return rows.transpose(0, 1).reshape(m, heads * per)

    def bytes_per_token(self) -> int:
        return latent_bytes(self.hidden, self.bits, self.quant_group, torch.empty((), dtype=self.dtype).element_size())

    # -- reconstruction ---------------------------------------------------------------------------
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's RoPE ``cos, sin [m, D]`` (fp32) at ``positions``."""
        probe = torch.empty(0, dtype=torch.float32)
        cos, sin = self.rotary(probe, positions.long().view(1, -1))
        return cos[0].float(), sin[0].float()

    def encode_kv(
        self, group: int, kv: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor
    ) -> torch.Tensor:
        """A ``"pca"`` block's latents ``[m, dim]`` from its layers' exact ``(K post-RoPE, V)`` ``[Hkv, m,
        D]`` (block order) at ``positions``: keys rotated back to pre-RoPE, the block's K/V
        concatenated as the fit saw them, then the encoder (centre, scale, principal directions)."""
        cos, sin = self.rope(positions)
        parts = []
        for k, v in kv:
            k = k.float()
            pre = k * cos - rotate_half(k) * sin  # the inverse rotation
            parts += [pre.transpose(0, 1).flatten(1), v.float().transpose(0, 1).flatten(1)]  # [m, Hkv D] each
        w, b = self.encoders[group]
        return torch.cat(parts, dim=1) @ w + b

    def key_part(self, z: torch.Tensor) -> torch.Tensor:
        """The values of latents ``z [m, hidden]`` that keys are rebuilt from (all but a split latent's values part)."""
        return z if self.key_dim is None else z[:, : self.key_dim]

    def value_part(self, z: torch.Tensor) -> torch.Tensor:
        """The values of latents ``z [m, hidden]`` that values are rebuilt from (a split latent's second part)."""
        return z if self.key_dim is None else z[:, self.key_dim :]

    def keys_pre(self, layer: int, zk: torch.Tensor) -> torch.Tensor:
        """The key GEMM alone: ``layer``'s pre-RoPE keys without their bias ``[m, Hkv*D]`` (model dtype)
        from the :meth:`key_part` ``zk`` of latents (what :mod:`pask.kv.native_latent` scores in one pass)."""
        w = self.wk[layer]
        return torch.matmul(zk.to(w.dtype), w)

    def keys(self, layer: int, z: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Post-RoPE keys ``[Hkv, m, D]`` (fp32) of ``layer`` from latents ``z [m, hidden]`` with their
        RoPE ``cos, sin [m, D]`` (:meth:`rope`)."""
        return self.rope_keys(layer, self.keys_pre(layer, self.key_part(z)), cos, sin)

    def rope_keys(self, layer: int, pre: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """:meth:`keys` from the key GEMM's output ``pre`` (:meth:`keys_pre`): bias, then RoPE."""
        k = (pre + self.bk[layer]).float()
        k = k.view(-1, self.kv_heads, self.head_dim).transpose(0, 1)  # [Hkv, m, D] pre-RoPE
        return k * cos + rotate_half(k) * sin

    def values(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        """Values ``[Hkv, m, D]`` of ``layer`` from latents ``z [m, hidden]`` (what attention folds in
        through :meth:`project_values` instead)."""
        w = self.wv[layer]
        return (torch.matmul(self.value_part(z).to(w.dtype)[None], w) + self.bv[layer][:, None]).float()

    def project_values(self, layer: int, pz: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
        """``sum_t p_t v_t`` per row from ``pz = sum_t p_t z_t [Hkv, rows, hidden]`` (over the
        :meth:`value_part` of the latents) and ``mass = sum_t p_t [Hkv, rows]``: the values' projection
        applied once to the weighted latent, not per token."""
        w = self.wv[layer]
        return torch.matmul(pz.to(w.dtype), w).float() + mass[..., None] * self.bv[layer][:, None].float()


def compression(hidden: int, kv_heads: int, head_dim: int, n: int, bits: int = 16, quant_group: int = 32) -> float:
    """Full-KV bytes of ``n`` layers over one stored latent per token (BF16 model)."""
    return n * 2 * kv_heads * head_dim * 2 / latent_bytes(hidden, bits, quant_group)


def error_summary(proj: LatentProjections) -> dict:
    """Mean held-out (else fit) relative error of the fitted (non-source) layers' keys and values."""
    rows = [r for r in proj.errors if not r["own"]]
    if not rows:
        return {"k": 0.0, "v": 0.0}
    kk = "held_k" if "held_k" in rows[0] else "fit_k"
    vk = "held_v" if "held_v" in rows[0] else "fit_v"
    return {"k": sum(r[kk] for r in rows) / len(rows), "v": sum(r[vk] for r in rows) / len(rows)}


__all__ = [
    "FORMAT",
    "LATENTS",
    "LATENT_BITS",
    "LatentProjections",
    "LatentSpec",
    "LatentTier",
    "capture",
    "compression",
    "groups",
    "latent_bytes",
    "load",
    "normed_input",
    "source",
]
