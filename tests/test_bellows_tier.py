"""BellowsKV's latent tier (pask.kv.latent): exactness in fp32, quantisation bounds, bytes, refusals.

Exactness: a block's source layer reads its own keys and values back exactly from the latent,
``n = 1`` is Full KV, and the attention that folds values through the projection equals attention
over explicitly reconstructed K/V. Bytes: what the cache holds equals the arithmetic of the tier.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pask.calibration.bellows import _layers, own_projection
from pask.cpu.bf16_matmul import row_bucket
from pask.errors import PaskError
from pask.kv.actions import Action, ColdOp
from pask.kv.attention import OnlineSoftmax, latent_attention, use_pask_attention
from pask.kv.cache import TieredCache
from pask.kv.config import CacheConfig
from pask.kv.errors import KVCacheError
from pask.kv.latent import LatentProjections, LatentSpec, LatentTier, latent_bytes, source
from pask.policies import get_policy

PROMPT = [1, 415, 2343, 11, 7445, 30, 2000, 99, 5130, 314, 1234, 3, 88, 900, 17, 4000, 12, 61, 77, 3000, 21, 9]
WINDOW = 4


def _own(lm, n: int, latent: str = "first") -> LatentProjections:
    """Projections where every layer reads the latent through its own k/v_proj (exact for the sources)."""
    w = {i: own_projection(layer) for i, layer in enumerate(_layers(lm.model))}
    return LatentProjections(lm.name, lm.fingerprint, n, 0.0, w, [], {}, latent)


def _run(lm, config: CacheConfig, to_latent: bool, steps: int = 4):
    """Prefill PROMPT, move every prompt token outside the window to L (a latent cache), decode greedily."""
    model = lm.model
    cache = TieredCache(model.config, config, 1)
    logits = []
    with torch.inference_mode(), use_pask_attention(model):  # the shared model gets its attention back
        out = model(input_ids=torch.tensor([PROMPT]), cache=cache, use_cache=True)
        if to_latent:
            for g in range(len(cache.groups)):
                cache.apply(0, g, torch.arange(len(PROMPT) - config.recent_window), Action.L)
        tok = int(out.logits[0, -1].argmax())
        for _ in range(steps):
            pos = torch.tensor([[cache.seq_length(0)]])
            out = model(input_ids=torch.tensor([[tok]]), position_ids=pos, cache=cache, use_cache=True)
            logits.append(out.logits[0, -1])
            tok = int(out.logits[0, -1].argmax())
    return (torch.stack(logits) if logits else None), cache


def _latent_config(lm, n: int, bits: int = 16, latent: str = "first") -> CacheConfig:
    tier = LatentTier.bind(_own(lm, n, latent), lm.model, bits, lm.fingerprint)
    return CacheConfig(num_groups=len(tier.groups), latent=tier, recent_window=WINDOW)


def test_n1_latent_cache_equals_full_kv(smol):
    want, _ = _run(smol, CacheConfig(num_groups=1, recent_window=WINDOW), False)
    got, cache = _run(smol, _latent_config(smol, 1), True)
    assert cache.layers[3].seqs[0].l.n == len(PROMPT) - WINDOW  # every layer is a source: its latents held
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("latent", ["first", "middle"])
def test_a_source_layer_reconstructs_its_own_kv_exactly(smol, latent):
    _, full = _run(smol, CacheConfig(num_groups=1, recent_window=WINDOW), False, steps=0)
    _, cache = _run(smol, _latent_config(smol, 4, 16, latent), True, steps=0)
    lat = cache.config.latent
    m = len(PROMPT) - WINDOW
    for g, layers in enumerate(lat.groups):
        s = source(layers, latent)
        assert lat.sources[g] == s
        z, cos, sin = cache.latent_block(0, g)
        assert z.shape == (m, 576)
        pos = cache.index(0, g).positions(int(Action.L)).long()
        ref = full.layers[s].seqs[0].h
        k_want, v_want = ref.view("k")[:, pos], ref.view("v")[:, pos]
        torch.testing.assert_close(lat.keys(s, z, cos, sin), k_want, rtol=0, atol=1e-5 * float(k_want.abs().max()))
        torch.testing.assert_close(lat.values(s, z), v_want, rtol=0, atol=1e-5 * float(v_want.abs().max()))
        for other in layers:  # the other layers hold nothing of the latent tokens
            if other != s:
                assert cache.layers[other].seqs[0].h.n == WINDOW and cache.layers[other].seqs[0].l.n == 0


def test_folded_values_equal_attention_over_reconstructed_kv(smol):
    _, cache = _run(smol, _latent_config(smol, 2), True, steps=2)
    lat = cache.config.latent
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(9, 1, 64, generator=gen)
    for i in (0, 1, 17):
        layer = cache.layers[i]
        got = latent_attention(layer, 0, q, 0.125)
        z, cos, sin = cache.latent_block(0, layer.group)
        k = torch.cat([lat.keys(i, z, cos, sin), layer.seqs[0].h.view("k")], dim=1)
        v = torch.cat([lat.values(i, z), layer.seqs[0].h.view("v")], dim=1)
        qf = q.reshape(3, 3, 64)
        p = torch.softmax(qf @ k.transpose(1, 2) * 0.125, dim=-1)
        want = (p @ v).reshape(9, 1, 64).transpose(0, 1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(bits=st.sampled_from([8, 4, 2]), n=st.integers(1, 9), scale=st.floats(0.01, 100.0), seed=st.integers(0, 99))
def test_quantized_latents_dequantize_within_their_bound(bits, n, scale, seed):
    w = {0: torch.zeros(129, 128)}
    tier = LatentTier(LatentProjections("t", "fp", 1, 0.0, w, []), bits, [range(0, 1)], [0], 128, 2, 32,
                      torch.float32, 32, {}, {}, {}, {}, None)  # fmt: skip
    z = torch.randn(n, 128, generator=torch.Generator().manual_seed(seed)) * scale
    parts = tier.encode(z, 2)
    back = tier.decode(parts)
    step = parts["zs"][..., 0].float()  # [heads, n, groups]
    bound = (step / 2).transpose(0, 1).reshape(n, 4).repeat_interleave(32, dim=1)
    assert bool(((back - z).abs() <= bound * (1 + 1e-5) + 1e-6 * scale).all())
    per_token = sum(t[:, 0].numel() * t.element_size() for t in parts.values())
    assert per_token == latent_bytes(128, bits, 32)


def test_sixteen_bit_latents_are_kept_as_they_are():
    tier = LatentTier(LatentProjections("t", "fp", 1, 0.0, {0: torch.zeros(65, 64)}, []), 16, [range(0, 1)], [0],
                      64, 2, 16, torch.float32, 32, {}, {}, {}, {}, None)  # fmt: skip
    z = torch.randn(5, 64)
    assert torch.equal(tier.decode(tier.encode(z, 2)), z)


@pytest.mark.parametrize("bits", [16, 8, 4, 2])
def test_measured_bytes_equal_the_cost_model(smol, bits):
    cfg = _latent_config(smol, 4, bits)
    _, cache = _run(smol, cfg, True, steps=3)
    spec = cache.spec
    kv = 2 * spec.num_kv_heads * spec.head_dim * 4  # fp32 K + V per layer
    lat = latent_bytes(576, bits, 32, dtype_bytes=4)
    blocks = len(cfg.latent.groups)
    n_l = len(PROMPT) - WINDOW
    n_h = WINDOW + 3  # the window and the decoded tokens stay H (no step actions here)
    held, full = cache.budget_bytes()
    assert sum(held) == n_l * lat * blocks + n_h * (spec.num_layers * kv + blocks * lat)
    assert sum(full) == (n_l + n_h) * spec.num_layers * kv
    assert cache.held_bytes() == sum(held)  # the tier tensors' live bytes
    # releasing latent tokens frees their bytes in every block
    with torch.inference_mode():
        for g in range(blocks):
            cache.apply(0, g, torch.arange(5), Action.R)
    assert sum(cache.budget_bytes()[0]) == sum(held) - 5 * lat * blocks


def test_a_latent_cache_refuses_int2_and_the_cold_tier(smol):
    _, cache = _run(smol, _latent_config(smol, 4), False, steps=0)
    with pytest.raises(KVCacheError, match="no INT2 tier"):
        cache.apply(0, 0, [0, 1], Action.L2)
    with pytest.raises(KVCacheError, match="no cold tier"):
        cache.recall(0, 0, [0], ColdOp.DEMOTE)
    with pytest.raises(KVCacheError, match="num_groups must be 8"):
        CacheConfig(num_groups=4, latent=cache.config.latent)


def test_binding_checks_the_file_against_the_model(smol):
    proj = _own(smol, 4)
    with pytest.raises(PaskError, match="not this model"):
        LatentTier.bind(proj, smol.model, 4, "another-fingerprint")
    with pytest.raises(PaskError, match="latent bits must be one of"):
        LatentTier.bind(proj, smol.model, 3, smol.fingerprint)
    short = LatentProjections(smol.name, smol.fingerprint, 4, 0.0, {i: proj.weights[i] for i in range(10)}, [])
    with pytest.raises(PaskError, match="do not fit this model"):
        LatentTier.bind(short, smol.model, 4, smol.fingerprint)


def test_policies_check_their_options(smol, tmp_path):
    proj = _own(smol, 2)
    ratio = LatentSpec(proj, 4).ratio()
    assert ratio == pytest.approx(latent_bytes(576, 4) / (2 * 2 * 192 * 2))
    p = get_policy("bellows", projections=proj, bits=4, budget=round(ratio, 2))
    assert p.latent.bits == 4 and p.target_b == round(ratio, 2)
    with pytest.raises(PaskError, match="holds B = "):
        get_policy("bellows", projections=proj, bits=4, budget=0.6)
    with pytest.raises(PaskError, match="bits must be one of"):
        get_policy("bellows", projections=proj, bits=3)
    with pytest.raises(PaskError, match="does not exist"):
        get_policy("bellows", projections=str(tmp_path / "missing.safetensors"))
    with pytest.raises(PaskError, match="not below the latent's own ratio"):
        get_policy("bellows-evict", budget=0.9, projections=proj)
    path = tmp_path / "p.safetensors"
    proj.save(path)
    assert get_policy("bellows", projections=str(path)).projections.path == str(path)


def test_bellows_policies_run_through_the_decode_core(smol):
    from pask.runtime.engine import Request, generate

    proj = _own(smol, 2)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 5000, (48,), generator=gen).tolist() for _ in range(3)]
    reqs = [Request(prompt_ids=p, max_new_tokens=6) for p in prompts]
    full = generate(smol, reqs)
    quant = generate(smol, reqs, get_policy("bellows", projections=proj, bits=16))
    # n = 2 with every layer on its source's projection is not exact for the second layer, but
    # the tokens come from the same model: the first generated token (prefill, exact) agrees
    assert all(a.token_ids[0] == b.token_ids[0] for a, b in zip(full, quant, strict=True))
    ratio = 576 * 4 / (2 * 2 * 192 * 4)  # fp32: a 16-bit latent is kept in the model dtype
    b = quant[0].extra["budget"]
    assert ratio < b["b_prompt"] <= ratio + 8 / 48 + 1e-6  # at most the window's 8 prompt tokens exact
    evict = generate(smol, reqs, get_policy("bellows-evict", budget=0.3, projections=proj))
    assert evict[0].extra["budget"]["b_prompt"] < 0.8 * b["b_prompt"]


def test_the_hf_integration_refuses_latent_policies(smol):
    from pask.hf import kv_policy

    with pytest.raises(PaskError, match="BellowsKV latents"):
        kv_policy(smol.model, get_policy("bellows", projections=_own(smol, 2)))


def test_online_softmax_projected_block_equals_plain_values():
    gen = torch.Generator().manual_seed(3)
    s = torch.randn(2, 3, 7, generator=gen)
    z = torch.randn(7, 16, generator=gen)
    w = torch.randn(2, 16, 4, generator=gen)
    a, b, c = OnlineSoftmax(2, 3, 4), OnlineSoftmax(2, 3, 4), OnlineSoftmax(2, 3, 4)
    a.update(s, torch.matmul(z[None], w))
    b.update_projected(s, z, lambda pz, mass: torch.matmul(pz, w))
    torch.testing.assert_close(a.result(), b.result())
    # latents past the scores' count (a latent cache's bucketed rows) get zero weight
    padded = torch.cat([z, torch.randn(5, 16, generator=gen)])
    c.update_projected(s, padded, lambda pz, mass: torch.matmul(pz, w))
    torch.testing.assert_close(c.result(), b.result(), rtol=0, atol=0)


def test_the_latent_gemms_run_over_bucketed_rows(smol):
    """The block's key GEMM input and each row's value latents come with zero / spare rows up to
    row_bucket of their count, so that a decode step's GEMM shapes repeat (PyTorch's bf16 GEMM
    keeps memory per shape)."""
    cfg = _latent_config(smol, 2)
    _, cache = _run(smol, cfg, True, steps=3)
    g = 1
    z, _, _, _ = cache.latent_rows(g)
    m = z.shape[0]
    keys = cache.latent_key_rows(g)
    assert m > 0 and keys.shape[0] == row_bucket(m) > m
    assert torch.equal(keys[:m], z) and not keys[m:].any()
    padded = cache.latent_padded(0, g)
    assert padded.shape[0] == row_bucket(m) and torch.equal(padded[:m], z)


def test_policy_copies_share_the_projections(smol):
    import copy

    p = get_policy("bellows", projections=_own(smol, 2))
    q = copy.deepcopy(p)  # what the decode core does for every request
    assert q.projections is p.projections and q.latent.projections is p.projections


@pytest.mark.parametrize("native", [True, False])
def test_the_batched_layer_equals_each_row_alone(smol, native, monkeypatch):
    """latent_layer rebuilds every row's keys in one product (scored by the native kernel, or in
    PyTorch): the same as each row on its own (PyTorch)."""
    import copy

    from pask.kv import native_latent
    from pask.kv.attention import latent_layer

    calls = []
    kernel = native_latent.scores
    monkeypatch.setattr(native_latent, "scores", lambda *a: calls.append(1) or kernel(*a))
    if not native:
        monkeypatch.setenv("PASK_NATIVE", "0")
        monkeypatch.setattr(native_latent._PROBE, "state", None)
        monkeypatch.setattr(native_latent, "_LIB", None)

    cfg = _latent_config(smol, 2)
    _, one = _run(smol, cfg, True, steps=1)
    _, two = _run(smol, cfg, True, steps=3)  # a longer row
    batch = TieredCache(smol.model.config, one.config, 0)
    calls.clear()
    with torch.inference_mode():
        batch.adopt(copy.deepcopy(one), 0)
        batch.adopt(two, 0)
        q = torch.randn(2, 9, 1, 64, generator=torch.Generator().manual_seed(5))
        for i in (0, 3, 29):
            got = latent_layer(batch.layers[i], q, 0.125)
            for b in range(2):
                torch.testing.assert_close(got[b], latent_attention(batch.layers[i], b, q[b], 0.125))
    assert len(calls) == (3 if native else 0)


# -- the pca latent -------------------------------------------------------------------------------
def _pca(lm, n: int):
    from pask.calibration.bellows import fit_pca

    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(100, 5000, (60,), generator=gen).tolist() for _ in range(4)]
    return fit_pca(lm, prompts[:3], prompts[3:], n)


def test_pca_n1_latent_cache_equals_full_kv(smol):
    proj = _pca(smol, 1)
    assert proj.hidden == 384 and all(r["held_k"] < 1e-3 and r["held_v"] < 1e-3 for r in proj.errors)  # full rank
    want, _ = _run(smol, CacheConfig(num_groups=1, recent_window=WINDOW), False)
    tier = LatentTier.bind(proj, smol.model, 16, smol.fingerprint)
    assert not tier.captures
    got, _ = _run(smol, CacheConfig(num_groups=len(tier.groups), latent=tier, recent_window=WINDOW), True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_pca_encodes_the_exact_pre_rope_kv(smol):
    """The cache encodes a token from its layers' stored (post-RoPE) K/V: the same latent the
    encoder gives for the pre-RoPE K/V the model computed."""
    from pask.calibration.bellows import _Capture

    proj = _pca(smol, 4)
    tier = LatentTier.bind(proj, smol.model, 16, smol.fingerprint)
    _, cache = _run(smol, CacheConfig(num_groups=len(tier.groups), latent=tier, recent_window=WINDOW), True, 0)
    cap = _Capture(smol.model)
    try:
        with torch.inference_mode():
            smol.model(torch.tensor([PROMPT]), use_cache=False)
        m = len(PROMPT) - WINDOW
        for g, layers in enumerate(tier.groups):
            y = torch.cat([torch.cat(cap.kv[i], dim=1) for i in layers], dim=1)[:m].float()
            w, b = tier.encoders[g]
            z, _, _ = cache.latent_block(0, g)
            torch.testing.assert_close(z, y @ w + b, rtol=1e-4, atol=1e-4)
            assert cache.layers[layers.start].seqs[0].h.n == WINDOW  # no latent held beside the H slots
    finally:
        cap.close()


@pytest.mark.parametrize("bits", [16, 4])
def test_pca_measured_bytes_equal_the_cost_model(smol, bits):
    proj = _pca(smol, 2)
    tier = LatentTier.bind(proj, smol.model, bits, smol.fingerprint)
    _, cache = _run(smol, CacheConfig(num_groups=len(tier.groups), latent=tier, recent_window=WINDOW), True, 3)
    spec = cache.spec
    kv = 2 * spec.num_kv_heads * spec.head_dim * 4
    lat = latent_bytes(proj.hidden, bits, 32, dtype_bytes=4)
    n_l, n_h = len(PROMPT) - WINDOW, WINDOW + 3
    held, full = cache.budget_bytes()
    assert sum(held) == n_l * lat * len(tier.groups) + n_h * spec.num_layers * kv
    assert sum(full) == (n_l + n_h) * spec.num_layers * kv


def test_a_pca_file_needs_its_encoders(smol, tmp_path):
    from pask.kv.latent import load

    proj = _pca(smol, 4)
    path = tmp_path / "pca.safetensors"
    proj.save(path)
    back = load(path)
    assert back.latent == "pca" and sorted(back.encoders) == list(range(8))
    torch.testing.assert_close(back.encoders[3], proj.encoders[3])
    proj.encoders = {0: proj.encoders[0]}
    proj.save(path)
    with pytest.raises(PaskError, match="needs an encoder per block"):
        load(path)


def test_a_pca_latent_cut_to_fewer_dimensions(smol):
    proj = _pca(smol, 2)
    cut = proj.truncated(100)
    assert cut.hidden == 100 and cut.encoders[0].shape == (2 * 384 + 1, 100)
    torch.testing.assert_close(cut.weights[3][:100], proj.weights[3][:100])
    torch.testing.assert_close(cut.weights[3][-1], proj.weights[3][-1])  # the bias (the mean) stays
    p = get_policy("bellows", projections=proj, bits=4, dim=100)
    assert p.latent.ratio() == pytest.approx(latent_bytes(100, 4) / (2 * 2 * 192 * 2))
    tier = LatentTier.bind(p.projections, smol.model, 16, smol.fingerprint)
    assert tier.hidden == 100
    with pytest.raises(PaskError, match="only a pca latent"):
        _own(smol, 2).truncated(10)
    with pytest.raises(PaskError, match=r"dim must be an integer in \[1, 576\]"):
        proj.truncated(577)


# -- the split pca latent (keys' own directions, then the values') --------------------------------
def test_split_pca_n1_latent_cache_equals_full_kv(smol):
    from pask.calibration.bellows import fit_pca

    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(100, 5000, (60,), generator=gen).tolist() for _ in range(4)]
    proj = fit_pca(smol, prompts[:3], prompts[3:], 1, dim=384, key_dim=192)  # full rank: a rotation of K and V
    assert proj.key_dim == 192 and all(r["held_k"] < 1e-3 and r["held_v"] < 1e-3 for r in proj.errors)
    want, _ = _run(smol, CacheConfig(num_groups=1, recent_window=WINDOW), False)
    tier = LatentTier.bind(proj, smol.model, 16, smol.fingerprint)
    assert tier.wk[0].shape == (192, 192) and tier.wv[0].shape == (3, 192, 64)
    got, _ = _run(smol, CacheConfig(num_groups=len(tier.groups), latent=tier, recent_window=WINDOW), True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_split_latent_keys_and_values_read_their_own_parts(smol):
    from pask.calibration.bellows import fit_pca

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 5000, (40,), generator=gen).tolist() for _ in range(3)]
    proj = fit_pca(smol, prompts[:2], prompts[2:], 2, dim=200, key_dim=80)
    tier = LatentTier.bind(proj, smol.model, 16, smol.fingerprint)
    z = torch.randn(5, 200, generator=gen)
    other = z.clone()
    other[:, 80:] = torch.randn(5, 120, generator=gen)  # another values part
    cos, sin = tier.rope(torch.arange(5))
    torch.testing.assert_close(tier.keys(3, other, cos, sin), tier.keys(3, z, cos, sin))
    assert not torch.allclose(tier.values(3, other), tier.values(3, z))
    other[:, :80] = torch.randn(5, 80, generator=gen)  # the values part of z, another keys part
    other[:, 80:] = z[:, 80:]
    torch.testing.assert_close(tier.values(3, other), tier.values(3, z))
    cut = proj.truncated(150)  # values lose directions, keys keep theirs
    assert cut.key_dim == 80 and cut.hidden == 150
    with pytest.raises(PaskError, match="keeps its 80 keys' dimensions"):
        proj.truncated(80)
    for bad in (0, 300, True, 200):  # 200 or more: no values part left
        with pytest.raises(PaskError, match="--key-dim must be an integer"):
            fit_pca(smol, prompts[:1], [], 2, dim=200, key_dim=bad)
