"""INT4 / INT8 weights (pask.cpu.weights, the native quantised GEMV): layout, kernels, model, CLI, sweep."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pask.cpu import bf16_matmul
from pask.cpu import native_gemv as ng
from pask.cpu import weights as W
from pask.errors import PaskError


@pytest.fixture(scope="module")
def gemv():
    if ng.status() != "ok":
        pytest.skip(f"native gemv: {ng.status()}")
    return ng


def fma_bf16(codes: torch.Tensor, sz: torch.Tensor, n: int) -> torch.Tensor:
    """code * scale + zero rounded once to fp32 (float64 is exact here: an 8-bit code times a bf16
    scale plus a bf16 zero), then to bf16: what fma then a round-to-nearest-even conversion give."""
    nb, groups = codes.shape[0], codes.shape[1]
    q = W.codes_of(codes).reshape(nb * 16, groups, W.GROUP).double()
    s, z = (t.double().unsqueeze(-1) for t in W.scales_of(sz))
    return (q * s + z).float().bfloat16().reshape(nb * 16, -1)[:n]


def int8_reference(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, n: int, b) -> torch.Tensor:
    """The AMX-INT8 kernel's arithmetic in fp64: x per row and group of 32 as rne(x * 127 / absmax)
    with scale absmax / 127, products of the codes exact, y = sum_g a s C + z sum(x)."""
    m, k = x.shape
    groups = k // W.GROUP
    xf = x.float().reshape(m, groups, W.GROUP)
    amax = xf.abs().amax(-1)
    # 127 / amax as one fp32 division (PyTorch's scalar / tensor multiplies by a reciprocal: two roundings)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    x8 = (xf * inv.unsqueeze(-1)).round().clamp(-127, 127).double()
    a = (amax / 127.0).double()
    nb = codes.shape[0]
    q = W.codes_of(codes).reshape(nb * 16, groups, W.GROUP).double()[:n]
    s, z = (t.double()[:n] for t in W.scales_of(sz))
    cg = torch.einsum("mgk,ngk->mng", x8, q)
    y = (cg * a.unsqueeze(1) * s.unsqueeze(0) + z.unsqueeze(0) * xf.double().sum(-1).unsqueeze(1)).sum(-1)
    return y + (0 if b is None else b.double())


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fma(a, b, c), exactly: a * b is exact in float64 here (an integer below 2^24 or a float32
    times a float32), the sum rounded to odd at 53 bits (TwoSum's error nudges an even result one
    step towards it), then to nearest even at 24 bits: one correct rounding of the exact value."""
    p, c = a.double() * b.double(), c.double()
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    even = (s.view(torch.int64) & 1) == 0
    nudge = (err != 0) & even
    s = torch.where(nudge, torch.nextafter(s, torch.where(err > 0, torch.inf, -torch.inf).double()), s)
    return s.float()


def int8_exact(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, n: int, b) -> torch.Tensor:
    """The int8-activation kernels (AMX-INT8 tiles, AVX2 pmaddubsw) step by step in fp32: x8 =
    rne(x * fp32(127 / absmax)), a = fp32(absmax / 127), xs summed in _mm512_reduce_add_ps's order,
    C exact, then per group acc = fma(C, fp32(s a), acc), acc = fma(z, xs, acc); + bias (fp32, before
    the output's rounding to bf16)."""
    m, k = x.shape
    groups = k // W.GROUP
    xf = x.float().reshape(m, groups, W.GROUP)
    amax = xf.abs().amax(-1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    a = amax / torch.full_like(amax, 127.0)
    x8 = (xf * inv.unsqueeze(-1)).round().clamp(-128, 127).to(torch.int64)
    s16 = xf[..., :16] + xf[..., 16:]
    t3 = s16[..., 8:] + s16[..., :8]
    t6 = t3[..., 4:] + t3[..., :4]
    xs = (t6[..., 0] + t6[..., 2]) + (t6[..., 1] + t6[..., 3])
    nb = codes.shape[0]
    q = W.codes_of(codes).reshape(nb * 16, groups, W.GROUP).to(torch.int64)[:n]
    s, z = (t.float()[:n] for t in W.scales_of(sz))
    cg = torch.einsum("mgk,ngk->mng", x8, q).float()  # exact: |C| < 2^20
    acc = torch.zeros(m, n)
    for g in range(groups):
        acc = fma32(cg[:, :, g], s[:, g].unsqueeze(0) * a[:, g].unsqueeze(1), acc)
        acc = fma32(z[:, g].unsqueeze(0).expand(m, n), xs[:, g].unsqueeze(1).expand(m, n), acc)
    if b is not None:
        acc = acc + b.float()
    return acc


def test_fma32_rounds_once():
    # (1 + 2^-11)(1 - 4094 * 2^-23) = 1 + 2^-33 exactly; + 2^24 lies just above the midpoint 2^24 + 1 of
    # two float32s: float64 rounds it onto the midpoint and float32 then to even (2^24); fma gives 2^24 + 2
    a, b, c = torch.tensor([1 + 2.0**-11]), torch.tensor([1 - 4094 * 2.0**-23]), torch.tensor([2.0**24])
    assert (a.double() * b.double() + c.double()).float().item() == 2.0**24
    assert fma32(a, b, c).item() == 2.0**24 + 2
    assert fma32(a, -b, -c).item() == -(2.0**24 + 2)
    assert fma32(torch.tensor([3.0]), torch.tensor([0.5]), torch.tensor([1.0])).item() == 2.5


@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(1, ng.MAX_ROWS),
    n=st.integers(1, 40),
    groups=st.integers(1, 6),
    bias=st.booleans(),
    bits=st.sampled_from([4, 8]),
    zero_group=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_int8_activation_kernel_is_its_arithmetic_bit_for_bit(gemv, m, n, groups, bias, bits, zero_group, seed):
    if ng.quant_kernel() == "dequant":
        pytest.skip("no int8-activation kernel here")
    gen = torch.Generator().manual_seed(seed)
    k = groups * W.GROUP
    codes, sz = W.quantize(torch.randn(n, k, generator=gen) * 0.1, bits)
    # magnitudes spread over 2^-12 .. 2^12 within a group: its fp32 sum and z * sum are inexact, so
    # their order and fusion show (with bf16 values of one scale they are exact in any order)
    spread = torch.exp2(torch.randint(-12, 13, (m, k), generator=gen).float())
    x = (torch.randn(m, k, generator=gen) * spread).bfloat16()
    if zero_group:  # a group of zeros: scale 0, codes 0
        x[0, : W.GROUP] = 0
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    want = int8_exact(x, codes, sz, n, b)
    assert torch.equal(ng.linear_quant(x, codes, sz, n, bits, b), want.bfloat16())
    if not ng.has_bf16_io():  # the AVX2 kernel's fp32 sums themselves, before the rounding to bf16
        assert torch.equal(ng.linear_quant_f32(x, codes, sz, n, bits, b), want)


def test_avx2_int8_linears_switch(gemv):
    """use_int8_linears(False) runs the dequantised kernels (bit for bit), True the int8 kernel; None reads."""
    if ng.quant_kernel() == "amx-int8":
        pytest.skip("AMX tiles run decode rows here")
    was = ng.use_int8_linears(None)
    codes, sz = W.quantize(torch.randn(24, 64), 8)
    x = torch.randn(3, 64).bfloat16()
    try:
        if not ng.use_int8_linears(True):
            pytest.skip("no AVX2 int8 kernel in this build")
        assert ng.quant_kernel() == "avx2-int8" and ng.use_int8_linears(None)
        assert torch.equal(ng.linear_quant_f32(x, codes, sz, 24, 8), int8_exact(x, codes, sz, 24, None))
        assert not ng.use_int8_linears(False) and ng.quant_kernel() == "dequant"
        assert torch.equal(ng.linear_quant(x, codes, sz, 24, 8), ng.linear(x, ng.dequant(codes, sz, 24, 8)).bfloat16())
    finally:
        ng.use_int8_linears(was)


# -- quantisation and layout (PyTorch only) ---------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    groups=st.integers(1, 6),
    scale=st.sampled_from([1e-3, 1.0, 50.0]),
    bits=st.sampled_from([4, 8]),
    seed=st.integers(0, 2**16),
)
def test_quantisation_error_is_at_most_half_a_step(n, groups, scale, bits, seed):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, groups * W.GROUP, generator=gen) * scale).bfloat16()
    codes, sz = W.quantize(w, bits)
    assert codes.dtype == torch.uint8 and codes.shape == (-(-n // 16), groups, bits, 64)
    assert sz.dtype == torch.bfloat16 and sz.shape == (-(-n // 16), groups, 2, 16)
    deq = W.dequantize_reference(codes, sz, n)
    step = W.scales_of(sz)[0][:n].float().repeat_interleave(W.GROUP, 1)
    # half a step, plus the bf16 rounding of scale and zero (2^-8 relative, up to 2^bits - 1 steps away)
    bound = step * (0.5 + 2**bits * 2**-8) + w.float().abs() * 2**-8 + 1e-30
    assert torch.all((deq - w.float()).abs() <= bound)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 35), groups=st.integers(1, 4), bits=st.sampled_from([4, 8]), seed=st.integers(0, 2**16))
def test_groups_on_the_grid_are_recovered_exactly(n, groups, bits, seed):
    """A group that already is ``q * s + z`` with q in 0..2^bits - 1 (e.g. a GGUF Q5_0 block with 8
    bits, a Q4_K sub-block with 4) keeps its values."""
    gen = torch.Generator().manual_seed(seed)
    levels = (1 << bits) - 1
    q = torch.randint(0, levels + 1, (n, groups, W.GROUP), generator=gen)
    q[..., 0], q[..., 1] = 0, levels  # the group spans every level
    s = torch.tensor(2.0) ** torch.randint(-8, 3, (n, groups, 1), generator=gen)  # exact in bf16 and fp32
    z = torch.randint(-64, 64, (n, groups, 1), generator=gen).float() * s
    w = (q * s + z).reshape(n, -1)
    codes, sz = W.quantize(w, bits)
    assert torch.equal(W.dequantize_reference(codes, sz, n), w)


@pytest.mark.parametrize("bits", [4, 8])
def test_padding_rows_are_zero(bits):
    codes, sz = W.quantize(torch.randn(5, 64), bits)
    assert torch.all(W.dequantize_reference(codes, sz)[5:] == 0)


@pytest.mark.parametrize(
    "shape", [(4, 48), (3, 0), (0, 32)], ids=["inputs not a multiple of 32", "no inputs", "no outputs"]
)
def test_bad_weights_are_refused(shape):
    with pytest.raises(PaskError, match="INT4 weights"):
        W.quantize(torch.randn(*shape), 4)
    with pytest.raises(PaskError, match="4 or 8 bits"):
        W.quantize(torch.randn(16, 32), 2)


def test_non_finite_weights_are_refused():
    w = torch.randn(2, 32)
    w[1, 3] = float("nan")
    with pytest.raises(PaskError, match="non-finite"):
        W.quantize(w, 8)


def test_weight_format_is_checked(monkeypatch):
    assert W.configured("int4") == "int4"
    monkeypatch.setenv("PASK_WEIGHTS", "INT4")
    assert W.configured() == "int4"
    monkeypatch.delenv("PASK_WEIGHTS")
    assert W.configured() == "bf16"
    assert W.configured("int8") == "int8"
    for bad in ("int2", "fp8", ""):
        with pytest.raises(PaskError, match="weight format must be one of"):
            W.configured(bad)


# -- native kernels ---------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), groups=st.integers(1, 5), bits=st.sampled_from([4, 8]), seed=st.integers(0, 2**16))
def test_native_dequantisation_is_fma_then_bf16(gemv, n, groups, bits, seed):
    gen = torch.Generator().manual_seed(seed)
    codes, sz = W.quantize(torch.randn(n, groups * W.GROUP, generator=gen) * 3, bits)
    assert torch.equal(ng.dequant(codes, sz, n, bits), fma_bf16(codes, sz, n))


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, ng.MAX_ROWS),
    n=st.integers(1, 70),
    groups=st.integers(1, 6),
    bias=st.booleans(),
    bits=st.sampled_from([4, 8]),
    seed=st.integers(0, 2**16),
)
def test_quantised_linear_is_its_reference_and_batch_invariant(gemv, m, n, groups, bias, bits, seed):
    gen = torch.Generator().manual_seed(seed)
    k = groups * W.GROUP
    codes, sz = W.quantize(torch.randn(n, k, generator=gen), bits)
    x = torch.randn(m, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    y = ng.linear_quant(x, codes, sz, n, bits, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    if ng.quant_kernel() != "dequant":  # int8 activations: within the bf16 rounding of the output (and fp32 sums)
        want = int8_reference(x, codes, sz, n, b)
        tol = want.abs() * 2**-8 + want.abs().amax() * 1e-5 + 1e-6
        assert torch.all((y.double() - want).abs() <= tol)
    else:  # the bf16 kernels over the dequantised weight, bit for bit
        deq = ng.dequant(codes, sz, n, bits)
        ref = ng.linear_bf16(x, deq, b) if ng.has_bf16_io() else ng.linear(x, deq, b).bfloat16()
        assert torch.equal(y, ref)
    alone = torch.cat([ng.linear_quant(x[i : i + 1], codes, sz, n, bits, b) for i in range(m)])
    assert torch.equal(alone, y)


def test_quantised_linear_rejects_bad_shapes_and_widths(gemv):
    codes, sz = W.quantize(torch.randn(16, 64), 4)
    with pytest.raises(RuntimeError, match="rejected"):
        ng.linear_quant(torch.randn(0, 64).bfloat16(), codes, sz, 16, 4)
    with pytest.raises(RuntimeError, match="rejected"):
        ng.linear_quant(torch.randn(1, 64).bfloat16(), codes, sz, 16, 3)


# -- the module and the model -----------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 8, 9, 40])
def test_quant_linear_module_decode_and_prefill_paths(gemv, rows, bits, monkeypatch):
    gen = torch.Generator().manual_seed(rows)
    lin = torch.nn.Linear(96, 40, bias=True).bfloat16()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=gen))
    q = W.QuantLinear.from_linear(lin, bits)
    x = torch.randn(2, rows, 96, generator=gen).bfloat16()
    y = q(x)
    assert y.shape == (2, rows, 40) and y.dtype == torch.bfloat16
    deq = ng.dequant(q.codes, q.sz, 40, bits)

    def prefill(lo: int, hi: int) -> torch.Tensor:  # the prefill GEMM over outputs lo..hi
        if bf16_matmul.cpu_has_bf16():
            return bf16_matmul.bounded_linear(x, deq[lo:hi], q.bias[lo:hi])
        return F.linear(x.float(), deq[lo:hi].float(), q.bias[lo:hi].float()).bfloat16()

    if 2 * rows <= ng.MAX_ROWS:
        assert torch.equal(y, ng.linear_quant(x, q.codes, q.sz, 40, bits, q.bias))
        pieces = y
    else:
        assert torch.equal(y, prefill(0, 40))
        # in pieces of 16 outputs each piece is its own GEMM (a bf16 GEMM may block a 16-wide
        # weight differently from a 40-wide one, so the pieces are compared with the same cut)
        pieces = torch.cat([prefill(0, 16), prefill(16, 32), prefill(32, 40)], -1)
    monkeypatch.setattr(W, "PREFILL_ROWS", 16)  # a head dequantised in pieces: the right codes per piece
    assert torch.equal(q(x), pieces)
    other = W.QuantLinear.from_linear(torch.nn.Linear(96, 40).bfloat16(), bits)
    other(x)  # another layer through the same prefill scratch first
    assert torch.equal(q(x), pieces)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_model_quantised(gemv, smol, fmt):
    model = smol.model
    import copy

    q = copy.deepcopy(model)
    report = W.apply(q, fmt)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert report["layers"] == n_linear and report["bytes_after"] < report["bytes_before"] / (
        3 if fmt == "int4" else 1.7
    )
    assert not any(type(m) is torch.nn.Linear for m in q.modules())
    # a decode step reads the INT4 linears and the norms, not the embedding table
    emb = model.get_input_embeddings().weight
    assert W.step_weight_bytes(model) == sum(p.numel() * p.element_size() for p in model.parameters())
    assert W.step_weight_bytes(q) < W.step_weight_bytes(model) - emb.numel() * emb.element_size() * 0.5
    ids = smol.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = model(ids).logits[0, -1], q(ids).logits[0, -1]
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > (0.95 if fmt == "int4" else 0.999)  # close
    assert W.apply(copy.deepcopy(model), "bf16")["layers"] == 0


def test_int4_needs_the_native_kernels(monkeypatch):
    monkeypatch.setenv("PASK_NATIVE", "0")
    with pytest.raises(PaskError, match="needs pask's native kernels"):
        W.apply(torch.nn.Sequential(torch.nn.Linear(32, 4)), "int4")


def test_a_model_without_linears_is_refused(gemv):
    with pytest.raises(PaskError, match="no linear layer"):
        W.apply(torch.nn.Sequential(torch.nn.ReLU()), "int4")


# -- commands and sweeps ----------------------------------------------------------------------------
def test_cli_refuses_an_unknown_weight_format():
    from typer.testing import CliRunner

    from pask.cli import app

    res = CliRunner().invoke(app, ["eval", "bfcl", "--weights", "int2", "--limit", "1"])
    assert res.exit_code == 2 and "weight format must be one of" in res.output


def test_sweep_weights_key(tmp_path):
    from pask.experiments.sweep import load_config

    base = 'results_dir = "r"\nmodels = ["smollm2-135m"]\ntasks = ["sql"]\nsplits = ["dev"]\npolicies = ["full"]\n'
    (tmp_path / "a.toml").write_text(base)
    (tmp_path / "b.toml").write_text('weights = "int4"\n' + base)
    (tmp_path / "c.toml").write_text('weights = "int2"\n' + base)
    a, b = load_config(tmp_path / "a.toml").cells[0], load_config(tmp_path / "b.toml").cells[0]
    assert "weights" not in a.spec() and b.spec()["weights"] == "int4"  # bf16 cells keep their hashes
    assert a.config_hash() != b.config_hash() and b.meta()["weights"] == "int4"
    with pytest.raises(PaskError, match="unknown weights"):
        load_config(tmp_path / "c.toml")


def test_masked_head_over_a_quantised_head(gemv, smol):
    """The masked LM head gathers a quantised head's rows dequantised to bf16 (as its prefill path)."""
    import copy

    from pask.runtime.masked_head import MaskedHead

    q = copy.deepcopy(smol.model).bfloat16()
    W.apply(q, "int4")
    lin = q.get_output_embeddings()
    head = MaskedHead(q)
    try:
        x = torch.randn(2, 1, lin.in_features).bfloat16()
        idx = torch.tensor([3, 17, 40, 1000, lin.out_features - 1])
        head.plan = [idx, None]
        out = lin(x)
        w = ng.dequant(lin.codes, lin.sz, lin.out_features, lin.bits).float()
        assert torch.equal(out[0, 0, idx], (w[idx] @ x[0, 0].float()).bfloat16())
        assert torch.isinf(out[0, 0]).sum() == lin.out_features - idx.numel()
        assert torch.equal(out[1], lin(x[1:]).reshape(1, -1))  # a wide row: the head itself
    finally:
        head.close()


def test_constrained_generation_with_quantised_weights(gemv, smol):
    """The engine (grammar masks planned on the head, the masked head, the cache) runs on an INT4
    model, and its calls parse."""
    import copy
    import dataclasses

    from pask.evaluation.run_bfcl import prepare
    from pask.runtime.engine import generate
    from pask.tasks.function_calling import load_cases

    q = copy.deepcopy(smol.model).bfloat16()
    W.apply(q, "int4")
    lm = dataclasses.replace(smol, model=q)
    cases = load_cases(["simple"], split="test", limit=2)
    gens = generate(lm, [prepare(lm, c, 24)[0] for c in cases])
    assert all(g.token_ids for g in gens)


def test_value_output_norms_read_a_quantised_projection(gemv, smol):
    """A policy that scores prompt tokens by ``‖v W_o‖₁`` (CriticalKV; PASK tables may too) runs on a
    quantised model: the norms read the dequantised ``o_proj``, the weight its prefill multiplies by."""
    import copy
    import dataclasses

    from pask.evaluation.run_bfcl import prepare
    from pask.policies.factory import make_policy
    from pask.runtime.engine import generate
    from pask.tasks.function_calling import load_cases

    q = copy.deepcopy(smol.model).bfloat16()
    W.apply(q, "int8")
    o_proj = q.model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, W.QuantLinear)
    assert torch.equal(W.dense_weight(o_proj), fma_bf16(o_proj.codes, o_proj.sz, o_proj.out_features))
    plain = torch.nn.Linear(4, 2)
    assert W.dense_weight(plain) is plain.weight and W.dense_weight(None) is None
    lm = dataclasses.replace(smol, model=q)
    (case,) = load_cases(["simple"], split="test", limit=1)
    (gen,) = generate(lm, [prepare(lm, case, 12)[0]], policy=make_policy("criticalkv", 0.33))
    assert gen.token_ids


def test_bellows_fitting_refuses_quantised_projections(gemv):
    from types import SimpleNamespace

    from pask.calibration.bellows import own_projection

    att = SimpleNamespace(k_proj=W.QuantLinear.from_linear(torch.nn.Linear(32, 16), 4), v_proj=torch.nn.Linear(32, 16))
    with pytest.raises(PaskError, match="bf16 weights"):
        own_projection(SimpleNamespace(self_attn=att))


def test_serving_an_int8_model(gemv, smol):
    """The server's loop (continuous batching, masks on the head, the masked head) on an INT8 model;
    the bandwidth model counts the bytes of the quantised linears."""
    import copy
    import dataclasses

    from pask.bench.serving import BenchConfig, bench_serve
    from pask.policies import FullPolicy

    q = copy.deepcopy(smol.model).bfloat16()
    W.apply(q, "int8")
    q.pask_weights = {"weights": "int8", "layers": 1}
    lm = dataclasses.replace(smol, model=q)
    cfg = BenchConfig(concurrency=2, input_len=300, output_len=4, requests_per_client=1)
    result = bench_serve(lm, {"full": FullPolicy}, cfg)
    (full,) = result["policies"]
    assert full["requests"] == 2 and full["errors_5xx"] == full["errors_other"] == 0 and full["completion_tokens"] > 0
    assert "INT8" in result["decode_linears"]
