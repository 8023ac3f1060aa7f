"""BellowsKV's latent projections: exact for a group's first layer, the error sums, the file."""

from __future__ import annotations

import math

import pytest
import torch

from pask.calibration.bellows import (
    _Capture,
    collect,
    compression,
    fit,
    groups,
    load,
    markdown,
    own_projection,
    rel_errors,
)
from pask.errors import PaskError

PROMPTS = [[1, 415, 2343, 11, 7445, 30, 2000, 99], [1, 5130, 314, 1234, 3, 88, 900, 17, 4000, 12, 61]]
HELD = [[1, 77, 3000, 21, 9, 540, 1200]]


def test_groups():
    assert groups(24, 4) == [range(0, 4), range(4, 8), range(8, 12), range(12, 16), range(16, 20), range(20, 24)]
    assert groups(30, 8)[-1] == range(24, 30)  # a shorter last group
    for bad in (0, 31, 2.0, True):
        with pytest.raises(PaskError, match=r"--n must be an integer in \[1, 30\]"):
            groups(30, bad)


def test_first_layer_reconstructs_its_own_kv_exactly(smol):
    cap = _Capture(smol.model)
    try:
        with torch.inference_mode():
            smol.model(torch.tensor([PROMPTS[1]]), use_cache=False)
        for i in (0, 5, 29):
            w = own_projection(smol.model.model.layers[i]).double()
            x = torch.cat([cap.normed[i], torch.ones(len(PROMPTS[1]), 1, dtype=torch.float64)], dim=1)
            got, want = x @ w, torch.cat(cap.kv[i], dim=1)
            assert torch.allclose(got, want, atol=1e-5, rtol=0), (i, float((got - want).abs().max()))
    finally:
        cap.close()


def test_n1_is_exact_and_the_error_sums_match_a_direct_computation(smol):
    one = fit(smol, PROMPTS, HELD, n=1)
    assert all(r["own"] and r["fit_k"] < 1e-3 and r["held_v"] < 1e-3 for r in one.errors)
    two = fit(smol, PROMPTS, HELD, n=2, ridge=1e-3)
    second = next(r for r in two.errors if r["layer"] == 3)
    assert not second["own"] and second["group"] == 1
    # the moments' error equals the error computed on the stored activations
    cap = _Capture(smol.model)
    rows_x, rows_y = [], []
    try:
        with torch.inference_mode():
            for ids in PROMPTS:
                smol.model(torch.tensor([ids]), use_cache=False)
                rows_x.append(torch.cat([cap.normed[2], torch.ones(len(ids), 1, dtype=torch.float64)], dim=1))
                rows_y.append(torch.cat(cap.kv[3], dim=1))
    finally:
        cap.close()
    x, y = torch.cat(rows_x), torch.cat(rows_y)
    pred = x @ two.weights[3].double()
    kv = y.shape[1] // 2
    for cols, key in ((slice(0, kv), "fit_k"), (slice(kv, 2 * kv), "fit_v")):
        direct = math.sqrt(float(((pred - y)[:, cols] ** 2).sum() / ((y[:, cols] - y[:, cols].mean(0)) ** 2).sum()))
        assert second[key] == pytest.approx(direct, rel=1e-3, abs=1e-4)
    mom = collect(smol.model, PROMPTS, 2)
    assert rel_errors(two.weights[3], mom, 3, 1, kv)[0] == pytest.approx(second["fit_k"], abs=1e-4)


def test_projections_file_round_trip_and_refusals(smol, tmp_path):
    proj = fit(smol, PROMPTS[:1], [], n=3)
    path = tmp_path / "b.safetensors"
    proj.save(path)
    back = load(path, smol.fingerprint)
    assert back.n == 3 and back.errors == proj.errors and set(back.weights) == set(range(30))
    assert torch.equal(back.weights[4], proj.weights[4])
    with pytest.raises(PaskError, match="not this model"):
        load(path, "other:fp")
    (tmp_path / "bad").write_text("not safetensors")
    with pytest.raises(PaskError, match="is not a BellowsKV projections file"):
        load(tmp_path / "bad")
    with pytest.raises(PaskError, match="does not exist"):
        load(tmp_path / "none")
    with pytest.raises(PaskError, match="--ridge must be"):
        fit(smol, PROMPTS, [], n=2, ridge=-1)
    assert "| 4 | 1 |" in markdown(back, smol.model.config)


def test_compression_arithmetic():
    from types import SimpleNamespace

    qwen = SimpleNamespace(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, head_dim=64)
    assert compression(qwen, 8) == pytest.approx(4096 / 1792)  # the 2.29x at n = 8, BF16
    assert compression(qwen, 4) < 1.2  # n = 4 at BF16 barely saves
    assert compression(qwen, 8, 4) == pytest.approx(4096 / (448 + 28 * 4))
    smol = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    assert compression(smol, 2) == pytest.approx(1536 / 1152)


def test_calibrate_bellows_cli(tmp_path):
    from typer.testing import CliRunner

    from pask.cli import app

    runner = CliRunner()
    out = tmp_path / "p.safetensors"
    args = ["calibrate-bellows", "--model", "smollm2-135m", "--dtype", "fp32", "--task", "sql", "--out", str(out)]
    res = runner.invoke(app, [*args, "--n", "2", "--cases", "2", "--held-cases", "1", "--report", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    assert load(out).n == 2 and "| 1 | 0 |" in (tmp_path / "r.md").read_text()
    for bad, match in ((["--n", "0"], "--n must be an integer"), (["--cases", "0"], "--cases must be >= 1"),
                       (["--ridge", "nan"], "--ridge must be"),
                       (["--ridge", "1e-4", "--ridge", "1"], "needs held-out prompts")):  # fmt: skip
        res = runner.invoke(app, [*args, "--held-cases", "0", "--cases", "1", *bad])
        assert res.exit_code == 2 and match in res.output, res.output


def test_middle_latent_is_exact_for_its_source(smol):
    from pask.calibration.bellows import source

    assert source(range(4, 8), "middle") == 5 and source(range(0, 8), "middle") == 3 and source(range(4, 8)) == 4
    mid = fit(smol, PROMPTS, HELD, n=4, latent="middle")
    own = {r["layer"] for r in mid.errors if r["own"]}
    assert own == {1, 5, 9, 13, 17, 21, 25, 28}  # the last group is 28-29
    assert all(r["fit_k"] < 1e-3 and r["fit_v"] < 1e-3 for r in mid.errors if r["own"])
    with pytest.raises(PaskError, match="--latent must be one of first, middle"):
        fit(smol, PROMPTS, [], n=2, latent="last")


def test_several_ridges_keep_the_lowest_held_out_error(smol):
    proj = fit(smol, PROMPTS, HELD, n=2, ridge=[1e-4, 10.0, 1e-2])
    search = proj.meta["ridge_search"]
    assert [r["ridge"] for r in search] == [1e-4, 10.0, 1e-2]
    best = min(search, key=lambda r: r["mean_held_error"])
    assert proj.ridge == best["ridge"]
    fitted = [r for r in proj.errors if not r["own"]]
    assert sum(r["held_k"] + r["held_v"] for r in fitted) / (2 * len(fitted)) == pytest.approx(
        best["mean_held_error"], abs=1e-4
    )
    assert "Ridge chosen by the mean held-out error" in markdown(proj)
    with pytest.raises(PaskError, match="needs held-out prompts"):
        fit(smol, PROMPTS, [], n=2, ridge=[1e-4, 1.0])


def test_calibrate_bellows_pca_options(tmp_path):
    from typer.testing import CliRunner

    from pask.cli import app

    runner = CliRunner()
    out = tmp_path / "p.safetensors"
    args = ["calibrate-bellows", "--model", "smollm2-135m", "--dtype", "fp32", "--task", "sql", "--out", str(out)]
    ridges = ["--ridge", "1", "--ridge", "2", "--held-cases", "1"]
    for bad, match in ((["--dim", "64"], "--dim is the size of a pca latent"),
                       (["--latent", "pca", "--dim", "0"], "--dim is the size of a pca latent"),
                       (["--latent", "pca", *ridges], "has no ridge"),
                       (["--latent", "pca", "--key-dim", "32"], "--key-dim splits a pca latent of a given size"),
                       (["--latent", "first", "--key-dim", "32"], "--key-dim splits a pca latent of a given size"),
                       (["--latent", "pca", "--dim", "64", "--key-dim", "0"], "--key-dim splits")):  # fmt: skip
        res = runner.invoke(app, [*args, "--cases", "1", *bad])
        assert res.exit_code == 2 and match in res.output, res.output
    res = runner.invoke(app, [*args, "--latent", "pca", "--dim", "64", "--n", "2", "--cases", "2", "--held-cases", "1"])
    assert res.exit_code == 0, res.output
    assert load(out).hidden == 64 and "64 leading principal directions" in res.output


def test_calibrate_bellows_split_pca(tmp_path):
    from typer.testing import CliRunner

    from pask.cli import app

    runner = CliRunner()
    out = tmp_path / "p.safetensors"
    args = ["calibrate-bellows", "--model", "smollm2-135m", "--dtype", "fp32", "--task", "sql", "--out", str(out),
            "--latent", "pca", "--n", "2", "--cases", "2", "--held-cases", "1"]  # fmt: skip
    res = runner.invoke(app, [*args, "--dim", "500", "--key-dim", "64"])  # 436 values' dims > 2 x 192
    assert res.exit_code == 2 and "--key-dim must be an integer in [1, 384]" in res.output, res.output
    res = runner.invoke(app, [*args, "--dim", "160", "--key-dim", "64"])
    assert res.exit_code == 0, res.output
    proj = load(out)
    assert proj.hidden == 160 and proj.key_dim == 64 and "split: each group's pre-RoPE keys" in res.output
    kv = 192
    for w in proj.weights.values():  # keys read the first 64 values only, values the other 96
        assert not w[64:-1, :kv].any() and not w[:64, kv:].any()
