"""MetaKV: features, the selection rule, the predictor file, the scheduler's per-request policies, eval."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from pask.cli import app
from pask.errors import PaskError
from pask.evaluation.runner import run_task
from pask.meta.candidates import Candidate, cache_key_bits
from pask.meta.features import FEATURES, request_features
from pask.meta.predictor import MetaPredictor, Observation, Prediction, auc, fit, load
from pask.meta.selection import Constraints, select
from pask.meta.selector import MetaProbe, MetaSelector
from pask.policies.factory import make_policy
from pask.structure.tags import PromptLabel
from pask.tasks import get_task

P = PromptLabel


def _pred(name, p, lat, kv):
    return Prediction(name, p, 10.0, lat, kv)


# -- the selection rule ---------------------------------------------------------------------------
def test_select_takes_the_most_likely_feasible_candidate():
    preds = [_pred("full", 0.9, 100, 10), _pred("kivi-4", 0.8, 90, 3), _pred("snapkv", 0.6, 80, 2)]
    assert select(preds, Constraints()).candidate == "full"
    choice = select(preds, Constraints(max_kv_mb=5))
    assert choice.candidate == "kivi-4" and choice.feasible
    assert select(preds, Constraints(max_latency_ms=85)).candidate == "snapkv"
    assert select(preds, Constraints(max_latency_ms=95, max_kv_mb=2.5)).candidate == "snapkv"


def test_select_falls_back_to_the_cheapest_when_nothing_fits():
    preds = [_pred("full", 0.9, 100, 10), _pred("kivi-4", 0.8, 90, 3), _pred("snapkv", 0.6, 95, 2)]
    choice = select(preds, Constraints(max_latency_ms=50, max_kv_mb=1))
    assert choice.candidate == "snapkv" and not choice.feasible  # the fewest KV bytes


def test_select_ties_go_to_fewer_bytes_then_order():
    preds = [_pred("a", 0.7, 10, 5), _pred("b", 0.7, 10, 4), _pred("c", 0.7, 10, 4)]
    assert select(preds, Constraints()).candidate == "b"
    with pytest.raises(PaskError, match="no candidate"):
        select([], Constraints())


@given(st.lists(st.tuples(st.floats(0, 1), st.floats(1, 1e4), st.floats(0.01, 100)), min_size=1, max_size=8),
       st.floats(1, 1e4), st.floats(0.01, 100))  # fmt: skip
def test_select_property(rows, max_lat, max_kv):
    preds = [_pred(f"c{i}", p, lat, kv) for i, (p, lat, kv) in enumerate(rows)]
    lim = Constraints(max_lat, max_kv)
    choice = select(preds, lim)
    chosen = next(p for p in preds if p.candidate == choice.candidate)
    feasible = [p for p in preds if lim.met(p.latency_ms, p.kv_mb)]
    assert choice.feasible == bool(feasible)
    if feasible:
        assert lim.met(chosen.latency_ms, chosen.kv_mb)
        assert chosen.p_correct == max(p.p_correct for p in feasible)
    else:
        assert chosen.kv_mb == min(p.kv_mb for p in preds)


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, True, "5", [1]])
def test_bad_limits_are_refused(bad):
    with pytest.raises(PaskError, match="max_kv_mb must be a positive"):
        Constraints(max_kv_mb=bad)
    with pytest.raises(PaskError, match="max_latency_ms must be a positive"):
        Constraints(max_latency_ms=bad)


def test_request_limits_override_server_defaults():
    base = Constraints(1000, 5)
    assert base.merged(Constraints(max_kv_mb=2)) == Constraints(1000, 2)
    assert base.merged(None) == base


# -- features -------------------------------------------------------------------------------------
def test_features_count_labels_and_runs():
    labels = [P.PROTECTED_CONTENT, P.FUNCTION_NAME, P.FUNCTION_NAME, P.SCHEMA_SCAFFOLD, P.PARAMETER_KEY,
              P.SCHEMA_SCAFFOLD, P.PARAMETER_KEY, P.FUNCTION_NAME, P.PROTECTED_CONTENT]  # fmt: skip
    f = request_features(list(range(9)), labels)
    assert tuple(f) == FEATURES
    assert f["prompt_tokens"] == 9 and f["n_function_name"] == 3 and f["n_names"] == 2 and f["n_keys"] == 2
    assert f["schema_tokens"] == 7 and f["schema_share"] == pytest.approx(7 / 9)
    plain = request_features([1, 2, 3], None)
    assert plain["n_protected_content"] == 3 and plain["schema_tokens"] == 0 and plain["n_names"] == 0
    with pytest.raises(ValueError, match="2 prompt labels for 3"):
        request_features([1, 2, 3], labels[:2])


# -- the predictor --------------------------------------------------------------------------------
CANDS = [Candidate("full"), Candidate("kivi-4", 0.33), Candidate("snapkv", 0.33)]


def _observations(n_cases: int = 80, seed: int = 0) -> list[Observation]:
    """Synthetic dev cases: Full KV is right most often, long prompts fail under SnapKV, KIVI-4 holds a third
    of the bytes."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_cases):
        prompt = int(rng.integers(100, 600))
        feats = request_features(list(range(prompt)), None)
        for c in CANDS:
            bp = {"full": 1.0, "kivi-4": 0.34, "snapkv": 0.33}[c.policy]
            p_ok = {"full": 0.95, "kivi-4": 0.75, "snapkv": 0.85 if prompt <= 350 else 0.1}[c.policy]
            correct = bool(rng.random() < p_ok)
            n = int(rng.integers(10, 40))
            out.append(Observation(c.name, feats, correct, n, 5 + 0.1 * prompt, 40 + 0.01 * prompt, bp, bp,
                                   int(12288 * (prompt + n) * bp), f"dev/{i}"))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def predictor() -> MetaPredictor:
    return fit(_observations(), CANDS, model_name="m", fingerprint="fp:1", task="sql", bytes_per_token=12288,
               batch_size=4, max_new_tokens=64, folds=3)  # fmt: skip


def test_fit_learns_the_synthetic_structure(predictor):
    feats = request_features(list(range(500)), None)
    by = {p.candidate: p for p in predictor.predict(feats)}
    assert by["snapkv@0.33"].p_correct < by["full"].p_correct - 0.3  # long prompt: SnapKV fails
    assert by["kivi-4@0.33"].kv_mb == pytest.approx(by["full"].kv_mb * 0.34, rel=0.01)
    assert by["full"].latency_ms == pytest.approx(
        5 + 50 + (by["full"].n_out - 1) * (40 + 0.01 * (500 + by["full"].n_out / 2)), rel=0.02
    )
    cv = predictor.fit["cv"]
    assert cv["folds"] == 3 and cv["n"] == 240 and cv["auc_mean"] > 0.6 and cv["mae_kv_mb"] < 0.5


def test_predictor_file_round_trip(predictor, tmp_path):
    path = tmp_path / "p.json"
    predictor.save(path)
    back = load(path, fingerprint="fp:1", task="sql")
    feats = request_features(list(range(300)), None)
    assert back.predict(feats) == predictor.predict(feats)
    assert back.names == ["full", "kivi-4@0.33", "snapkv@0.33"]


def test_predictor_for_another_model_or_task_is_refused(predictor, tmp_path):
    path = tmp_path / "p.json"
    predictor.save(path)
    with pytest.raises(PaskError, match=r"fitted for model m \(fp:1\), not this model \(fp:2\)"):
        load(path, fingerprint="fp:2")
    with pytest.raises(PaskError, match="fitted for task 'sql', not 'bfcl'"):
        load(path, task="bfcl")


@pytest.mark.parametrize(
    ("text", "match"),
    [("{", "not a MetaKV predictor file"), ('{"format": "x"}', "format 'x'"), ("[]", "format 'list'"),
     ('{"format": "pask-meta/1"}', "bad MetaKV predictor file")],
)  # fmt: skip
def test_bad_predictor_files(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(PaskError, match=match):
        load(path)
    with pytest.raises(PaskError, match="does not exist"):
        load(tmp_path / "none.json")


def test_fit_needs_every_candidate_and_both_outcomes():
    obs = [o for o in _observations(20) if o.candidate != "snapkv@0.33"]
    with pytest.raises(PaskError, match=r"no fit data for candidates \['snapkv@0.33'\]"):
        fit(obs, CANDS, model_name="m", fingerprint="f", task="sql", bytes_per_token=1, batch_size=1,
            max_new_tokens=8)  # fmt: skip


def test_auc():
    assert auc([True, False], [0.9, 0.1]) == 1.0 and auc([True, False], [0.1, 0.9]) == 0.0
    assert auc([True, False, True, False], [0.5] * 4) == 0.5 and math.isnan(auc([True], [0.3]))


# -- one running cache for every served candidate ------------------------------------------------
def test_cache_layouts_that_cannot_be_shared_are_refused(monkeypatch):
    monkeypatch.setenv("PASK_ALLOW_UNTUNED", "1")
    kivi2, kivi4 = make_policy("kivi-2", 0.2), make_policy("kivi-4", 0.33)
    assert kivi2.l2_key_bits == 2 and kivi4.l2_key_bits is None
    assert cache_key_bits({"full": None, "kivi-4": kivi4, "kivi-2": kivi2}) == 2

    class K4V2:
        l2_key_bits = 4

    with pytest.raises(PaskError, match="cannot share one running cache"):
        cache_key_bits({"kivi-2": kivi2, "pask": K4V2()})
    snap, h2o = make_policy("snapkv", 0.33), make_policy("h2o", 0.33)
    probe = MetaProbe.of({"full": None, "snapkv": snap, "kivi-4": kivi4})
    assert probe.prefill_window == snap.prefill_window and probe.name == "meta"
    with pytest.raises(PaskError, match="different windows"):
        MetaProbe.of({"snapkv": snap, "h2o": h2o})


def test_a_server_selector_suggests_candidates_that_share_a_cache(monkeypatch, predictor):
    monkeypatch.setenv("PASK_ALLOW_UNTUNED", "1")
    cands = [Candidate("full"), Candidate("snapkv", 0.33), Candidate("h2o", 0.33), Candidate("kivi-2", 0.2)]
    pred = MetaPredictor(**{**predictor.__dict__, "candidates": cands, "_models": {}})
    sel = MetaSelector(pred)
    with pytest.raises(PaskError, match=r"different windows.*e\.g\. --meta-candidates full,snapkv@0.33,kivi-2@0.2"):
        sel.probe()
    assert MetaSelector(pred, allowed=["full", "h2o@0.33"]).probe().step_attention


def test_scheduler_refuses_a_preset_policy_it_cannot_run(smol):
    from pask.runtime.scheduler import Job, Scheduler
    from pask.runtime.tokens import Request

    sch = Scheduler(smol, lambda: make_policy("kivi-4", 0.5), max_batch=2)
    try:
        job = Job("a", Request([1, 2, 3], max_new_tokens=2), policy=make_policy("snapkv", 0.5, task="sql"))
        with pytest.raises(PaskError, match="needs its prefill window"):
            sch.submit(job)
    finally:
        sch.close()


# -- eval -----------------------------------------------------------------------------------------
def _smol_predictor(smol, tmp_path) -> Path:
    pred = fit(_observations(), CANDS, model_name=smol.name, fingerprint=smol.fingerprint, task="sql",
               bytes_per_token=12288, batch_size=2, max_new_tokens=8, folds=1)  # fmt: skip
    path = tmp_path / "meta.json"
    pred.save(path)
    return path


def test_eval_meta_chooses_per_case_and_records_it(smol, tmp_path, monkeypatch):
    monkeypatch.setenv("PASK_ALLOW_UNTUNED", "1")
    from pask.evaluation.run_sql import select_cases

    cases = [c for c in select_cases("test") if c.db_id == "poker_player"][:3]
    pred = load(_smol_predictor(smol, tmp_path), smol.fingerprint, "sql")
    task = get_task("sql")
    outs = {}
    for label, limits in (("loose", Constraints()), ("tight", Constraints(max_kv_mb=0.5))):
        sel = MetaSelector(pred, limits, fingerprint=smol.fingerprint)
        out = tmp_path / label
        run_task(task, smol, cases, out, 2, 8, None, batching="continuous", selector=sel)
        outs[label] = [json.loads(x) for x in (out / "cases.jsonl").read_text().splitlines()]
    for label, rows in outs.items():
        assert len(rows) == 3 and all(r["meta"]["configuration"] in pred.names for r in rows), label
        assert all(len(r["meta"]["predictions"]) == 3 for r in rows)
    # tight memory: a compressing candidate, and the bytes it held are what it was chosen for
    tight = outs["tight"]
    assert all(r["meta"]["configuration"] != "full" for r in tight)
    assert all(r["budget"]["b_total"] < 0.6 for r in tight)
    with pytest.raises(PaskError, match="needs --batching continuous"):
        run_task(task, smol, cases, tmp_path / "x", 2, 8, None, selector=MetaSelector(pred))


def test_cli_meta_errors(tmp_path, smol):
    runner = CliRunner()
    base = ["eval", "sql", "--limit", "1", "--batching", "continuous", "--out", str(tmp_path / "o")]
    res = runner.invoke(app, [*base, "--policy", "meta"])
    assert res.exit_code == 2 and "needs --meta FILE" in res.output
    path = _smol_predictor(smol, tmp_path)
    res = runner.invoke(app, [*base, "--policy", "meta", "--meta", str(path), "--max-kv-mb", "-1"])
    assert res.exit_code == 2 and "--max-kv-mb must be a positive" in res.output
    res = runner.invoke(app, [*base, "--policy", "full", "--max-kv-mb", "2"])
    assert res.exit_code == 2 and "options of --policy meta" in res.output
    res = runner.invoke(app, [*base, "--policy", "meta", "--meta", str(path), "--batching", "static"])
    assert res.exit_code == 2 and "needs --batching continuous" in res.output
    res = runner.invoke(app, ["eval", "bfcl", "--limit", "1", "--policy", "meta", "--meta", str(path)])
    assert res.exit_code == 2 and "fitted for task 'sql', not 'bfcl'" in res.output
    res = runner.invoke(app, [*base, "--policy", "meta", "--meta", str(path), "--model", "qwen2.5-coder-0.5b"])
    assert res.exit_code == 2 and "fit a predictor for it" in res.output
    res = runner.invoke(app, ["meta", "fit", "--config", str(tmp_path / "none.toml"), "--out", str(tmp_path / "p")])
    assert res.exit_code == 2 and "does not exist" in res.output


# -- the latency lines ------------------------------------------------------------------------------
def test_timing_lines_interpolate_between_batch_sizes():
    from pask.meta.predictor import interpolate, timing_lines

    samples = [{"candidate": "full", "kind": "prefill", "batch": 1, "context": n, "ms": 2.0 * n} for n in (100, 300)]
    for b, base in ((1, 50.0), (16, 200.0)):
        for ctx in (200.0, 600.0):
            samples.append({"candidate": "full", "kind": "step", "batch": b, "context": ctx, "ms": base + 0.1 * ctx})
    lines = timing_lines(samples, ["full"])["full"]
    assert lines["prefill"] == pytest.approx([0.0, 2.0], abs=1e-6)
    assert lines["step"]["1"] == pytest.approx([50.0, 0.1]) and lines["step"]["16"] == pytest.approx([200.0, 0.1])
    assert interpolate({1: 10.0, 16: 160.0}, 8) == pytest.approx(80.0)
    assert interpolate({1: 10.0, 16: 160.0}, 32) == pytest.approx(320.0)  # the nearest two, extended
    assert interpolate({4: 7.0}, 1) == 7.0
    with pytest.raises(PaskError, match="no prefill or step samples of candidate kivi"):
        timing_lines(samples, ["kivi"])


def test_fit_with_a_timing_profile_uses_its_lines(predictor):
    samples = []
    for c in predictor.names:
        samples += [{"candidate": c, "kind": "prefill", "batch": 1, "context": n, "ms": 1.0 * n} for n in (100, 300)]
        samples += [{"candidate": c, "kind": "step", "batch": b, "context": 400, "ms": 10.0 * b} for b in (1, 16)]
    pred = fit(_observations(40), CANDS, model_name="m", fingerprint="fp:1", task="sql", bytes_per_token=12288,
               batch_size=16, max_new_tokens=64, folds=2, timing=samples)  # fmt: skip
    assert pred.latency_ms("full", 200, 11) == pytest.approx(200 + 10 * 160)
    assert pred.latency_ms("full", 200, 11, batch_size=1) == pytest.approx(200 + 10 * 10)
    assert pred.fit["timing_residuals"] == {
        "prefill_mae_ms": pytest.approx(0, abs=1e-6),
        "step_mae_ms": pytest.approx(0, abs=1e-6),
    }


def test_measure_timing_times_every_candidate(smol, tmp_path, monkeypatch):
    from pask.experiments.metakv import measure_timing

    monkeypatch.delenv("PASK_PREFILL_STORE", raising=False)
    cfg = tmp_path / "t.toml"
    cfg.write_text('results_dir = "r"\nmodels = ["smollm2-135m"]\ntasks = ["sql"]\nsplits = ["dev"]\n'
                   'policies = ["full", "kivi-4"]\nbudgets = [0.4]\n[sql]\nlimit = 6\n')  # fmt: skip
    samples = measure_timing(smol, cfg, batch_sizes=(1, 2), steps=3, group=2)
    for name in ("full", "kivi-4@0.4"):
        mine = [x for x in samples if x["candidate"] == name]
        assert sum(x["kind"] == "prefill" for x in mine) == 2 * 2  # two short and two long prompts, alone
        assert sum(x["kind"] == "step" and x["batch"] == 2 for x in mine) == 2  # one batched run per class
        assert {x["batch"] for x in mine if x["kind"] == "step"} == {1, 2}
        assert all(x["ms"] > 0 for x in mine)
    monkeypatch.setenv("PASK_PREFILL_STORE", str(tmp_path))
    with pytest.raises(PaskError, match="unset \\$PASK_PREFILL_STORE"):
        measure_timing(smol, cfg)


# -- constrained success ---------------------------------------------------------------------------
def test_csr_grid_bounds_and_oracle(predictor):
    from pask.experiments.metakv import evaluate, grid_limits, markdown

    dev, test = _observations(60, seed=1), _observations(60, seed=2)
    for o in test:
        o.case_id = o.case_id.replace("dev/", "test/")
    limits = grid_limits(predictor, dev)
    assert len(limits["latency_ms"]) == len(limits["kv_mb"]) == 5
    assert limits["kv_mb"] == sorted(limits["kv_mb"], reverse=True)  # loose to tight
    res = evaluate(predictor, dev, test, limits)
    assert len(res["grid"]) == 25 and res["n_test_cases"] == 60
    for g in res["grid"]:
        assert 0 <= g["meta"] <= g["oracle"] <= 1 and g["best_static_csr"] <= g["oracle"]
        assert sum(g["picked"].values()) == 60 and g["best_static"] in predictor.names
        assert max(g["static"].values()) <= g["oracle"]
    loosest, tightest = res["grid"][0], res["grid"][-1]
    assert loosest["oracle"] >= tightest["oracle"]
    md = markdown("sql", predictor, res)
    assert "CSR gain of MetaKV" in md and md.count("\n| ") > 50
    with pytest.raises(PaskError, match="no dev cases of the reference candidate 'h2o'"):
        grid_limits(predictor, dev, reference="h2o")
    short = [o for o in test if not (o.case_id == "test/0" and o.candidate == "full")]
    with pytest.raises(PaskError, match="lack some candidate's result"):
        evaluate(predictor, dev, short, limits)
