"""FrozenTable file: round trip, fingerprint checks, calibration transfer, format version."""

from __future__ import annotations

import json

import pytest

from pask.errors import PaskError
from pask.kv.actions import Action
from pask.policies.table import FORMAT_VERSION, FrozenTable, load
from pask.structure.tags import Bucket, JsonRole, Next, PromptLabel, State, Tag, TagClass

TAG = Tag(TagClass.SCHEMA_BEARING, JsonRole.REQUIRED, State.CRITICAL, Next.LOOKAHEAD_CRITICAL)


def _table(**kw) -> FrozenTable:
    acts = {str(Bucket(PromptLabel.SCHEMA_SCAFFOLD, 0)): "R", str(Bucket(TAG, 3)): "L"}
    return FrozenTable(
        acts,
        "llama-L30-H576:abc",
        model_name="smollm2-135m",
        target_b=0.33,
        expected_b=0.31,
        calibration={"cases": 2, "split": "calibration", "V": {"x": 0.01}},
        **kw,
    )


def test_round_trip(tmp_path):
    t = _table()
    path = t.save(tmp_path / "t.json")
    back = load(path, fingerprint="llama-L30-H576:abc")
    assert back.actions == t.actions and back.fingerprint == t.fingerprint
    assert back.target_b == 0.33 and back.expected_b == 0.31 and back.calibration == t.calibration
    assert (back.alpha_d, back.alpha_p, back.num_groups, back.recent_window) == (0.05, 0.02, 4, 8)
    assert back.warnings == []
    data = json.loads(path.read_text())
    assert data["format_version"] == FORMAT_VERSION and data["tolerances"] == {"alpha_D": 0.05, "alpha_P": 0.02}
    assert data["model"] == {"name": "smollm2-135m", "fingerprint": "llama-L30-H576:abc"}


def test_lookup_and_default():
    t = _table()
    assert t.action(Bucket(PromptLabel.SCHEMA_SCAFFOLD, 0)) == Action.R
    assert t.action(Bucket(TAG, 3)) == Action.L
    assert t.action(Bucket(TAG, 0)) == Action.H  # not listed: default
    assert _table(default_action="L").action(Bucket(TAG, 0)) == Action.L


def test_other_model_is_refused(tmp_path):
    path = _table().save(tmp_path / "t.json")
    with pytest.raises(PaskError, match="calibrated on model smollm2-135m"):
        load(path, fingerprint="qwen2-L24-H896:def")


def test_transfer_allowed_records_warning(tmp_path):
    path = _table().save(tmp_path / "t.json")
    with pytest.warns(UserWarning, match="calibration transfer"):
        t = load(path, fingerprint="qwen2-L24-H896:def", allow_transfer=True)
    assert t.warnings and "qwen2-L24-H896:def" in t.warnings[0]
    assert t.actions == _table().actions


def test_infeasible_table_loads_with_a_warning(tmp_path):
    t = _table()
    t.calibration = {**t.calibration, "feasible": False}
    t.expected_b = 0.566
    path = t.save(tmp_path / "t.json")
    with pytest.warns(UserWarning, match="infeasible table"):
        back = load(path)
    assert back.warnings == [w for w in back.warnings if "B = 0.566" in w] and back.warnings
    ok = _table().save(tmp_path / "ok.json")  # feasible (or unknown): no warning
    assert load(ok).warnings == []
    t.calibration = {**t.calibration, "fitted": True}  # relaxed floors reach the target: no warning
    t.expected_b = t.target_b
    assert load(t.save(tmp_path / "fitted.json")).warnings == []


def test_bad_format_version(tmp_path):
    path = _table().save(tmp_path / "t.json")
    data = json.loads(path.read_text())
    data["format_version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(PaskError, match="format_version 99"):
        load(path)


@pytest.mark.parametrize(
    "patch, match",
    [
        ({"actions": {"P|schema_scaffold|g0": "X"}}, "bad action"),
        ({"actions": {"P|nonsense|g0": "R"}}, "bad bucket"),
        ({"actions": {"P|schema_scaffold|g7": "R"}}, "group 7"),
        ({"model": {}}, "missing"),
    ],
)
def test_malformed_tables(tmp_path, patch, match):
    data = _table().to_json() | patch
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PaskError, match=match):
        load(path)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(PaskError, match="does not exist"):
        load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(PaskError, match="not valid JSON"):
        load(tmp_path / "bad.json")
