"""A tiny end-to-end calibration on smollm2-135m: 2 cases, 2 buckets; files, resume, replay identity."""

from __future__ import annotations

import json

import pytest
import torch

from pask.calibration import load
from pask.calibration.calibrate import calibrate, report_path_for, work_dir_for
from pask.errors import PaskError


def _lines(path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
def test_tiny_calibration_writes_files_and_resumes(smol, tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "smol-bfcl.json"
    kw = dict(out=out, categories=["simple"], limit=2, batch_size=2, max_new_tokens=16)
    events: list[tuple[str, int, int]] = []

    # 1. control only (no bucket selected): enumerates the buckets
    t0 = calibrate(smol, buckets=[], **kw)
    work = work_dir_for(out)
    assert t0.calibration["this_call"]["control_batches"] == 1
    plan = json.loads((work / "buckets.json").read_text())
    names = [b["bucket"] for b in plan["buckets"]]
    assert names == [] and plan["cases"] == 2
    assert abs(sum(it["share"] for it in plan["items"]) + plan["window_share"] + plan["unmeasured_share"] - 1) < 1e-9
    pick = [f"{next(it['name'] for it in plan['items'] if it['stage'] == s)}|g{g}" for s, g in (("P", 0), ("D", 3))]

    # 2. two buckets, three actions (L, R): control reused, 2 x 2 candidates measured for V and D
    table = calibrate(smol, buckets=pick, progress=lambda *e: events.append(e), actions=("L", "R"), **kw)
    assert table.calibration["actions"] == ["H", "L", "R"] and "L2" not in table.actions.values()
    this = table.calibration["this_call"]
    assert this == {**this, "control_batches": 0, "sensitivity_candidates": 4, "distortion_candidates": 4}
    assert {e[0] for e in events} == {"control", "sensitivity", "distortion"}
    for f in ("control/cases.jsonl", "control/capture-0000.pt", "control/batches.json", "buckets.json"):
        assert (work / f).exists(), f
    assert _lines(work / "sensitivity.jsonl") == 4 and _lines(work / "distortion.jsonl") == 4
    assert len(list((work / "sensitivity").iterdir())) == 4
    back = load(out, fingerprint=smol.fingerprint)
    assert back.actions == table.actions and back.target_b == 0.33
    measured = {b["bucket"] for b in back.calibration["buckets"]}
    assert measured == set(pick)
    assert all(k.endswith(("|g0", "|g3")) for k in back.actions)
    for rec in map(json.loads, (work / "distortion.jsonl").read_text().splitlines()):
        assert rec["d"] >= 0 and rec["steps"] > 0
        g = int(rec["bucket"].rsplit("|g", 1)[1])
        assert all(x == 0 for x in rec["d_per_group"][:g])  # earlier layers cannot see the probe
    report = report_path_for(out).read_text()
    assert "Table 15 layout" in report and "Table 16 layout" in report and "Mismatch 20,50" in report

    # 3. rerun: nothing recomputed
    again = calibrate(smol, buckets=pick, actions=("R", "L"), **kw)
    this = again.calibration["this_call"]
    assert (this["control_batches"], this["sensitivity_candidates"], this["distortion_candidates"]) == (0, 0, 0)
    assert _lines(work / "sensitivity.jsonl") == 4 and _lines(work / "distortion.jsonl") == 4
    assert again.actions == table.actions

    # 4. four actions (the default): only the two INT2 candidates are new
    four = calibrate(smol, buckets=pick, **kw)
    this = four.calibration["this_call"]
    assert (this["sensitivity_candidates"], this["distortion_candidates"]) == (2, 2)
    assert four.calibration["actions"] == ["H", "L", "L2", "R"]
    assert all("L2" in b["V"] and "L2" in b["D"] for b in four.calibration["buckets"])
    assert "V(L2)" in report_path_for(out).read_text()
    with pytest.raises(PaskError, match="include L"):
        calibrate(smol, buckets=pick, actions=("L2", "R"), **kw)


@pytest.mark.slow
def test_all_h_replay_reproduces_the_control_captures(smol, tmp_path, monkeypatch):
    """Teacher-forced replay on the tiered cache = the control's forward passes (D of all-H is 0),
    also when the replay's prefill is loaded from the prefill store (no prefill forward to skip)."""
    from pask.calibration.control import all_h_policy, run_control
    from pask.calibration.distortion import DistortionSum, forced_capture
    from pask.runtime.prefill_store import ENV
    from pask.tasks.function_calling import load_cases

    torch.set_num_threads(1)
    cases = load_cases(["simple"], split="calibration", limit=2)
    ctrl = run_control(smol, cases, tmp_path, batch_size=2, max_new_tokens=16)
    (batch,) = ctrl.batches
    rows = [ctrl.by_id[i] for i in batch]
    full = ctrl.load_capture(batch)
    for store in (None, "fill", "hit"):
        if store is not None:
            monkeypatch.setenv(ENV, str(tmp_path / "store"))
        probe = forced_capture(
            smol.model,
            [ctrl.prompts[r.id] for r in rows],
            [r.token_ids[: r.n_fed] for r in rows],
            all_h_policy(smol.fingerprint, 4, 8),
            [r.tags for r in rows],
            [r.prompt_labels for r in rows],
        )
        acc = DistortionSum(smol.num_layers)
        for r, p in zip(rows, probe, strict=True):
            assert p.shape == full[r.id].shape == (r.n_fed, smol.num_layers, smol.model.config.hidden_size)
            acc.add(p, full[r.id])
        assert acc.result(0, 4)["d_all"] < 1e-6, store
    assert len(list((tmp_path / "store").rglob("*.pt"))) == len(rows)


def _first_decode_item(smol, kw: dict) -> str:
    """Run the control only (no bucket probed) into ``kw["out"]``'s work dir; the plan's first decode item."""
    calibrate(smol, buckets=[], **kw)
    plan = json.loads((work_dir_for(kw["out"]) / "buckets.json").read_text())
    return next(it["name"] for it in plan["items"] if it["stage"] == "D")


@pytest.mark.slow
def test_pooled_calibration_probes_each_item_once_in_every_group(smol, tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "pooled.json"
    kw = dict(out=out, categories=["simple"], limit=2, batch_size=2, max_new_tokens=24)
    item = _first_decode_item(smol, kw)
    pick = [f"{item}|g1", f"{item}|g3"]
    table = calibrate(smol, buckets=pick, pool_groups=True, **kw)
    assert table.calibration["pool_groups"] is True
    meta = table.calibration  # 2 cases: V moves in steps of 1/2, finer tolerances are unmeasurable
    assert meta["v_resolution"] == 0.5 and meta["alpha_p_effective"] > 0.5 and table.alpha_p == 0.02
    assert meta["unmeasurable_tolerances"] == ["alpha_d", "alpha_p"] and meta["calibration_wall_s"] > 0
    recs = [json.loads(x) for x in (work_dir_for(out) / "distortion.jsonl").read_text().splitlines()]
    assert sorted((r["bucket"], r["action"]) for r in recs) == [(f"{item}|all", a) for a in ("L", "L2", "R")]
    by = {b["bucket"]: b for b in table.calibration["buckets"]}
    assert set(by) == set(pick)
    r_rec = next(r for r in recs if r["action"] == "R")
    assert by[pick[0]]["V"] == by[pick[1]]["V"]  # one pooled V per item
    assert by[pick[0]]["D"]["R"] == r_rec["d_per_group"][1] and by[pick[1]]["D"]["R"] == r_rec["d_per_group"][3]
    report = report_path_for(out).read_text()
    assert "Pooled calibration" in report and "Not measurable at this resolution: alpha_d, alpha_p" in report
    assert "Unpooled 6-candidate scan" in report  # 2 buckets x 3 lossy actions


@pytest.mark.slow
def test_sql_calibration_runs_through_the_same_machinery(smol, tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "smol-sql.json"
    kw = dict(task="sql", out=out, limit=2, batch_size=2, max_new_tokens=24)
    calibrate(smol, buckets=[], **kw)
    plan = json.loads((work_dir_for(out) / "buckets.json").read_text())
    items = [it["name"] for it in plan["items"]]
    assert "P|protected_content" in items and "P|schema_scaffold" in items, items  # the SQL prompt labeller ran
    pick = ["P|schema_scaffold|g2"]
    table = calibrate(smol, buckets=pick, pool_groups=True, **kw)
    assert table.task == "sql" and table.calibration["cases"] == 2
    assert {b["bucket"] for b in table.calibration["buckets"]} == set(pick)
    rows = (work_dir_for(out) / "control" / "cases.jsonl").read_text().splitlines()
    assert len(rows) == 2 and all("db_id" in json.loads(r) for r in rows)


@pytest.mark.slow
def test_allowed_distortion_scope_measures_only_what_the_floors_allow(smol, tmp_path, monkeypatch):
    """``distortion_scope="allowed"``: Runtime-D runs only for actions at or above each bucket's floor."""
    import pask.calibration.calibrate as cal

    torch.set_num_threads(1)
    out = tmp_path / "scope.json"
    kw = dict(out=out, categories=["simple"], limit=2, batch_size=2, max_new_tokens=16, pool_groups=True)
    calibrate(smol, buckets=[], **kw)  # the control run only
    plan = json.loads((work_dir_for(out) / "buckets.json").read_text())
    a, b = (it["name"] for it in plan["items"][:2])
    fake_v = {(f"{a}|all", "L"): 0.0, (f"{a}|all", "R"): 0.9, (f"{b}|all", "L"): 0.9, (f"{b}|all", "R"): 0.9}
    recs = {c: {"v": v, "wall_s": 0.0} for c, v in fake_v.items()}
    monkeypatch.setattr(cal, "run_sensitivity", lambda *args, **kws: (recs, 0))
    seen: list = []

    def fake_distortion(lm, control, plan, cands, *args, **kws):
        seen.extend(cands)
        return {c: {"d": 0.1, "d_per_group": [0.1] * 4, "wall_s": 0.0} for c in cands}, len(cands)

    monkeypatch.setattr(cal, "run_distortion", fake_distortion)
    table = calibrate(smol, buckets=[f"{a}|g0", f"{b}|g0"], distortion_scope="allowed", **kw)
    assert seen == [(f"{a}|all", "L")]  # a: floor L (R too harmful at tolerance 0.5); b: floor H, nothing to rank
    assert table.calibration["distortion_scope"] == "allowed"
    with pytest.raises(PaskError, match="distortion scope"):
        calibrate(smol, buckets=[f"{a}|g0"], distortion_scope="some", **kw)
    # a target below the floors with fit="sensitivity": relaxed actions sit below the floors, so
    # Runtime-D covers every candidate whatever the scope says
    seen.clear()
    kw["budget"] = 0.01
    fitted = calibrate(smol, buckets=[f"{a}|g0", f"{b}|g0"], distortion_scope="allowed", fit="sensitivity", **kw)
    assert sorted(seen) == sorted((f"{x}|all", act) for x in (a, b) for act in ("L", "L2", "R"))
    meta = fitted.calibration
    assert meta["fit"] == "sensitivity" and meta["envelope"] == "chain" and meta["feasible"] is False
    assert meta["relaxed"] and all(r["bucket"] in (f"{a}|g0", f"{b}|g0") for r in meta["relaxed"])
    # the dev check's offset: the solver aims lower, the table keeps its budget
    seen.clear()
    offset = calibrate(smol, buckets=[f"{a}|g0", f"{b}|g0"], fit="sensitivity", b_offset=-0.5, **kw)
    assert offset.target_b == 0.01 and offset.calibration["solver_target_b"] == pytest.approx(0.51)
    assert offset.calibration["b_offset"] == -0.5
    with pytest.raises(PaskError, match="outside"):
        calibrate(smol, buckets=[f"{a}|g0"], b_offset=0.5, **kw)
    with pytest.raises(PaskError, match="fit must be"):
        calibrate(smol, buckets=[f"{a}|g0"], fit="budget", **kw)
    with pytest.raises(PaskError, match="envelope must be"):
        calibrate(smol, buckets=[f"{a}|g0"], envelope_kind="tree", **kw)


def _capture_with(steps):
    from pask.calibration.distortion import AttnCapture

    cap = AttnCapture.__new__(AttnCapture)
    cap.projs = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]  # two layers, hidden 2
    cap.steps = steps
    return cap


def test_capture_per_row_follows_rows_leaving_the_batch():
    """Continuous decoding drops finished rows from the batch: row r's place is its rank among the
    rows still decoding (rows 0..2 decode 3, 1 and 2 steps here)."""

    def step(ids):  # each captured row holds its row id, so misalignment shows
        x = torch.tensor([[float(i), float(i)] for i in ids])
        return [x, x + 10]

    cap = _capture_with([step([0, 1, 2]), step([0, 2]), step([0])])
    out = cap.per_row([3, 1, 2])
    assert [o.shape[0] for o in out] == [3, 1, 2]
    for r, o in enumerate(out):
        assert bool((o[:, 0, :] == r).all()) and bool((o[:, 1, :] == r + 10).all())
    full = _capture_with([step([0, 1, 2]), step([0, 1, 2])]).per_row([2, 1, 2])  # finished rows stayed
    assert [float(o[-1, 0, 0]) for o in full] == [0.0, 1.0, 2.0]
    with pytest.raises(RuntimeError, match="captured 2 rows"):
        _capture_with([step([0, 1, 2]), step([0, 1])]).per_row([2, 2, 2])


@pytest.mark.slow
def test_a_finished_work_dir_resolves_without_its_captures(smol, tmp_path):
    """Captures are large and not committed: re-solving a finished work dir at another budget must
    not run the control again; a replay still to run makes the captures it needs again, by
    teacher-forcing the recorded tokens: the rows stay as they were and the capture matches."""
    torch.set_num_threads(1)
    out = tmp_path / "t.json"
    kw = dict(out=out, categories=["simple"], limit=2, batch_size=2, max_new_tokens=24)
    item = _first_decode_item(smol, kw)
    calibrate(smol, buckets=[f"{item}|g0"], pool_groups=True, **kw)
    ctrl = work_dir_for(out) / "control"
    rows = (ctrl / "cases.jsonl").read_text()
    before = {p.name: torch.load(p) for p in ctrl.glob("capture-*.pt")}
    for p in ctrl.glob("capture-*.pt"):
        p.unlink()
    table = calibrate(smol, buckets=[f"{item}|g0"], pool_groups=True, budget=0.5, **kw)
    assert table.target_b == 0.5 and (ctrl / "cases.jsonl").read_text() == rows
    assert not list(ctrl.glob("capture-*.pt"))
    (work_dir_for(out) / "distortion.jsonl").unlink()
    calibrate(smol, buckets=[f"{item}|g0"], pool_groups=True, budget=0.5, **kw)
    remade = list(ctrl.glob("capture-*.pt"))
    assert len(remade) == 1 and (ctrl / "cases.jsonl").read_text() == rows  # no row generated again
    got, want = torch.load(remade[0]), before[remade[0].name]
    assert got.keys() == want.keys()
    for i in want:
        assert got[i].shape == want[i].shape
        torch.testing.assert_close(got[i], want[i], rtol=1e-4, atol=1e-4)
