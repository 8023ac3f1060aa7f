"""The native decode attention kernel: agreement with the reference path, edge cases, fallbacks."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pask.cpu import native as native_build
from pask.kv import Action, CacheConfig, TieredCache
from pask.kv import native_attention as na
from pask.kv.attention import tiered_attention_reference
from pask.kv.cache import attention_config


def _layer(hkv, grp, d, lengths, mixes, seed=0, key_scale=1.0, window=4, bits=4, l2_key_bits=2):
    """A one-layer bf16 cache with one row per length, tiers drawn from each row's mix: (H, low, R)
    with the low share at ``bits`` (4: INT4, 2: INT2), or (H, INT4, INT2, R); ``l2_key_bits=4``: the
    INT2 tier is K4V2."""
    gen = torch.Generator().manual_seed(seed)
    n = max(lengths)
    cfg = CacheConfig(num_groups=1, recent_window=window, l2_key_bits=l2_key_bits)
    cache = TieredCache(attention_config(hkv, grp, d), cfg, len(lengths))
    cache.begin_prefill([n - x for x in lengths])
    k = (torch.randn(len(lengths), hkv, n, d, generator=gen) * key_scale).to(torch.bfloat16)
    v = torch.randn(len(lengths), hkv, n, d, generator=gen).to(torch.bfloat16)
    cache.update(k, v, 0)
    for row, (length, mix) in enumerate(zip(lengths, mixes, strict=True)):
        shares = (mix[0], mix[1], 0.0) if len(mix) == 3 and bits == 4 else (mix[0], 0.0, mix[1])
        if len(mix) == 4:
            shares = mix[:3]
        edges = torch.tensor(shares).cumsum(0)
        u = torch.rand(max(0, length - window), generator=gen)
        tier = torch.bucketize(u, edges, right=True)  # 0 H, 1 INT4, 2 INT2, 3 R
        for i, a in ((1, Action.L), (2, Action.L2), (3, Action.R)):
            cache.apply(row, 0, torch.nonzero(tier == i).flatten(), a)
    return cache, cache.layers[0]


def _reference(layer, q, scaling):
    rows = []
    for b, store in enumerate(layer.seqs):
        if store is None:
            rows.append(torch.zeros(q.shape[1], q.shape[-1]))
        else:
            rows.append(tiered_attention_reference(q[b], store, scaling).float()[0])
    return torch.stack(rows)


@pytest.fixture(scope="module")
def native():
    """The kernel on its exact path: the AVX2 build's integer INT4 path (its default) is not
    FP32-level, so it is bounded apart (tests/test_int8_attention.py)."""
    if na.status() != "ok":
        pytest.skip(f"native attention kernel: {na.status()}")
    with na.int8_path(False):
        yield na


def test_kernel_builds_where_a_compiler_exists():
    if shutil.which("g++") is None:
        pytest.skip("no g++ here")
    assert na.available(), na.status()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=st.sampled_from([(2, 7, 64), (3, 3, 64), (2, 6, 128), (1, 16, 64), (1, 1, 64)]),
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=3),
    mix=st.sampled_from([(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.34, 0.33, 0.33), (0.0, 0.5, 0.5), (0.0, 0.0, 1.0)]),
    seed=st.integers(0, 2**16),
    bits=st.sampled_from([4, 2, 3]),
    k4v2=st.booleans(),
)
def test_matches_reference_on_random_tiers(native, shape, lengths, mix, seed, bits, k4v2):
    """INT4 and INT2 tiers (the INT2 tier token-major, scored one token at a time; ``k4v2``: its keys
    at INT4), alone and (``bits=3``: the low share split between them) all three streams in one softmax."""
    if bits == 3:
        mix = (mix[0], mix[1] / 2, mix[1] / 2, mix[2])
    hkv, grp, d = shape
    kb = 4 if k4v2 else 2
    _, layer = _layer(hkv, grp, d, lengths, [mix] * len(lengths), seed=seed, bits=bits, l2_key_bits=kb)
    q = torch.randn(len(lengths), hkv * grp, 1, d, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    assert na.applies(q, layer)
    got = na.decode_layer(layer, q, d**-0.5)
    assert got.shape == (len(lengths), 1, hkv * grp, d) and got.dtype == torch.bfloat16
    want = _reference(layer, q, d**-0.5)
    assert (got[:, 0].float() - want).abs().max() <= 0.01 * max(1.0, float(want.abs().max()))


def test_large_scores_stay_finite_and_exact(native):
    """Scores in the hundreds: the online softmax must rescale, not overflow."""
    _, layer = _layer(2, 7, 64, [700, 129], [(0.3, 0.6, 0.1), (0.0, 1.0, 0.0)], key_scale=40.0)
    q = (torch.randn(2, 14, 1, 64) * 3).to(torch.bfloat16)
    got = na.decode_layer(layer, q, 0.125)[:, 0].float()
    want = _reference(layer, q, 0.125)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= 0.02 * max(1.0, float(want.abs().max()))


def test_int2_large_scores_and_a_long_tier(native):
    _, layer = _layer(2, 7, 64, [700, 65], [(0.2, 0.7, 0.1), (0.0, 1.0, 0.0)], key_scale=30.0, bits=2)
    q = (torch.randn(2, 14, 1, 64) * 3).to(torch.bfloat16)
    got = na.decode_layer(layer, q, 0.125)[:, 0].float()
    want = _reference(layer, q, 0.125)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= 0.02 * max(1.0, float(want.abs().max()))


def test_dropped_row_gets_zeros_and_others_are_unaffected(native):
    cache, layer = _layer(2, 7, 64, [200, 150, 90], [(0.34, 0.33, 0.33)] * 3)
    q = torch.randn(3, 14, 1, 64).to(torch.bfloat16)
    before = na.decode_layer(layer, q, 0.125)
    cache.drop(1)
    after = na.decode_layer(layer, q, 0.125)
    assert torch.equal(after[1], torch.zeros_like(after[1]))
    assert torch.equal(after[0], before[0]) and torch.equal(after[2], before[2])


def test_model_decode_runs_the_kernel_and_agrees_with_reference(native, monkeypatch):
    from pask.policies import StaticMixPolicy
    from pask.runtime.models import load_model
    from pask.runtime.runner import decode_with_policy

    lm = load_model("smollm2-135m", dtype=torch.bfloat16)
    tok = lm.tokenizer
    rows = [tok("def add(a, b):\n    return a + b\n\n" * 3)["input_ids"], tok("SELECT name FROM t")["input_ids"]]
    gens = [torch.Generator().manual_seed(r) for r in (0, 1)]
    forced = [[int(x) for x in torch.randint(100, 1000, (8,), generator=g)] for g in gens]
    calls = {"n": 0}
    real = na.decode_layer

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(na, "decode_layer", counting)
    runs = []
    for cfg in (CacheConfig(recent_window=4), CacheConfig(recent_window=4, fast_path=False)):
        step = [0, 0]

        def nxt(row, logits, step=step):
            step[row] += 1
            return forced[row][step[row] - 1]

        res = decode_with_policy(lm.model, rows, StaticMixPolicy(0.34, 0.33, 0.33), 8, cfg, nxt, keep_logits=True)
        runs.append(torch.stack(res.logits).float())
        if not calls["n"]:
            pytest.fail("the decode never reached the native kernel")
        calls["n"] = -(10**9)  # the reference run must not call it
    assert calls["n"] == -(10**9)
    rel = (runs[0] - runs[1]).abs().max() / runs[1].abs().max()
    assert rel < 0.05, float(rel)


def test_applies_only_to_what_the_kernel_serves(native):
    _, layer = _layer(2, 7, 64, [50], [(0.5, 0.5, 0.0)])
    assert na.applies(torch.zeros(1, 14, 1, 64, dtype=torch.bfloat16), layer)
    assert not na.applies(torch.zeros(1, 14, 1, 64), layer)  # fp32 query
    assert not na.applies(torch.zeros(1, 14, 2, 64, dtype=torch.bfloat16), layer)  # an extend, not a decode
    _, wide = _layer(1, 17, 64, [50], [(1.0, 0.0, 0.0)])
    assert not na.applies(torch.zeros(1, 17, 1, 64, dtype=torch.bfloat16), wide)  # 17 query rows per kv head


def test_missing_compiler_is_an_error_unless_fallback_is_allowed(monkeypatch, tmp_path):
    monkeypatch.setattr(na._PROBE, "state", None)
    monkeypatch.setattr(na, "_LIB", None)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PASK_CACHE", str(tmp_path))
    monkeypatch.delenv("PASK_ALLOW_FALLBACK", raising=False)
    with pytest.raises(native_build.NativeKernelError, match=r"no C\+\+ compiler.*PASK_ALLOW_FALLBACK=1"):
        na.available()
    assert "no C++ compiler" in na.status()  # the state is reported without raising
    q = torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(native_build.NativeKernelError, match="PASK_NATIVE=0"):
        na.decode_layer(None, q, 1.0)
    monkeypatch.setenv("PASK_ALLOW_FALLBACK", "1")  # the opt-out: a warning (once), then the PyTorch path
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        assert not na.available()
    assert not na.available() and na.isa() is None
    with pytest.raises(RuntimeError, match="unavailable"):
        na.decode_layer(None, q, 1.0)


def test_missing_source_is_an_error(monkeypatch, tmp_path):
    """A broken install (the C++ source not shipped) is reported, not silently replaced by PyTorch."""
    if native_build.compiler() is None:
        pytest.skip("no compiler")
    monkeypatch.setattr(na._PROBE, "state", None)
    monkeypatch.setattr(na, "_LIB", None)
    monkeypatch.setattr(na, "SOURCE", tmp_path / "native_attention.cpp")
    monkeypatch.setenv("PASK_CACHE", str(tmp_path))
    monkeypatch.delenv("PASK_ALLOW_FALLBACK", raising=False)
    with pytest.raises(native_build.NativeKernelError, match=r"native_attention\.cpp.*reinstall pask"):
        na.available()


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setattr(na._PROBE, "state", None)
    monkeypatch.setattr(na, "_LIB", None)
    monkeypatch.setenv("PASK_NATIVE", "0")
    assert not na.available() and na.status() == "disabled by PASK_NATIVE=0"


def test_compile_error_is_reported(monkeypatch, tmp_path):
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(na, "SOURCE", bad)
    monkeypatch.setenv("PASK_CACHE", str(tmp_path))
    if native_build.compiler() is None:
        pytest.skip("no compiler")
    with pytest.raises(RuntimeError, match=r"compiling bad\.cpp failed"):
        na.library_path()


def _tiers(store) -> dict:
    out = {f"h.{k}": store.h.parts[k].live(store.h.t[k], store.h.n) for k in ("k", "v")} if store.h.n else {}
    for name, t in (("l", store.l), ("l2", store.l2)):
        if t.n:
            out.update({f"{name}.{k}": t.parts[k].live(t.t[k], t.n) for k in ("ksz", "vq", "vs", "vz")})
            out[f"{name}.kq"] = t.parts["kq"].read(t.t["kq"], torch.arange(t.n))
    return out


def _assert_same_tiers(a, b) -> None:
    """Every live tensor of two stores' tiers is bit-identical."""
    got, want = _tiers(a), _tiers(b)
    assert got.keys() == want.keys()
    for name in got:
        assert torch.equal(got[name], want[name]), name


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    d=st.sampled_from([64, 128]),
    scale=st.sampled_from([1e-3, 1.0, 50.0]),
    flat=st.booleans(),
    bits=st.sampled_from([4, 2, 24]),
)
def test_single_token_low_move_is_bit_exact_with_the_python_path(native, seed, d, scale, flat, bits):
    """Decode-step moves (one position at a time) through the native mover equal the PyTorch path (INT4,
    INT2 and ``bits=24``: K4V2, the INT2 tier with INT4 keys)."""
    bits, kb = (2, 4) if bits == 24 else (bits, 2)
    gen = torch.Generator().manual_seed(seed)
    n, window = 150, 4
    k = (torch.randn(1, 2, n, d, generator=gen) * scale).to(torch.bfloat16)
    v = (torch.randn(1, 2, n, d, generator=gen) * scale).to(torch.bfloat16)
    if flat:  # constant groups (zero range) and repeated values
        k[..., :32] = 0.5
        v[..., 32:64] = -2.0
    order = torch.randperm(n - window, generator=gen)[:90].tolist()
    low = Action.L if bits == 4 else Action.L2
    acts = [low if i % 3 else Action.R for i in range(len(order))]
    stores = []
    for use_native in (True, False):
        cfg = CacheConfig(num_groups=1, recent_window=window, native=use_native, l2_key_bits=kb)
        cache = TieredCache(attention_config(2, 3, d), cfg, 1)
        cache.update(k, v, 0)
        cache.apply(0, 0, torch.tensor(order[:10]), low)  # the prefill-time batch fixes the key balance
        for p, a in zip(order[10:], acts[10:], strict=True):
            cache.apply(0, 0, p, a)
        stores.append(cache.layers[0].seqs[0])
    assert na.move_applies([stores[0]], bits)  # the native mover served the first cache
    _assert_same_tiers(*stores)


def test_single_position_errors_match_the_batch_path():
    from pask.kv import AlreadyReleasedError, IrreversibleActionError, ProtectedTokenError, UnknownPositionError

    cache, _ = _layer(2, 7, 64, [40], [(1.0, 0.0, 0.0)])
    cache.apply(0, 0, 3, Action.L)
    cache.apply(0, 0, 5, Action.R)
    for pos, act, err in [
        (40, Action.L, UnknownPositionError),
        (-1, Action.R, UnknownPositionError),
        (38, Action.L, ProtectedTokenError),
        (5, Action.L, AlreadyReleasedError),
        (3, Action.H, IrreversibleActionError),
    ]:
        with pytest.raises(err):
            cache.apply(0, 0, pos, act)
        with pytest.raises(err):
            cache.apply(0, 0, torch.tensor([pos, 7]) if pos != 7 else torch.tensor([pos]), act)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=st.sampled_from([(2, 7, 64), (1, 3, 128), (2, 1, 64)]),
    lengths=st.lists(st.integers(1, 200), min_size=1, max_size=3),
    mix=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    seed=st.integers(0, 2**16),
    bits=st.sampled_from([4, 2, 3]),
)
def test_step_weights_match_the_explicit_softmax(native, shape, lengths, mix, seed, bits):
    """The kernel's step attention (softmax weights averaged per kv head, H slots then L slots)
    equals explicit_decode's FP32 softmax; the output is the plain kernel's."""
    from pask.kv.stats import explicit_decode

    hkv, grp, d = shape
    ph = mix[0]
    rest = (1 - ph) * mix[1]
    mixes = [(ph, rest, 0) if bits != 3 else (ph, rest / 2, rest / 2, 0)] * len(lengths)
    _, layer = _layer(hkv, grp, d, lengths, mixes, seed=seed, bits=bits)
    q = torch.randn(len(lengths), hkv * grp, 1, d, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    scaling = d**-0.5
    out, probs = native.decode_layer(layer, q, scaling, weights=True)
    assert torch.equal(out, native.decode_layer(layer, q, scaling))
    for b, store in enumerate(layer.seqs):
        pos_h, pos_l, pos_l2 = (layer.positions(b, a) for a in (Action.H, Action.L, Action.L2))
        _, ref, _, _ = explicit_decode(q[b], store, scaling, pos_h, pos_l, None, pos_l2)
        assert probs[b].shape == ref.shape == (hkv, store.h.n + store.l.n + store.l2.n)
        torch.testing.assert_close(probs[b], ref, atol=2e-6, rtol=1e-4)
        torch.testing.assert_close(probs[b].sum(-1), torch.ones(hkv), atol=1e-5, rtol=0)


def test_step_weights_skip_dropped_rows(native):
    cache, layer = _layer(2, 7, 64, [50, 80], [(0.5, 0.3, 0.2)] * 2)
    cache.drop(0)
    q = torch.randn(2, 14, 1, 64).to(torch.bfloat16)
    _, probs = native.decode_layer(layer, q, 0.125, weights=True)
    assert probs[0] is None and probs[1].shape[0] == 2


def test_step_statistics_policy_decodes_through_the_kernel(native, monkeypatch):
    """A policy asking for step attention (H2O) takes the native kernel in bf16, not explicit_decode,
    and keeps its budget; its step statistics agree with the explicit path's."""
    from pask.kv import stats as kv_stats
    from pask.policies import get_policy
    from pask.runtime.models import load_model
    from pask.runtime.runner import decode_with_policy

    lm = load_model("smollm2-135m", dtype=torch.bfloat16)
    rows = [lm.tokenizer("def add(a, b):\n    return a + b\n\n" * 6)["input_ids"]]
    forced = [int(x) for x in torch.randint(100, 1000, (8,), generator=torch.Generator().manual_seed(0))]
    seen = {"native": [], "explicit": []}
    real_record = kv_stats.StatsCollector.record_step

    def recording(self, layer, seq, probs, positions=None):
        real_record(self, layer, seq, probs, positions)
        if layer.layer_idx == 0:
            seen[mode].append(self.step_attention[seq][0].clone())

    monkeypatch.setattr(kv_stats.StatsCollector, "record_step", recording)
    modes = (("native", CacheConfig(recent_window=4)), ("explicit", CacheConfig(recent_window=4, native=False)))
    for mode, cfg in modes:
        if mode == "native":
            monkeypatch.setattr(kv_stats, "explicit_decode", lambda *a, **k: pytest.fail("explicit path taken"))
        else:
            monkeypatch.undo()
            monkeypatch.setattr(kv_stats.StatsCollector, "record_step", recording)
        step = [0]

        def nxt(row, logits, step=step):
            step[0] += 1
            return forced[step[0] - 1]

        res = decode_with_policy(lm.model, rows, get_policy("h2o", budget=0.5), 8, cfg, nxt)
        assert abs(res.budget.b_total - 0.5) <= 0.05
    assert len(seen["native"]) == len(seen["explicit"]) == 7
    for a, b in zip(seen["native"], seen["explicit"], strict=True):
        torch.testing.assert_close(a, b, atol=0.02, rtol=0.05)  # bf16 forwards: same attention, summation order


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=st.sampled_from([(2, 7, 64), (3, 3, 64), (2, 6, 128), (1, 8, 64), (1, 1, 128), (1, 9, 64)]),
    lengths=st.lists(st.integers(1, 700), min_size=1, max_size=3),
    mix=st.sampled_from([(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.34, 0.33, 0.33), (0.05, 0.9, 0.05)]),
    seed=st.integers(0, 2**16),
    key_scale=st.sampled_from([1.0, 30.0]),
)
def test_amx_tiles_agree_with_the_vector_kernel(native, shape, lengths, mix, seed, key_scale):
    """The AMX paths (BF16 tier: exact products; INT4 tier: hi / lo bf16 operands) match the AVX-512
    paths to bf16 rounding, weights included."""
    if not na.use_amx(True):
        pytest.skip("no AMX tiles here")
    hkv, grp, d = shape
    _, layer = _layer(hkv, grp, d, lengths, [mix] * len(lengths), seed=seed, key_scale=key_scale)
    q = (torch.randn(len(lengths), hkv * grp, 1, d, generator=torch.Generator().manual_seed(seed)) * 2).to(
        torch.bfloat16
    )
    try:
        tiles, tile_probs = na.decode_layer(layer, q, d**-0.5, weights=True)
        assert na.use_amx(False) is False
        vector, vector_probs = na.decode_layer(layer, q, d**-0.5, weights=True)
    finally:
        na.use_amx(True)
    want = _reference(layer, q, d**-0.5)
    scale = max(1.0, float(want.abs().max()))
    err_tiles = float((tiles[:, 0].float() - want).abs().max())
    err_vector = float((vector[:, 0].float() - want).abs().max())
    assert err_tiles <= max(2 * err_vector, 2**-7 * scale)  # bf16 outputs: an ulp of the largest one
    assert float((tiles.float() - vector.float()).abs().max()) <= 2**-6 * scale
    assert (tiles != vector).float().mean() < 0.2  # mostly identical after bf16 rounding
    for a, b in zip(tile_probs, vector_probs, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-5)  # scores in the hundreds: ~1e-5 relative


def test_amx_switch_without_tiles_reports_off(native):
    """use_amx(True) reports what runs; off always succeeds."""
    on = na.use_amx(True)
    assert on == na.isa().endswith("+amx")
    assert na.use_amx(False) is False and na.isa() in ("avx512", "avx2", "portable")
    na.use_amx(True)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    d=st.sampled_from([64, 128]),
    scale=st.sampled_from([1e-3, 1.0, 50.0]),
    flat=st.booleans(),
    bits=st.sampled_from([4, 2, 24]),
    n=st.integers(20, 400),
    zeros=st.booleans(),
)
@example(seed=21, d=128, scale=1e-3, flat=False, bits=4, n=21, zeros=False)  # once drew single-position L batches only
@example(seed=3, d=64, scale=1.0, flat=False, bits=4, n=80, zeros=True)
@example(seed=4, d=64, scale=1.0, flat=True, bits=2, n=80, zeros=True)
def test_bulk_low_writes_are_bit_exact_with_the_python_path(native, seed, d, scale, flat, bits, n, zeros):
    """Many positions at once (prefill-time actions, several batches landing mid-block) through the
    native quantiser equal the PyTorch path, INT4, INT2 and K4V2 (``bits=24``); ``zeros``: groups
    whose range ends at +0 and -0 (the vector min / max may take the other zero: the same codes)."""
    bits, kb = (2, 4) if bits == 24 else (bits, 2)
    gen = torch.Generator().manual_seed(seed)
    window = 4
    k = (torch.randn(1, 2, n, d, generator=gen) * scale).to(torch.bfloat16)
    v = (torch.randn(1, 2, n, d, generator=gen) * scale).to(torch.bfloat16)
    if flat:
        k[..., :32] = 0.5
        v[..., 32:64] = -2.0
    if zeros:  # mixed signed zeros at a group's end: values >= 0 in one group, <= 0 in the next
        v[..., :16], v[..., 16:32] = v[..., :16].abs(), -0.0
        v[..., 32:48], v[..., 48:64] = -v[..., 32:48].abs(), 0.0
        v[:, :, ::2, 0], v[:, :, 1::2, 32] = -0.0, 0.0
        k[..., :32] = torch.where(k[..., :32] < 0, torch.zeros(()), k[..., :32]).to(k.dtype)
    order = torch.randperm(n - window, generator=gen).tolist()
    cut = sorted(torch.randint(2, len(order), (2,), generator=gen).tolist())  # batch 0: >= 2 positions
    batches = [order[: cut[0]], order[cut[0] : cut[1]], order[cut[1] :]]
    stores, served = [], []
    real = na.quantize_low
    na.quantize_low = lambda *a, **kw: served.append(real(*a, **kw)) or served[-1]
    try:
        for use_native in (True, False):
            cfg = CacheConfig(num_groups=1, recent_window=window, native=use_native, l2_key_bits=kb)
            cache = TieredCache(attention_config(2, 3, d), cfg, 1)
            cache.update(k, v, 0)
            low = Action.L if bits == 4 else Action.L2
            for i, batch in enumerate(batches):
                if batch:
                    cache.apply(0, 0, torch.tensor(batch), Action.R if i == 1 and len(batch) > 3 else low)
            stores.append(cache.layers[0].seqs[0])
    finally:
        na.quantize_low = real
    assert any(served) and all(served)  # the native quantiser wrote the first cache's multi-token batches
    _assert_same_tiers(*stores)


def test_build_key_covers_local_headers(tmp_path):
    """A library is rebuilt when a header its source includes with quotes changes (native_common.h)."""
    from pask.cpu import native

    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ here")
    src, hdr = tmp_path / "k.cpp", tmp_path / "h.h"
    src.write_text('#include <cstdint>\n#include "h.h"\nint f() { return 1; }\n')
    hdr.write_text("// one\n")
    assert native.local_includes(src) == [hdr.resolve()]
    before = native.build_key(cxx, src, [])
    hdr.write_text("// two\n")
    assert native.build_key(cxx, src, []) != before
    assert [f.name for f in native.local_includes(na.SOURCE)] == ["native_common.h"]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 5), steps=st.integers(1, 40), d=st.sampled_from([64, 128]))
def test_decode_appends_are_bit_exact_with_the_python_path(native, seed, rows, steps, d):
    """A decode step's tokens go into the H tiers in one native call per layer: the tiers equal the
    row-by-row PyTorch appends, through tier growth and with a dropped row."""
    gen = torch.Generator().manual_seed(seed)
    feeds = [torch.randn(rows, 2, 1, d, generator=gen).to(torch.bfloat16) for _ in range(2 * steps)]
    prompt = torch.randn(rows, 2, 3, d, generator=gen).to(torch.bfloat16)
    calls, real = [], na.append_h
    na.append_h = lambda *a: calls.append(real(*a)) or calls[-1]
    caches = []
    try:
        for use_native in (True, False):
            cache = TieredCache(attention_config(2, 3, d), CacheConfig(num_groups=1, native=use_native), rows)
            cache.update(prompt, prompt, 0)
            for i in range(steps):
                if i == steps // 2 and rows > 1:
                    cache.drop(rows - 1)
                cache.update(feeds[2 * i], feeds[2 * i + 1], 0)
            caches.append(cache)
    finally:
        na.append_h = real
    assert calls and all(calls)  # the native cache appended every decode step
    for b in range(rows - 1 if rows > 1 else rows):
        _assert_same_tiers(caches[0].layers[0].seqs[b], caches[1].layers[0].seqs[b])
    k = caches[0].layers[0].seqs[0].h.view("k")
    assert torch.equal(k[:, -1], feeds[2 * steps - 2][0, :, 0])


def test_decode_append_rejects_a_slot_past_capacity(native):
    """The native append writes nothing for a slot outside its tier (the caller's bug, not memory)."""
    import ctypes

    k = torch.zeros(1, 2, 1, 64, dtype=torch.bfloat16)
    dst = torch.full((2, 4, 64), 7, dtype=torch.bfloat16)
    vp, i64 = ctypes.c_void_p * 1, ctypes.c_int64 * 1
    args = (1, 2, 64, k.data_ptr(), k.data_ptr(), vp(dst.data_ptr()), vp(dst.data_ptr()), i64(4))
    assert na._LIB.pask_append_h(*args, i64(4)) == -1
    assert bool((dst == 7).all())
    assert na._LIB.pask_append_h(*args, i64(3)) == 0
    assert bool((dst[:, 3] == 0).all()) and bool((dst[:, :3] == 7).all())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=st.sampled_from([(2, 7, 64), (2, 6, 128), (1, 1, 64), (1, 8, 64)]),
    lengths=st.lists(st.integers(1, 700), min_size=1, max_size=3),
    mix=st.sampled_from([(0.05, 0.9, 0.05), (0.34, 0.33, 0.33), (0.0, 1.0, 0.0)]),
    seed=st.integers(0, 2**16),
    key_scale=st.sampled_from([1.0, 30.0]),
)
def test_int4_tier_error_is_bounded_in_fp32(native, shape, lengths, mix, seed, key_scale):
    """fp32 outputs (before any bf16 rounding) against the fp32 reference over the dequantised tiers:
    the AMX path (hi / lo bf16 operands, the polynomial exp, truncated weight splits) and the vector
    path both within 2.5e-4 of the largest output (the bound a query quantised to hi / lo bytes
    instead of bf16 pairs did not meet), and within 1e-3 with scores in the hundreds (key scale 30),
    where the operands' relative error of ~2^-17 becomes an error of ~1e-3 in the exponent. Measured
    over these draws (400 at key scale 30, AMX): median 1.6e-5, 90th percentile 8.5e-5, largest
    3.3e-4, which a single 2.5e-4 bound failed in about one draw in a hundred."""
    hkv, grp, d = shape
    _, layer = _layer(hkv, grp, d, lengths, [mix] * len(lengths), seed=seed, key_scale=key_scale)
    q = (torch.randn(len(lengths), hkv * grp, 1, d, generator=torch.Generator().manual_seed(seed)) * 2).to(
        torch.bfloat16
    )
    want = _reference(layer, q.float(), d**-0.5)
    scale = max(1e-3, float(want.abs().max()))
    paths = [True, False] if na.use_amx(True) else [False]
    try:
        for amx in paths:
            na.use_amx(amx)
            got = na.decode_layer(layer, q, d**-0.5, fp32=True)
            assert got.dtype == torch.float32
            err = float((got[:, 0] - want).abs().max())
            assert err <= (2.5e-4 if key_scale == 1.0 else 1e-3) * scale, (amx, err / scale)
    finally:
        na.use_amx(True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    heads=st.integers(1, 4),
    n=st.integers(1, 300),
    d=st.sampled_from([8, 24, 32, 64, 128]),  # 16-channel vectors and the scalar loop
    spare=st.integers(0, 20),
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
    nan=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_key_range_is_the_pytorch_amax_and_amin(native, heads, n, d, spare, scale, nan, seed):
    """The key balance's per-channel range from the native kernel: the same fp32 values (NaN where
    a channel holds one) as ``keys.float().amax(1) / amin(1)``, also on an H-tier view with spare slots."""
    from pask.kv.storage import key_balance

    gen = torch.Generator().manual_seed(seed)
    tier = (torch.randn(heads, n + spare, d, generator=gen) * scale).bfloat16()
    if nan:
        tier[heads - 1, n // 2, d // 3] = float("nan")
    keys = tier[:, :n]  # the H tier's view: rows contiguous per head, heads (n + spare) rows apart
    hi, lo = na.key_range(keys)
    k = keys.float()
    assert torch.equal(hi.nan_to_num(7.0), k.amax(1).nan_to_num(7.0))
    assert torch.equal(lo.nan_to_num(7.0), k.amin(1).nan_to_num(7.0))
    assert torch.equal(hi.isnan(), k.amax(1).isnan()) and torch.equal(lo.isnan(), k.amin(1).isnan())
    want, got = key_balance(keys, native=False), key_balance(keys)
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


def test_key_range_declines_what_it_does_not_serve(native):
    assert na.key_range(torch.randn(2, 5, 64)) is None  # fp32
    assert na.key_range(torch.randn(2, 5, 64).bfloat16().transpose(1, 2)) is None  # rows not contiguous
    assert na.key_range(torch.randn(2, 5, 256).bfloat16()) is None  # head_dim past the kernel's
    assert na.key_range(torch.zeros(2, 0, 64, dtype=torch.bfloat16)) is None  # no tokens


def _two_caches(seed, d, kb, rows=3, n=90, window=4, groups=2, layers=4):
    """Two bf16 caches with the same tokens (``layers`` layers in ``groups`` groups, ``rows`` rows),
    the first with the native kernels, the second with the PyTorch paths, their key balance fixed by
    a prefill-time INT4 batch in every row and group."""
    gen = torch.Generator().manual_seed(seed)
    k = (torch.randn(rows, 2, n, d, generator=gen) * 3).to(torch.bfloat16)
    v = torch.randn(rows, 2, n, d, generator=gen).to(torch.bfloat16)
    caches = []
    for native in (True, False):
        cfg = CacheConfig(num_groups=groups, recent_window=window, l2_key_bits=kb, native=native)
        cache = TieredCache(attention_config(2, 3, d, layers=layers), cfg, rows)
        for li in range(layers):
            cache.update(k, v, li)
        for r in range(rows):
            for g in range(groups):
                cache.apply(r, g, torch.arange(0, 6), Action.L)
        caches.append(cache)
    return caches


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), kb=st.sampled_from([2, 4]), action=st.sampled_from([Action.L, Action.L2]))
def test_a_steps_moves_on_two_threads_equal_one_thread(native, seed, kb, action):
    """A decode step's single-position moves of every row and group (distinct stores: the kernel
    runs them in parallel) leave every store exactly as on one thread."""
    caches = [_two_caches(seed, 64, kb)[0] for _ in range(2)]
    threads = torch.get_num_threads()
    try:
        for cache, t in zip(caches, (2, 1), strict=True):
            torch.set_num_threads(t)
            cache.apply_many([(r, g, 40 + 3 * r + g, action) for r in range(3) for g in range(2)])
    finally:
        torch.set_num_threads(threads)
    for la, lb in zip(caches[0].layers, caches[1].layers, strict=True):
        for sa, sb in zip(la.seqs, lb.seqs, strict=True):
            _assert_same_tiers(sa, sb)
            assert sa.h.n == sb.h.n and torch.equal(sa.h.view("k"), sb.h.view("k"))


def test_a_store_listed_twice_is_moved_in_order(native):
    """Moves of one store repeated in one native call (the kernel then runs in order, whatever the
    threads) write what one call per move writes: each move here quantises H slot 20 after the one
    before has moved the tier's last token into it."""
    m = 40
    caches = [_two_caches(7, 64, 4)[0] for _ in range(2)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outs = []
        for i, cache in enumerate(caches):
            stores = [cache.layers[li].seqs[1] for li in cache.groups[0]]
            for st_ in stores:
                st_.low(4).reserve(m)
            lslot, n = stores[0].low(4).n, stores[0].h.n
            moves = [(stores, 20, n - 1 - j, lslot + j) for j in range(m)]
            if i == 0:
                na.move_to_low(moves, 4)
            else:
                for mv in moves:
                    na.move_to_low([mv], 4)
            for st_ in stores:
                st_.low(4).commit(m)
                st_.h.truncate(n - m)
            outs.append(stores)
    finally:
        torch.set_num_threads(threads)
    for sa, sb in zip(*outs, strict=True):
        _assert_same_tiers(sa, sb)
        assert torch.equal(sa.h.view("k"), sb.h.view("k"))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    kb=st.sampled_from([2, 4]),
    picks=st.lists(  # (row, group, position, action, two positions)
        st.tuples(
            st.integers(0, 2), st.integers(0, 1), st.integers(6, 85), st.sampled_from(list(Action)), st.booleans()
        ),
        min_size=1,
        max_size=40,
    ),
)
def test_apply_many_equals_applying_one_by_one(native, seed, kb, picks):
    """A decode step's decisions of every row at once (one native call for the single-position
    moves) leave every store and index exactly as applying them one by one on the PyTorch paths;
    an invalid action raises the same error after the same earlier actions."""
    from pask.kv import KVCacheError

    a, b = _two_caches(seed, 64, kb)
    ops = [(r, g, torch.tensor([p, p + 1]) if two else p, act) for r, g, p, act, two in picks]
    err_a = err_b = None
    try:
        a.apply_many(ops)
    except KVCacheError as e:
        err_a = e
    for op in ops:
        try:
            b.apply(*op)
        except KVCacheError as e:
            err_b = e
            break
    assert type(err_a) is type(err_b) and str(err_a) == str(err_b)
    for la, lb in zip(a.layers, b.layers, strict=True):
        for sa, sb in zip(la.seqs, lb.seqs, strict=True):
            _assert_same_tiers(sa, sb)
            assert sa.h.n == sb.h.n and torch.equal(sa.h.view("k"), sb.h.view("k"))
    for r in range(3):
        for g in range(2):
            ia, ib = a.index(r, g), b.index(r, g)
            assert ia.n == ib.n and torch.equal(ia.tier_of.t[: ia.length], ib.tier_of.t[: ib.length])
            assert torch.equal(ia.slot_of.t[: ia.length], ib.slot_of.t[: ib.length])
