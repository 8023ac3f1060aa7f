"""The "pask" attention: tier streams vs naive attention, and whole-model equality with DynamicCache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import AttentionInterface

from pask.kv import Action, CacheConfig, TieredCache, UnsupportedModelError, register, use_pask_attention
from pask.kv.attention import check_model, tiered_attention_reference
from pask.kv.quant import dequantize_codes, quantize_codes
from pask.kv.storage import key_balance
from pask.policies import FullPolicy, StaticMixPolicy
from pask.runtime.runner import decode_with_policy, left_pad

HQ, HKV, D = 6, 2, 64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def tiny_config(layers: int = 2) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=HQ * D,
        num_attention_heads=HQ,
        num_key_value_heads=HKV,
        head_dim=D,
        num_hidden_layers=layers,
        intermediate_size=64,
        vocab_size=64,
    )


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, causal_new: int = 0) -> torch.Tensor:
    """q [Hq, qn, D], k/v [Hkv, n, D] -> [qn, Hq, D]; the last ``causal_new`` keys are the queries."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0).double(), v.repeat_interleave(rep, 0).double()
    s = q.double() @ k.transpose(1, 2) * scaling
    if causal_new > 1:
        n, qn = k.shape[1], q.shape[1]
        allowed = torch.arange(n)[None, :] <= (n - causal_new + torch.arange(qn))[:, None]
        s = s.masked_fill(~allowed[None], -torch.inf)
    return (torch.softmax(s, -1) @ v).transpose(0, 1).float()


def key_roundtrip(k: torch.Tensor, held: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Keys as the L tier stores them: balanced per channel by the keys ``held`` at the first L
    write, then quantised with zero point 8 (INT4, the int4 GEMM's convention) or 2 (INT2)."""
    mid, bal = key_balance(held)[:, 0:1], key_balance(held)[:, 1:2]
    zp = 1 << (bits - 1)
    codes, scale, zero = quantize_codes((k - mid) / bal, 32, zero_point=zp, scale_dtype=torch.bfloat16, bits=bits)
    return dequantize_codes(codes, scale, zero, zero_point=zp) * bal + mid


def value_roundtrip(v: torch.Tensor, bits: int = 4) -> torch.Tensor:
    codes, scale, zero = quantize_codes(v, 32, scale_dtype=torch.bfloat16, bits=bits)
    return dequantize_codes(codes, scale, zero)


def filled_cache(n: int, window: int = 8, seed: int = 0):
    """One-layer cache holding random K/V for ``n`` positions (returned too)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(HKV, n, D, generator=g) * 2
    v = torch.randn(HKV, n, D, generator=g)
    cfg = CacheConfig(num_groups=1, recent_window=window, dequant_block=64)
    cache = TieredCache(tiny_config(1), cfg, 1)
    cache.update(k[None], v[None], 0)
    return cache, k, v


def test_release_only_equals_attention_over_retained():
    cache, k, v = filled_cache(500)
    gone = torch.randperm(492, generator=torch.Generator().manual_seed(1))[:300]
    cache.apply(0, 0, gone, Action.R)
    keep = torch.ones(500, dtype=torch.bool)
    keep[gone] = False
    q = torch.randn(HQ, 1, D)
    out = tiered_attention_reference(q, cache.layers[0].seqs[0], 0.125)
    ref = naive(q, k[:, keep], v[:, keep], 0.125)
    assert (out - ref).abs().max() <= 1e-4


def test_int4_only_equals_attention_over_dequantised():
    cache, k, v = filled_cache(700)
    cache.apply(0, 0, torch.arange(692), Action.L)
    kd = k.clone()
    vd = v.clone()
    kd[:, :692] = key_roundtrip(k[:, :692], k)
    vd[:, :692] = value_roundtrip(v[:, :692])
    q = torch.randn(HQ, 1, D)
    out = tiered_attention_reference(q, cache.layers[0].seqs[0], 0.125, block=64)
    assert (out - naive(q, kd, vd, 0.125)).abs().max() <= 1e-3


def test_int2_tier_equals_attention_over_dequantised_and_holds_a_quarter_byte_per_value():
    cache, k, v = filled_cache(700)
    st = cache.layers[0].seqs[0]
    cache.apply(0, 0, torch.arange(100), Action.L2)  # two writes: the balance is fixed at the first
    cache.apply(0, 0, torch.arange(100, 692), Action.L2)
    assert st.l.n == 0 and st.l.t == {} and st.l2.n == 692 and st.l2.t["kq"].shape[-1] == D // 4
    kd, vd = k.clone(), v.clone()
    kd[:, :692] = key_roundtrip(k[:, :692], k, bits=2)
    vd[:, :692] = value_roundtrip(v[:, :692], bits=2)
    q = torch.randn(HQ, 1, D)
    out = tiered_attention_reference(q, st, 0.125, block=64)
    assert (out - naive(q, kd, vd, 0.125)).abs().max() <= 1e-3
    # measured bytes: 692 INT2 tokens (codes + bf16 scale/zero) + 8 H tokens (fp32 here) + the key balance
    per_token = 2 * HKV * (D // 4 + 4 * D // 32)
    assert cache.held_bytes() == 692 * per_token + 8 * 2 * HKV * D * 4 + st.balance_bytes()


def test_int2_and_int4_tiers_differ_in_error_as_expected():
    """INT2's error is several times INT4's on the same keys (its 3 levels vs 15)."""
    errs = {}
    for bits in (2, 4):
        cache, k, _ = filled_cache(300)
        cache.apply(0, 0, torch.arange(292), Action.L if bits == 4 else Action.L2)
        kd, _ = cache.layers[0].seqs[0].low_kv(bits=bits)
        errs[bits] = float((kd - k[:, :292]).norm() / k[:, :292].norm())
    assert 3 * errs[4] < errs[2] < 1.0, errs


def test_bad_low_bits_raise():
    from pask.errors import PaskError

    cache, _, _ = filled_cache(100)
    with pytest.raises(PaskError, match="2 or 4 bits"):
        cache.layers[0].seqs[0].low(3)


def test_mixed_tiers_and_multi_token_extend_are_causal():
    cache, k, v = filled_cache(300, window=4)
    acts = StaticMixPolicy(0.4, 0.3, 0.3).assign(torch.arange(296))
    cache.apply(0, 0, torch.nonzero(acts == 1).flatten(), Action.L)
    cache.apply(0, 0, torch.nonzero(acts == 2).flatten(), Action.R)
    new_k, new_v = torch.randn(1, HKV, 3, D), torch.randn(1, HKV, 3, D)
    cache.update(new_k, new_v, 0)  # an extend of 3 tokens: they sit at the tail of the H tier
    kd, vd = k.clone(), v.clone()
    lq = acts == 1
    kd[:, :296][:, lq] = key_roundtrip(k[:, :296][:, lq], k)
    vd[:, :296][:, lq] = value_roundtrip(v[:, :296][:, lq])
    keep = torch.cat([acts != 2, torch.ones(4, dtype=torch.bool)])
    kk = torch.cat([kd[:, keep], new_k[0]], 1)
    vv = torch.cat([vd[:, keep], new_v[0]], 1)
    q = torch.randn(HQ, 3, D)
    out = tiered_attention_reference(q, cache.layers[0].seqs[0], 0.125, n_new=3)
    assert (out - naive(q, kk, vv, 0.125, causal_new=3)).abs().max() <= 1e-3


def test_register_is_idempotent():
    register()
    register()
    assert "pask" in AttentionInterface()


def test_unsupported_models_raise():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=16, n_positions=16))
    with pytest.raises(UnsupportedModelError):
        check_model(gpt2)
    llama = LlamaForCausalLM(tiny_config())
    check_model(llama)
    llama._supports_attention_backend = False
    with pytest.raises(UnsupportedModelError, match="AttentionInterface"):
        check_model(llama)


def greedy_dynamic(model, rows: list[list[int]], steps: int, pad_id: int) -> torch.Tensor:
    """Reference: greedy decode with transformers' DynamicCache; logits per step [steps+1, B, V]."""
    ids, mask, pos, _ = left_pad(rows, pad_id)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True).logits[:, -1]
        out = [logits]
        p = pos[:, -1:]
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], -1)
            p = p + 1
            nxt = logits.argmax(-1, keepdim=True)
            out_ = model(input_ids=nxt, attention_mask=mask, position_ids=p, cache=cache, use_cache=True)
            logits = out_.logits[:, -1]
            out.append(logits)
    return torch.stack(out)


def _equal_to_dynamic_cache(lm, steps: int) -> None:
    tok = lm.tokenizer
    rows = [
        tok("def fibonacci(n):\n    ")["input_ids"],
        tok("SELECT name, age FROM users WHERE id > 3 AND")["input_ids"],
    ]
    assert len(rows[0]) != len(rows[1])
    ref = greedy_dynamic(lm.model, rows, steps, tok.pad_token_id)
    res = decode_with_policy(
        lm.model, rows, FullPolicy(), steps + 1, CacheConfig(), pad_token_id=tok.pad_token_id, keep_logits=True
    )
    got = torch.stack(res.logits)
    assert got.shape == ref.shape
    assert (got - ref).abs().max() <= 1e-4
    assert res.budget.b_total == 1.0
    assert lm.model.config._attn_implementation == "sdpa"  # restored


def test_full_tiered_equals_dynamic_cache_smollm(smol):
    _equal_to_dynamic_cache(smol, 32)


@pytest.mark.slow
def test_full_tiered_equals_dynamic_cache_qwen():
    from pask.runtime.models import load_model

    _equal_to_dynamic_cache(load_model("qwen2.5-coder-0.5b", dtype=torch.float32), 24)


def test_mixed_policy_decodes_with_physical_shorter_than_logical(smol):
    tok = smol.tokenizer
    rows = [tok("x = [" + ", ".join(str(i) for i in range(40)))["input_ids"], tok("def f(a, b):")["input_ids"]]
    res = decode_with_policy(smol.model, rows, StaticMixPolicy(0.2, 0.3, 0.5), 24, CacheConfig(), keep_logits=True)
    cache = res.cache
    assert all(torch.isfinite(x).all() for x in res.logits)
    assert all(len(t) == 24 for t in res.tokens)
    st = cache.layers[0].seqs[0]
    assert st.h.n + st.l.n < cache.seq_length(0) - 10  # physically shorter than logically
    assert 0.2 < res.budget.b_total < 0.8 and res.budget.samples == 23


def test_pask_attention_context_restores_and_plain_forward_still_works(smol):
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        ref = smol.model(input_ids=ids).logits
        with use_pask_attention(smol.model):
            assert smol.model.config._attn_implementation == "pask"
            same = smol.model(input_ids=ids).logits  # no TieredCache: plain SDPA
            cache = TieredCache(smol.model.config)
            tiered = smol.model(input_ids=ids, cache=cache, use_cache=True).logits
    assert torch.allclose(ref, same, atol=1e-5) and torch.allclose(ref, tiered, atol=1e-5)
    assert smol.model.config._attn_implementation == "sdpa"


def test_fused_cpu_path_matches_reference_in_bf16():
    from pask.kv import fastpath

    if not fastpath.available():
        pytest.skip("PyTorch's CPU int4 GEMM is missing or packs differently here (non-AVX-512 build)")
    for n, mix in [(700, (0.34, 0.33, 0.33)), (300, (0.0, 1.0, 0.0)), (130, (0.5, 0.0, 0.5))]:
        _, k, v = filled_cache(n, window=8)
        cache = TieredCache(tiny_config(1), CacheConfig(num_groups=1), 1)
        cache.update(k[None].to(torch.bfloat16), v[None].to(torch.bfloat16), 0)
        acts = StaticMixPolicy(*mix).assign(torch.arange(n - 8))
        for a in (Action.L, Action.R):
            cache.apply(0, 0, torch.nonzero(acts == int(a)).flatten(), a)
        store = cache.layers[0].seqs[0]
        q = torch.randn(HQ, 1, D, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)  # seeded
        assert fastpath.applies(q, store)
        ref = tiered_attention_reference(q, store, 0.125).float()
        got = fastpath.decode_attention(q, store, 0.125).float()
        assert (got - ref).abs().max() <= 0.02 * max(1.0, float(ref.abs().max()))


def test_bf16_model_fused_path_agrees_with_reference_path():
    from pask.kv import fastpath
    from pask.runtime.models import load_model

    if not fastpath.available():
        pytest.skip("fused CPU path unavailable on this build")
    lm = load_model("smollm2-135m", dtype=torch.bfloat16)
    tok = lm.tokenizer
    rows = [tok("def add(a, b):\n    return a + b\n\n" * 3)["input_ids"], tok("SELECT * FROM t")["input_ids"]]
    gen = torch.Generator().manual_seed(0)
    forced = [[int(x) for x in torch.randint(100, 1000, (10,), generator=gen)] for _ in rows]
    runs = []
    for fast in (True, False):
        step = [0, 0]

        def nxt(row, logits, step=step):
            step[row] += 1
            return forced[row][step[row] - 1]

        cfg = CacheConfig(fast_path=fast, recent_window=4)
        res = decode_with_policy(lm.model, rows, StaticMixPolicy(0.34, 0.33, 0.33), 10, cfg, nxt, keep_logits=True)
        runs.append(torch.stack(res.logits))
    fast_logits, ref_logits = runs
    assert torch.isfinite(fast_logits).all()
    rel = (fast_logits - ref_logits).abs().max() / ref_logits.abs().max()
    assert rel < 0.05, float(rel)
    print(f"fused vs reference path: max logit diff / max logit = {float(rel):.4f}")


def test_finished_row_is_dropped_and_harmless(smol):
    """A row that stops early is freed; the other row's logits equal a run of that row alone."""
    tok = smol.tokenizer
    rows = [tok("for i in range(10):\n    print(")["input_ids"], tok("x = 1")["input_ids"]]
    stop = 7

    calls = {0: 0, 1: 0}

    def nxt(row, logits):  # row 1 stops at its 5th token
        calls[row] += 1
        return stop if row == 1 and calls[row] == 5 else int(logits.argmax())

    cfg = CacheConfig(recent_window=4)
    policy = StaticMixPolicy(0.5, 0.25, 0.25)
    both = decode_with_policy(smol.model, rows, policy, 12, cfg, nxt, stop_token_ids=[stop], keep_logits=True)
    alone = decode_with_policy(smol.model, rows[:1], policy, 12, cfg, keep_logits=True)
    assert both.tokens[1][-1] == stop and len(both.tokens[1]) < 12
    diff = max(float((a[0] - b[0]).abs().max()) for a, b in zip(both.logits, alone.logits, strict=True))
    assert diff <= 1e-4
    # the finished row was freed and compacted away: the cache holds row 0 only, with its final state
    assert both.cache.num_seqs == 1 and not both.cache.dropped[0]
    assert both.cache.seq_length(0) == len(rows[0]) + len(both.tokens[0]) - 1
    assert both.tokens[0] == alone.tokens[0]
    assert 0 < both.budget.b_total < 1
