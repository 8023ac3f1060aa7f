"""The hostile-mix soak of ``pask bench serve``: malformed bodies get 4xx, valid requests 200 with
well-formed outputs, every cancelled or disconnected request's KV rows are freed on the server,
nothing is held at the end; and the checker catches a server that does not free them."""

from __future__ import annotations

import itertools

import pytest
from typer.testing import CliRunner

from pask.bench.serving import MIX_KINDS, BenchConfig, bench_serve, markdown, parse_mix, request_kinds
from pask.cli import app
from pask.errors import PaskError
from pask.policies import FullPolicy

QUARTERS = {"valid": 0.25, "malformed": 0.25, "cancel": 0.25, "disconnect": 0.25}


def test_parse_mix_and_seeded_kinds():
    assert parse_mix("valid=0.7,malformed=0.1,cancel=0.1,disconnect=0.1") == {
        "valid": 0.7,
        "malformed": 0.1,
        "cancel": 0.1,
        "disconnect": 0.1,
    }
    assert parse_mix(" cancel = 1 ") == {"valid": 0.0, "malformed": 0.0, "cancel": 1.0, "disconnect": 0.0}
    assert BenchConfig().mix == {"valid": 1.0, "malformed": 0.0, "cancel": 0.0, "disconnect": 0.0}
    assert not BenchConfig().hostile and BenchConfig(mix=QUARTERS).hostile
    for bad, words in [
        ("valid=0.5,evil=0.5", "unknown kind 'evil'"),
        ("valid=1.2,cancel=-0.2", "must be a number >= 0"),
        ("valid=0.7,cancel=0.2", "sum to 1, they sum to 0.9"),
        ("valid=lots", "must be a number"),
        ("valid=nan", "must be a number >= 0"),
        ("valid=0.5,valid=0.5", "given twice"),
        ("valid", "KIND=FRACTION"),
        ("", "no KIND=FRACTION"),
    ]:
        with pytest.raises(PaskError, match="--mix") as e:
            parse_mix(bad)
        assert words in str(e.value), (bad, str(e.value))
    with pytest.raises(PaskError, match="unknown kind"):
        BenchConfig(mix={"valid": 0.5, "slow": 0.5})
    cfg = BenchConfig(mix=QUARTERS, seed=3)
    first = [list(itertools.islice(request_kinds(cfg, k), 50)) for k in range(4)]
    assert first == [list(itertools.islice(request_kinds(cfg, k), 50)) for k in range(4)]  # reproducible
    assert first[0] != first[1] and {x for xs in first for x in xs} == set(MIX_KINDS)


def test_cli_rejects_zero_rounds():
    res = CliRunner().invoke(app, ["bench", "serve", "--rounds", "0", "--model", "smollm2-135m"])
    assert res.exit_code == 2 and "Traceback" not in res.output and "--rounds" in res.output


@pytest.mark.parametrize(
    "mix, words",
    [
        ("valid=0.9,bogus=0.1", "unknown kind 'bogus'"),
        ("valid=1.1,cancel=-0.1", "must be a number >= 0"),
        ("valid=0.5,cancel=0.1", "must sum to 1"),
    ],
)
def test_cli_rejects_a_bad_mix(mix, words):
    res = CliRunner().invoke(app, ["bench", "serve", "--mix", mix, "--model", "smollm2-135m"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "--mix" in res.output and words in " ".join(res.output.split()), res.output


def _run(smol, cfg: BenchConfig) -> dict:
    (row,) = bench_serve(smol, {"full": FullPolicy}, cfg)["policies"]
    return row


def test_hostile_mix_frees_every_cancelled_request(smol):
    cfg = BenchConfig(
        concurrency=4,
        input_len=64,
        output_len=8,
        requests_per_client=3,
        sample_every=0.05,
        mix=QUARTERS,
        abort_within=0.3,
        release_timeout=30,
    )
    row = _run(smol, cfg)
    mix = row["mix"]
    kinds = mix["kinds"]
    expected = [x for k in range(4) for x in itertools.islice(request_kinds(cfg, k), 3)]
    assert {k: kinds[k]["sent"] for k in MIX_KINDS} == {k: expected.count(k) for k in MIX_KINDS}
    assert all(kinds[k]["sent"] for k in MIX_KINDS)  # seed 0 sends every kind
    assert kinds["malformed"]["sent"] == kinds["malformed"].get("4xx") and mix["malformed_not_4xx"] == 0
    assert all(set(c) <= {"400", "404", "413", "415"} for c in mix["malformed_variants"].values())
    assert kinds["valid"]["sent"] == kinds["valid"]["2xx"] == row["requests"] and row["malformed"] == 0
    assert mix["errors_5xx_all"] == mix["errors_5xx_valid"] == 0 and not mix["unexpected"]
    rel = mix["release"]
    closed = sum(kinds["cancel"].get(k, 0) for k in ("closed_after_chunks", "closed_after_delay"))
    assert rel["checked"] == closed + kinds["disconnect"].get("closed", 0) > 0
    assert set(rel["verdicts"]) <= {"cancelled", "done_before_close", "raced", "no_job"}
    assert rel["verdicts"].get("cancelled") and rel["max_release_s"] < 30 and rel["max_residual_bytes"] == 0
    assert mix["end"] == {k: 0 for k in mix["end"]}
    by = {c["criterion"]: c["pass"] for c in mix["criteria"]}
    assert len(by) == 7 and row["memory"]["rss_growth"] is not None
    assert all(by[c] for c in by if not c.startswith("RSS")) and mix["passed"] == by[next(c for c in by if "RSS" in c)]
    text = markdown({"model": "m", "config": {**cfg.__dict__}, "policies": [row]})
    assert "Hostile mix, full" in text and "| KV freed after each cancelled / disconnected request |" in text


def test_the_checker_catches_a_server_that_keeps_cancelled_rows(smol, monkeypatch):
    """With cancellation turned off in the worker, closed requests keep decoding: the checker must say so."""
    from pask.serving.worker import Worker

    monkeypatch.setattr(Worker, "cancel", lambda self, job_id, reason="cancelled": None)
    cfg = BenchConfig(
        concurrency=2,
        input_len=64,
        output_len=64,
        requests_per_client=2,
        mix={"cancel": 0.5, "disconnect": 0.5},
        abort_within=0.2,
        release_timeout=0.5,
    )
    mix = _run(smol, cfg)["mix"]
    rel = mix["release"]
    assert rel["checked"] >= 2 and rel["failed"] and rel["max_residual_bytes"] > 0
    assert rel["verdicts"].get("held", 0) + rel["verdicts"].get("ran_on", 0) == len(rel["failed"])
    kv = next(c for c in mix["criteria"] if c["criterion"].startswith("KV freed"))
    assert kv["pass"] is False and "not freed" in kv["value"] and not mix["passed"]


def test_bench_serve_refuses_another_models_table_unless_transfer_is_allowed(smol, monkeypatch, tmp_path):
    """A PASK table of another model (here: qwen's, served on smollm2-135m; the same holds for a table
    calibrated on bf16 weights served with --weights int8): exit 2 naming the flag, before any run;
    with --allow-transfer the policy is built."""
    import pask.cli
    from pask.policies.table import default_table

    table = default_table("qwen2.5-coder-0.5b", "bfcl", 0.33)
    monkeypatch.setattr(pask.cli, "_serving_model", lambda model, dtype, weights: smol)
    built = []
    monkeypatch.setattr("pask.bench.serving.bench_serve", lambda *a, **k: built.append(a[1]) or {"policies": []})
    args = ["bench", "serve", "--model", "smollm2-135m", "--policies", "pask", "--no-reference", "--table", str(table)]
    args += ["--out", str(tmp_path / "r"), "--allow-dirty"]
    res = CliRunner().invoke(app, args)
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "not on this model" in text and "--allow-transfer" in text, text
    res = CliRunner().invoke(app, [*args, "--allow-transfer"])
    assert built and set(built[0]) == {"pask"}, res.output
