"""BellowsKV's shared latent and its per-layer projections (issue 32, first step: the fit).

BellowsKV stores one vector per token for each group of ``n`` adjacent layers, and each layer of
the group reads its keys and values from it through its own projection. Choices the abstract
leaves open, made here:

- **Groups**: layers ``[0, n)``, ``[n, 2n)``, ...; a last group may be shorter when ``n`` does not
  divide the layer count.
- **Latent**: the input hidden state of one layer of the group (its *source*) after that layer's
  input norm (RMSNorm, its weight included): the first layer (``latent="first"``, the default) or
  the lower middle one (``"middle"``: layer ``start + (len - 1) // 2``, nearer to the group's far
  ends). The source's own ``k_proj`` / ``v_proj`` (bias included) then reconstruct its keys and
  values exactly, and no extra norm is needed at read time. Any layer of the group may be the
  source: a token's latent is needed only once it has left the recent window, after its forward
  through the whole group.
- **Projections**: the source's are its own weights; every other layer's is an affine
  least-squares map latent -> [pre-RoPE keys, values], fitted in float64 on calibration-split
  activations with a ridge term ``ridge x mean(diag(X^T X))`` on the weights (not the bias).
  RoPE is applied after reconstruction, at the token's position, as the layer does itself.
- **Errors**: relative RMS error ``sqrt(SSE / sum of squares about the mean)`` per layer, for keys
  and values apart, on the fit tokens and on held-out (dev) tokens. The sums are accumulated per
  prompt (``X^T X``, ``X^T Y``, ``Y^T Y``), so no activation is kept.

The file is a safetensors file (``weight.<layer>``: ``[hidden + 1, 2 x kv_dim]`` float32, the
bias in the last row) with the metadata (format, model fingerprint, ``n``, ridge, errors) in its
header, tied to the model's fingerprint like a PASK table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pask.errors import PaskError
from pask.kv.latent import (  # noqa: F401  (the file format lives with the tier; re-exported here)
    FORMAT,
    LATENTS,
    LatentProjections,
    groups,
    latent_bytes,
    load,
    source,
)


def _layers(model) -> list:
    inner = getattr(model, "model", model)
    return list(inner.layers)


def _kv_dim(model) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return int((getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim)


def own_projection(layer) -> torch.Tensor:
    """A layer's own affine map from its normed input to [keys, values]: ``[hidden + 1, 2 kv_dim]``."""
    att = layer.self_attn
    if not isinstance(att.k_proj, torch.nn.Linear) or not isinstance(att.v_proj, torch.nn.Linear):
        raise PaskError("BellowsKV's projections are fitted on bf16 weights: load the model with --weights bf16")
    with torch.no_grad():
        w = torch.cat([att.k_proj.weight, att.v_proj.weight], dim=0).T.float()
        kb = att.k_proj.bias if att.k_proj.bias is not None else torch.zeros(att.k_proj.out_features)
        vb = att.v_proj.bias if att.v_proj.bias is not None else torch.zeros(att.v_proj.out_features)
        bias = torch.cat([kb, vb]).float().to(w.device)
        return torch.cat([w, bias[None]], dim=0).detach()


class _Capture:
    """Forward hooks: each layer's normed input and its k_proj / v_proj outputs for one forward."""

    def __init__(self, model) -> None:
        self.normed: dict[int, torch.Tensor] = {}
        self.kv: dict[int, list[torch.Tensor]] = {}
        self.handles = []
        for i, layer in enumerate(_layers(model)):
            self.handles.append(layer.input_layernorm.register_forward_hook(self._norm(i)))
            self.handles.append(layer.self_attn.k_proj.register_forward_hook(self._proj(i, 0)))
            self.handles.append(layer.self_attn.v_proj.register_forward_hook(self._proj(i, 1)))

    def _norm(self, i: int) -> Callable:
        def hook(module, args, out) -> None:
            self.normed[i] = out.detach()[0].double()

        return hook

    def _proj(self, i: int, slot: int) -> Callable:
        def hook(module, args, out) -> None:
            self.kv.setdefault(i, [None, None])[slot] = out.detach()[0].double()

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@dataclass
class Moments:
    """Accumulated ``X^T X`` per group, ``X^T Y``, ``Y^T Y`` (diagonal: K and V apart), sum and count per layer."""

    xtx: dict[int, torch.Tensor] = field(default_factory=dict)  # group -> [d+1, d+1]
    xty: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [d+1, 2kv]
    yty: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [2kv] (column sums of squares)
    ysum: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [2kv]
    tokens: int = 0

    def add(self, group_of: list[range], cap: _Capture, latent: str = "first") -> None:
        n_tok = None
        for g, layers in enumerate(group_of):
            x = cap.normed[source(layers, latent)]
            n_tok = x.shape[0]
            x = torch.cat([x, torch.ones(n_tok, 1, dtype=x.dtype)], dim=1)
            self.xtx[g] = self.xtx.get(g, 0) + x.T @ x
            for layer in layers:
                y = torch.cat(cap.kv[layer], dim=1)
                self.xty[layer] = self.xty.get(layer, 0) + x.T @ y
                self.yty[layer] = self.yty.get(layer, 0) + (y * y).sum(0)
                self.ysum[layer] = self.ysum.get(layer, 0) + y.sum(0)
        self.tokens += n_tok or 0


def _accumulate(model, prompts: Sequence[Sequence[int]], n: int, add: Callable, progress: Callable | None) -> None:
    """Run each prompt alone through the model with the capture hooks on; ``add(groups, capture)`` after each."""
    group_of = groups(len(_layers(model)), n)
    cap = _Capture(model)
    try:
        with torch.inference_mode():
            for ids in prompts:
                model(torch.tensor([list(ids)]), use_cache=False)
                add(group_of, cap)
                cap.normed.clear()
                cap.kv.clear()
                if progress:
                    progress(1)
    finally:
        cap.close()


def collect(
    model,
    prompts: Sequence[Sequence[int]],
    n: int,
    progress: Callable[[int], None] | None = None,
    latent: str = "first",
) -> Moments:
    """The moments of the latents and K/V of ``prompts`` (each run alone through the model)."""
    mom = Moments()
    _accumulate(model, prompts, n, lambda group_of, cap: mom.add(group_of, cap, latent), progress)
    return mom


def rel_errors(w: torch.Tensor, mom: Moments, layer: int, group: int, kv_dim: int) -> tuple[float, float]:
    """Relative RMS error of ``X w`` against the layer's [K, V] from the moments: (keys, values)."""
    xtx, xty, yty, ysum = mom.xtx[group], mom.xty[layer], mom.yty[layer], mom.ysum[layer]
    w = w.double()
    sse = yty - 2 * (w * xty).sum(0) + (w * (xtx @ w)).sum(0)  # per column
    ss = yty - ysum * ysum / max(mom.tokens, 1)
    out = []
    for cols in (slice(0, kv_dim), slice(kv_dim, 2 * kv_dim)):
        num, den = float(sse[cols].sum().clamp_min(0)), float(ss[cols].sum())
        out.append(math.sqrt(num / den) if den > 0 else 0.0)
    return out[0], out[1]


def fit(
    lm,
    fit_prompts: Sequence[Sequence[int]],
    held_prompts: Sequence[Sequence[int]],
    n: int,
    ridge: float | Sequence[float] = 1e-4,
    progress: Callable[[int], None] | None = None,
    latent: str = "first",
) -> LatentProjections:
    """Fit every layer's projection from its group's latent (module docstring); errors on both sets.

    Several ``ridge`` values: the moments are collected once and the value with the lowest mean
    held-out error (keys and values, fitted layers) is kept; every candidate's mean is recorded in
    ``meta["ridge_search"]``. Choosing needs held-out prompts.
    """
    ridges = [ridge] if isinstance(ridge, int | float) else list(ridge)
    if not ridges or any(not math.isfinite(r) or r < 0 for r in ridges):
        raise PaskError(f"--ridge must be finite numbers >= 0, got {ridge}")
    if len(ridges) > 1 and not held_prompts:
        raise PaskError("choosing among several --ridge values needs held-out prompts (--held-cases > 0)")
    if not fit_prompts:
        raise PaskError("no prompts to fit on")
    model = lm.model
    group_of = groups(len(_layers(model)), n)
    source(group_of[0], latent)  # the choice is checked before any forward
    fit_m = collect(model, fit_prompts, n, progress, latent)
    held_m = collect(model, held_prompts, n, progress, latent) if held_prompts else None
    best, search = None, []
    for r in ridges:
        weights, errors = _solve(model, fit_m, held_m, group_of, r, latent)
        fitted = [e for e in errors if not e["own"]]
        score = sum(e["held_k"] + e["held_v"] for e in fitted) / (2 * len(fitted)) if held_m and fitted else 0.0
        search.append({"ridge": r, "mean_held_error": round(score, 5)})
        if best is None or score < best[0]:
            best = (score, r, weights, errors)
    _, r, weights, errors = best
    meta = {"fit_tokens": fit_m.tokens, "held_tokens": held_m.tokens if held_m else 0,
            "fit_prompts": len(fit_prompts), "held_prompts": len(held_prompts)}  # fmt: skip
    if len(ridges) > 1:
        meta["ridge_search"] = search
    return LatentProjections(lm.name, lm.fingerprint, n, r, weights, errors, meta, latent)


def _solve(model, fit_m: Moments, held_m: Moments | None, group_of: list[range], ridge: float, latent: str):
    """Per-layer projections at one ridge value, and their error rows."""
    layers = _layers(model)
    kv = _kv_dim(model)
    weights: dict[int, torch.Tensor] = {}
    errors = []
    for g, members in enumerate(group_of):
        xtx = fit_m.xtx[g]
        reg = torch.zeros_like(xtx)
        d = xtx.shape[0] - 1
        reg[:d, :d] = torch.eye(d, dtype=xtx.dtype) * ridge * float(xtx.diagonal()[:d].mean())
        for layer in members:
            own = layer == source(members, latent)
            w = own_projection(layers[layer]).double() if own else torch.linalg.solve(xtx + reg, fit_m.xty[layer])
            weights[layer] = w.float()
            row = {"layer": layer, "group": g, "own": own}
            row["fit_k"], row["fit_v"] = (round(x, 5) for x in rel_errors(w, fit_m, layer, g, kv))
            if held_m is not None:
                row["held_k"], row["held_v"] = (round(x, 5) for x in rel_errors(w, held_m, layer, g, kv))
            errors.append(row)
    return weights, errors


@dataclass
class KVMoments:
    """Per block: the sum and the sum of outer products of the block's concatenated pre-RoPE K/V rows."""

    ysum: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> [p]
    yyt: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> [p, p]
    tokens: int = 0

    def add(self, group_of: list[range], cap: _Capture) -> None:
        for g, layers in enumerate(group_of):
            y = torch.cat([torch.cat(cap.kv[layer], dim=1) for layer in layers], dim=1)
            self.ysum[g] = self.ysum.get(g, 0) + y.sum(0)
            self.yyt[g] = self.yyt.get(g, 0) + y.T @ y
        self.tokens += y.shape[0]


def collect_kv(model, prompts: Sequence[Sequence[int]], n: int, progress: Callable[[int], None] | None = None):
    """The :class:`KVMoments` of ``prompts`` (each run alone through the model)."""
    mom = KVMoments()
    _accumulate(model, prompts, n, mom.add, progress)
    return mom


def _pca_errors(mom: KVMoments, g: int, mu, scale, basis, kv: int, layers: range) -> list[tuple[float, float]]:
    """Relative RMS error (keys, values) of each layer of block ``g`` on ``mom``'s tokens when its K/V go
    through the latent: centred at the fit's ``mu``, scaled, projected on ``basis`` and back."""
    n_tok = max(mom.tokens, 1)
    mean = mom.ysum[g] / n_tok
    about_mu = (mom.yyt[g] - torch.outer(mom.ysum[g], mu) - torch.outer(mu, mom.ysum[g])) / n_tok + torch.outer(mu, mu)
    cn = about_mu / torch.outer(scale, scale)
    resid = torch.eye(cn.shape[0], dtype=cn.dtype) - basis @ basis.T
    sse = (resid @ cn @ resid.T).diagonal() * scale * scale * n_tok
    ss = (mom.yyt[g].diagonal() - n_tok * mean * mean).clamp_min(0)
    out = []
    for j in range(len(layers)):
        row = []
        for part in range(2):
            cols = slice((2 * j + part) * kv, (2 * j + part + 1) * kv)
            den = float(ss[cols].sum())
            row.append(math.sqrt(float(sse[cols].sum().clamp_min(0)) / den) if den > 0 else 0.0)
        out.append((row[0], row[1]))
    return out


def fit_pca(
    lm,
    fit_prompts: Sequence[Sequence[int]],
    held_prompts: Sequence[Sequence[int]],
    n: int,
    dim: int | None = None,
    progress: Callable[[int], None] | None = None,
    key_dim: int | None = None,
) -> LatentProjections:
    """The ``"pca"`` latent: each block's concatenated pre-RoPE K/V (every layer's K and V scaled to
    unit RMS about the mean) on its ``dim`` leading principal directions of the calibration
    prompts (default: the model's hidden size, so a latent takes the bytes of a hidden-state one).

    ``key_dim`` splits the latent: its first ``key_dim`` values are the block's keys on the keys'
    own leading directions, the other ``dim - key_dim`` the values on theirs (keys read only the
    first part, values only the second), so that rebuilding keys at decode costs ``key_dim``, not
    ``dim``, multiply-adds per key value (:attr:`~pask.kv.latent.LatentProjections.key_dim`).

    Encoder per block ``z = ((y - mu) / s) P``; each layer's projection back ``y_l = mu_l + s_l (P_l
    z)``, in the file's affine ``[dim + 1, 2 kv_dim]`` form. Errors on both prompt sets as for the
    other latents. A latent is a linear function of the block's normed inputs (each layer's K/V is),
    the one with the least reconstruction error for its size."""
    if not fit_prompts:
        raise PaskError("no prompts to fit on")
    model = lm.model
    group_of = groups(len(_layers(model)), n)
    kv = _kv_dim(model)
    hidden = int(model.config.hidden_size)
    dim = hidden if dim is None else dim
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise PaskError(f"--dim must be a positive integer, got {dim!r}")
    part = min(len(r) for r in group_of) * kv  # the keys (and the values) of the smallest block
    bad_key_dim = isinstance(key_dim, bool) or not isinstance(key_dim, int)
    if key_dim is not None and (bad_key_dim or not (1 <= key_dim <= part and 1 <= dim - key_dim <= part)):
        raise PaskError(
            f"--key-dim must be an integer in [1, {part}] leaving between 1 and {part} of the --dim {dim} "
            f"dimensions to the values, got {key_dim!r}"
        )
    fit_m = collect_kv(model, fit_prompts, n, progress)
    held_m = collect_kv(model, held_prompts, n, progress) if held_prompts else None
    weights: dict[int, torch.Tensor] = {}
    encoders: dict[int, torch.Tensor] = {}
    errors, explained = [], []
    for g, layers in enumerate(group_of):
        n_tok = fit_m.tokens
        mu = fit_m.ysum[g] / n_tok
        cov = fit_m.yyt[g] / n_tok - torch.outer(mu, mu)
        var = cov.diagonal().clamp_min(1e-12)
        scale = torch.cat([var[c * kv : (c + 1) * kv].mean().sqrt().expand(kv) for c in range(2 * len(layers))])
        cn = cov / torch.outer(scale, scale)
        d = min(dim, min(2 * kv * len(r) for r in group_of))  # one latent size for every block
        if key_dim is None:
            evals, evecs = torch.linalg.eigh(cn)
            basis = evecs[:, -d:].flip(1)  # [p, d], leading direction first
            explained.append(round(float(evals[-d:].sum() / evals.sum()), 5))
        else:  # keys on their own directions, then values on theirs
            basis, layers_at = torch.zeros(cn.shape[0], d, dtype=cn.dtype), range(len(layers))
            shares = []
            for side, (a, b) in enumerate(((0, key_dim), (key_dim, d))):
                idx = torch.cat([torch.arange((2 * j + side) * kv, (2 * j + side + 1) * kv) for j in layers_at])
                evals, evecs = torch.linalg.eigh(cn[idx][:, idx])
                basis[idx, a:b] = evecs[:, -(b - a) :].flip(1)
                shares.append(round(float(evals[-(b - a) :].sum() / evals.sum()), 5))
            explained.append(shares)
        enc_w = basis / scale[:, None]
        encoders[g] = torch.cat([enc_w, (-(mu / scale) @ basis)[None]], dim=0).float()
        for j, layer in enumerate(layers):
            cols = slice(2 * j * kv, 2 * (j + 1) * kv)
            w = (basis[cols] * scale[cols, None]).T  # [d, 2 kv]
            weights[layer] = torch.cat([w, mu[cols][None]], dim=0).float()
        fit_e = _pca_errors(fit_m, g, mu, scale, basis, kv, layers)
        held_e = _pca_errors(held_m, g, mu, scale, basis, kv, layers) if held_m else None
        for j, layer in enumerate(layers):
            row = {"layer": layer, "group": g, "own": False,
                   "fit_k": round(fit_e[j][0], 5), "fit_v": round(fit_e[j][1], 5)}  # fmt: skip
            if held_e:
                row["held_k"], row["held_v"] = round(held_e[j][0], 5), round(held_e[j][1], 5)
            errors.append(row)
    meta = {"fit_tokens": fit_m.tokens, "held_tokens": held_m.tokens if held_m else 0,
            "fit_prompts": len(fit_prompts), "held_prompts": len(held_prompts), "dim": d,
            "explained_variance": explained}  # fmt: skip
    if key_dim is not None:
        meta["key_dim"] = key_dim
    return LatentProjections(lm.name, lm.fingerprint, n, 0.0, weights, errors, meta, "pca", None, encoders)


def compression(model_config, n: int, latent_bits: int = 16, quant_group: int = 32, dim: int | None = None) -> float:
    """Full-KV bytes of a group's ``n`` layers over one BF16 / packed latent per token (scales included:
    a bf16 scale and zero per ``quant_group`` values below 16 bits; ``dim``: the latent's size, the
    hidden size by default)."""
    cfg = model_config
    hidden = cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return n * 2 * kv_heads * head_dim * 2 / latent_bytes(dim or hidden, latent_bits, quant_group)


def markdown(proj: LatentProjections, model_config=None) -> str:
    """The per-layer reconstruction-error table of a projections file."""
    if proj.latent == "pca" and proj.key_dim is not None:
        kd = proj.key_dim
        shares = ", ".join(f"{k:.4f} / {v:.4f}" for k, v in proj.meta.get("explained_variance", []))
        what = (f"split: each group's pre-RoPE keys (every layer's at unit RMS) on their {kd} leading principal "
                f"directions, then its values on their {proj.hidden - kd} (explained variance of keys / values "
                f"per group: {shares})")  # fmt: skip
    elif proj.latent == "pca":
        what = (f"each group's pre-RoPE K/V (every layer's K and V at unit RMS) on its {proj.hidden} leading "
                f"principal directions (explained variance per group: "
                f"{', '.join(f'{x:.4f}' for x in proj.meta.get('explained_variance', []))})")  # fmt: skip
    else:
        what = (f"each group's {'first' if proj.latent == 'first' else 'lower-middle'}-layer input after its "
                f"input norm; ridge {proj.ridge:g}")  # fmt: skip
    lines = [
        f"# BellowsKV latent projections: {proj.model_name}, n = {proj.n}",
        "",
        f"Latent: {what}; fitted on "
        f"{proj.meta.get('fit_prompts')} prompts ({proj.meta.get('fit_tokens')} tokens), held out "
        f"{proj.meta.get('held_prompts')} prompts ({proj.meta.get('held_tokens')} tokens).",
    ]
    if search := proj.meta.get("ridge_search"):
        parts = ", ".join(f"{r['ridge']:g}: {r['mean_held_error']:.4f}" for r in search)
        lines += ["", f"Ridge chosen by the mean held-out error of the fitted layers ({parts})."]
    if model_config is not None:
        dim = proj.hidden if proj.latent == "pca" else None
        parts = ", ".join(f"{b}-bit {compression(model_config, proj.n, b, dim=dim):.2f}x" for b in (16, 8, 4, 2))
        lines += ["", f"Compression over Full KV per token for a full group of {proj.n} layers: {parts}."]
    lines += [
        "",
        "Relative RMS error of the reconstructed pre-RoPE keys / values (about their mean):",
        "",
        "| layer | group | fit K | fit V | held-out K | held-out V |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in proj.errors:
        mark = " (own)" if r["own"] else ""
        lines.append(f"| {r['layer']}{mark} | {r['group']} | {r['fit_k']:.4f} | {r['fit_v']:.4f} | "
                     f"{r.get('held_k', float('nan')):.4f} | {r.get('held_v', float('nan')):.4f} |")  # fmt: skip
    return "\n".join(lines) + "\n"
