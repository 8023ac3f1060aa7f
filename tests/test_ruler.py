"""RULER-style tasks: seeded deterministic cases, disjoint splits, prompts sized with the tokenizer,
needles and copy items at their depths, RULER's string-match scoring, bad input, the JSON answer
grammar, and one end-to-end run on the tiny model."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from pask.errors import PaskError
from pask.evaluation.runner import run_task
from pask.runtime.tokens import eos_ids
from pask.structure.constraint import Constraint, ll_tokenizer
from pask.structure.tags import PromptLabel
from pask.tasks import Output, get_task, task_names
from pask.tasks import ruler_prompt as rp
from pask.tasks.ruler import exact_block, missing, parse_answer, score_case, summarize, table_markdown
from pask.tasks.ruler_data import (
    DEPTHS,
    SPLIT_CASES,
    SUBTASKS,
    cwe_repeats,
    make_case,
)

SHORT = [t for t in SUBTASKS if t != "copy"]  # copy needs >= 1024 tokens


@pytest.fixture(scope="module")
def ruler():
    return get_task("ruler")


def _call(case, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'give_answer', 'arguments': args})}\n</tool_call>"


def _reference_args(case) -> dict:
    if case.answer_key:
        return {case.answer_key: list(case.references)}
    return dict(line.split(": ", 1) for line in case.references)


# -- cases ----------------------------------------------------------------------------------------------------
def test_registered_with_its_options(ruler):
    assert "ruler" in task_names() and ruler.score_key == "score" and ruler.splits == ("calibration", "dev", "test")
    assert ruler.resolve_options({}) == {"tasks": list(SUBTASKS), "length": 8192, "answer_format": "auto"}
    cases = ruler.cases("test")
    assert len(cases) == SPLIT_CASES["test"] * len(SUBTASKS) == 200
    assert [ruler.group(c) for c in cases[:: SPLIT_CASES["test"]]] == list(SUBTASKS)


def test_cases_and_prompts_are_deterministic(ruler, smol_tokenizer):
    a, b = ruler.cases("dev", 3, length=1024), ruler.cases("dev", 3, length=1024)
    assert a == b and len({c.id for c in a}) == len(a) == 3 * len(SUBTASKS)
    assert ruler.cases("dev", 1, length=1024) == a[::3]  # a limit takes a prefix of each sub-task
    first = [rp.build(c, smol_tokenizer) for c in a[::3]]
    rp._FITTED.clear()  # sized again from scratch
    assert [rp.build(c, smol_tokenizer) for c in a[::3]] == first
    # the answers never depend on the length (nor on a tokenizer: cases() has none)
    for x, y in zip(ruler.cases("dev", 3, tasks=[*SUBTASKS[:5], "copy"], length=4096), a[:15] + a[-3:], strict=True):
        assert (x.references, x.inserts, x.question) == (y.references, y.inserts, y.question)
    assert [c.variant for c in a if c.task == "copy"] == ["list", "code", "record"]
    assert [c.answer_format for c in a if c.task == "copy"] == ["text", "text", "json"]  # auto
    assert {c.answer_format for c in a if c.task != "copy"} == {"text"}


def test_splits_use_disjoint_seeds(ruler):
    by_split = {s: ruler.cases(s, 25, tasks=["niah_single", "vt", "copy"]) for s in ("calibration", "dev", "test")}
    seeds = {s: {c.seed for c in cs} for s, cs in by_split.items()}
    answers = {s: {c.references for c in cs} for s, cs in by_split.items()}  # each case's whole answer
    for x, y in [("calibration", "dev"), ("calibration", "test"), ("dev", "test")]:
        assert not seeds[x] & seeds[y] and not answers[x] & answers[y]
        assert not {c.id for c in by_split[x]} & {c.id for c in by_split[y]}


@pytest.mark.parametrize("length", [256, 512, 1024, 2048])
def test_prompt_fits_the_target_length(ruler, smol_tokenizer, length):
    for case in ruler.cases("dev", 2, tasks=SHORT if length < 1024 else list(SUBTASKS), length=length):
        p = rp.build(case, smol_tokenizer)
        assert length - 16 <= len(p.ids) <= length, (case.id, len(p.ids))
        assert p.ids == smol_tokenizer(p.text, add_special_tokens=False)["input_ids"]
        assert case.question in p.text and (case.answer_format == "json" or p.text.endswith(case.answer_prefix))


def _haystack_words(context: str, inserts: list[str]) -> list[str]:
    for text in inserts:
        context = context.replace(text, " ")
    return context.split()


def test_needles_and_copy_items_sit_at_their_depths(ruler, smol_tokenizer):
    tasks = ["niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "copy"]
    for case in ruler.cases("test", 3, tasks=tasks, length=2048):
        p = rp.build(case, smol_tokenizer)
        context = p.text[p.context[0] : p.context[1]]
        texts = [t for _, t in case.inserts]
        where = [context.index(t) for t in texts]
        assert where == sorted(where)  # in order (a vt chain reads top to bottom)
        total = len(_haystack_words(context, texts))
        for depth, at in zip(case.depths, where, strict=True):
            before = len(_haystack_words(context[:at], texts))
            assert abs(before / total - depth) < 0.06, (case.id, depth, before / total)
        assert all(d in DEPTHS for d in case.depths)


def test_copy_items_are_long_and_verbatim(smol_tokenizer):
    for i in range(9):
        case = make_case("copy", "test", i, 8192)
        block = case.inserts[0][1]
        assert block.splitlines()[1:-1] == list(case.references)
        assert len(smol_tokenizer("\n".join(case.references), add_special_tokens=False)["input_ids"]) >= 150
    record = make_case("copy", "test", 2, 8192)
    keys = [line.split(": ", 1)[0] for line in record.references]
    assert record.variant == "record" and len(set(keys)) == len(keys) and not record.answer_key


def test_cwe_and_fwe_answers_are_the_most_frequent_words(smol_tokenizer):
    for length in (512, 4096):
        case = make_case("cwe", "dev", 0, length)
        p = rp.build(case, smol_tokenizer)
        listed = Counter(re.findall(r"\d+\. (\S+)", p.text[p.context[0] : p.context[1]]))
        common, uncommon = cwe_repeats(length)
        assert all(listed[w] == common for w in case.references)
        assert max(n for w, n in listed.items() if w not in case.references) == uncommon
        case = make_case("fwe", "dev", 0, length)
        p = rp.build(case, smol_tokenizer)
        counts = Counter(p.text[p.context[0] : p.context[1]].split())
        ranked = [w for w, _ in counts.most_common() if w != "..."]
        assert set(ranked[:3]) == set(case.references) and counts[ranked[2]] > counts[ranked[3]]


# -- scoring --------------------------------------------------------------------------------------------------
def test_text_scoring_right_partial_wrong():
    case = make_case("niah_multivalue", "test", 0, 4096)
    a, b, c, d = case.references
    right = score_case(case, Output(f" {a}, {b}, {c} and {d}.", "eos"))
    assert right == {"score": 1.0, "found": 4, "missing": [], "exact": None, "valid": True, "correct": True,
                     "error": None}  # fmt: skip
    partial = score_case(case, Output(f" {d} and {b}.", "eos"))
    assert (partial["score"], partial["missing"], partial["correct"]) == (0.5, [a, c], False)
    wrong = score_case(case, Output(" 1234567.", "length"))
    assert (wrong["score"], wrong["found"], wrong["correct"]) == (0.0, 0, False)
    cwe = make_case("cwe", "test", 0, 4096)
    assert score_case(cwe, Output(" ".join(w.upper() for w in cwe.references), "eos"))["score"] == 1.0  # any case
    failed = score_case(case, Output("", "schema_error", error="schema_error: x"))
    assert (failed["score"], failed["valid"], failed["error"]) == (0.0, False, "schema_error: x")


def test_copy_scoring_recall_and_exact():
    code = make_case("copy", "test", 1, 4096)
    assert code.variant == "code" and code.answer_format == "text"
    lines = list(code.references)
    fenced = "```python\n" + "\n".join(lines) + "\n```\n"
    assert score_case(code, Output(fenced, "eos"))["exact"] is True
    flat = "\n".join(x.strip() for x in lines)  # indentation lost: every line found, not exact
    assert score_case(code, Output(flat, "eos"))["score"] == 1.0 and not score_case(code, Output(flat, "eos"))["exact"]
    half = score_case(code, Output("\n".join(lines[: len(lines) // 2]), "length"))
    assert half["score"] == pytest.approx((len(lines) // 2) / len(lines), abs=1e-4) and half["exact"] is False
    items = make_case("copy", "test", 0, 4096, answer_format="json")
    assert items.variant == "list" and items.answer_format == "json"
    text = _call(items, _reference_args(items))
    good = score_case(items, Output(text, "grammar", parse_answer(text)))
    assert (good["score"], good["exact"], good["valid"], good["correct"]) == (1.0, True, True, True)
    swapped = list(items.references)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    text = _call(items, {"identifiers": swapped})
    res = score_case(items, Output(text, "grammar", parse_answer(text)))
    assert res["score"] == 1.0 and res["exact"] is False and res["correct"] is True
    shout = _call(items, {"identifiers": [x.upper() for x in items.references]})
    upper = score_case(items, Output(shout, "grammar", parse_answer(shout)))
    assert upper["score"] < 1.0 and not upper["exact"]  # copy is verbatim: case counts
    cut = text[: len(text) // 2]
    broken = score_case(items, Output(cut, "length", parse_error="tool call is not valid JSON"))
    assert broken["valid"] is False and 0 < broken["score"] < 1 and broken["error"] == "tool call is not valid JSON"
    with pytest.raises(PaskError, match="no tool call"):
        parse_answer("no call")


@settings(max_examples=40, deadline=None)
@given(st.sets(st.integers(0, 3)), st.text(alphabet="abcdefgh ,.\n", max_size=30))
def test_score_is_the_share_of_references_found(kept, filler):
    case = make_case("niah_multiquery", "dev", 1, 4096)
    refs = list(case.references)
    out = filler + filler.join(refs[i] for i in sorted(kept)) + filler
    res = score_case(case, Output(out, "eos"))
    assert res["score"] == round(len(kept) / 4, 4) and res["missing"] == [
        r for i, r in enumerate(refs) if i not in kept
    ]
    assert missing(refs, out) == res["missing"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["intro", "", "  ", "# done", "x = 1"]), max_size=4), st.integers(0, 3))
def test_exact_block_finds_the_lines_among_others(around, drop):
    refs = ["alpha_one_12", "    beta = 2", "gamma: 3", "delta"]
    answer = "\n".join([*around, *refs, *around])
    assert exact_block(refs, answer) and exact_block(refs, answer.replace("\n", "  \n"))
    assert not exact_block(refs, "\n".join([*around, *(r for i, r in enumerate(refs) if i != drop), *around]))


def test_summary_and_markdown():
    def row(task, score, variant=None, exact=None, stop="eos", valid=True):
        return {"task": task, "variant": variant, "score": score, "correct": score == 1.0, "exact": exact,
                "valid": valid, "stop_reason": stop, "budget": None}  # fmt: skip

    rows = [row("vt", 1.0), row("vt", 0.6), row("niah_single", 0.0), row("copy", 1.0, "list", True),
            row("copy", 0.5, "code", False, "length"), row("copy", 1.0, "record", False, valid=False)]  # fmt: skip
    s = summarize(rows)
    assert list(s["tasks"]) == ["niah_single", "vt", "copy"]
    assert s["tasks"]["vt"] == {"n": 2, "correct": 1, "score": 80.0, "accuracy": 50.0}
    assert s["tasks"]["copy"]["exact"] == 33.33 and s["tasks"]["copy"]["variants"]["list"]["exact"] == 100.0
    o = s["overall"]
    assert o["score"] == round((0 + 80 + 250 / 3) / 3, 2) and o["accuracy"] == 50.0 and o["n"] == 6
    assert (o["valid"], o["truncated"], o["schema_errors"]) == (5, 1, 0) and s["measured_b"] == 1.0
    md = table_markdown(s, {"model": "m", "policy": "full", "length": 4096})
    assert (
        "| Model | Method | B | niah_single | vt | copy | Avg |" in md and "| m | full | 1.000 | 0.00 | 80.00 |" in md
    )
    assert "at 4096 tokens" in md and "copy exact: 33.33% (list 100.00, code 0.00, record 0.00)" in md


# -- bad input ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options, message",
    [
        ({"tasks": ["niah_single", "nope"]}, "unknown ruler sub-task(s) nope; known: niah_single, niah_multikey"),
        ({"tasks": []}, "non-empty list"),
        ({"length": 100}, "in [256, 131072], got 100"),
        ({"length": 10**7}, "got 10000000"),
        ({"length": "long"}, "got 'long'"),
        ({"length": True}, "got True"),
        ({"length": 4096.5}, "got 4096.5"),
        ({"answer_format": "xml"}, "answer_format must be one of auto, text, json, got 'xml'"),
    ],
)
def test_bad_options(ruler, options, message):
    with pytest.raises(PaskError, match=re.escape(message)):
        ruler.cases("test", 1, **options)


def test_bad_split_limit_and_a_length_too_short(ruler, smol_tokenizer):
    with pytest.raises(PaskError, match="unknown split 'train'"):
        ruler.cases("train")
    with pytest.raises(PaskError, match="--limit must be in"):
        ruler.cases("test", 0)
    with pytest.raises(PaskError, match="has no option"):
        ruler.resolve_options({"depth": 0.5})
    assert ruler.cases("test", 1, length="4096")[0].length == 4096
    (case,) = ruler.cases("test", 1, tasks=["copy"], length=256)
    with pytest.raises(PaskError, match="ruler length 256 is too short for copy"):
        ruler.request(case, smol_tokenizer)
    with pytest.raises(PaskError, match="leak"):
        ruler.check_fit("test", ruler.resolve_options({}))


# -- requests: grammar, tagger, prompt labels -----------------------------------------------------------------
def test_json_requests_compile_accept_the_reference_and_tag(ruler, smol_tokenizer):
    tok = smol_tokenizer
    llt = ll_tokenizer(tok, eos_ids(tok))
    for case in ruler.cases("dev", 1, length=1024, answer_format="json"):
        req = ruler.request(case, tok, tagging=True)
        assert req.prompt_labels is not None and len(req.prompt_labels) == len(req.prompt_ids) <= 1024
        assert PromptLabel.FUNCTION_NAME in req.prompt_labels  # the tool's schema in the prompt
        constraint = Constraint(llt, req.grammar)
        text = _call(case, _reference_args(case))
        for t in tok(text, add_special_tokens=False)["input_ids"]:
            constraint.consume(t)
            req.tagger.step(tok.decode([t]).encode())
        assert constraint.is_accepting() and not req.tagger.degraded
        res = ruler.check(case, Output(text, "grammar", req.parse(text)))
        assert res["score"] == 1.0 and res["valid"] and res["exact"] in (None, True)
    (text_case,) = ruler.cases("dev", 1, tasks=["vt"], length=512)
    req = ruler.request(text_case, tok, tagging=True)
    assert req.grammar is None and req.tagger is None and req.parse is None
    assert set(req.prompt_labels) == {PromptLabel.PROTECTED_CONTENT} and len(req.prompt_labels) == len(req.prompt_ids)
    assert ruler.request(text_case, tok).prompt_labels is None


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 40), st.integers(1, 7), st.integers(0, 3000), st.integers(1, 5000))
def test_largest_fit_matches_brute_force(base, per_unit, target, limit):
    def count(n: int) -> int:
        return base + per_unit * n + (n * 7919 % 3)  # nearly linear, non-decreasing within a unit's slack

    def mono(n: int) -> int:
        return max(count(k) for k in range(max(0, n - 3), n + 1))

    fits = [n for n in range(limit + 1) if mono(n) <= target]
    assert rp.largest_fit(mono, target, limit) == (max(fits) if fits else None)


# -- end to end -----------------------------------------------------------------------------------------------
def test_run_task_on_the_tiny_model(ruler, smol, tmp_path):
    options = {"tasks": ["niah_single", "copy"], "length": 1024, "answer_format": "json"}
    cases = ruler.cases("dev", 1, **options)
    meta = {"model": "smol", "policy": "full", "length": 1024}
    summary = run_task(ruler, smol, cases, tmp_path, 2, 12, None, None, meta, True, **options)
    rows = [json.loads(x) for x in (tmp_path / "cases.jsonl").read_text().splitlines()]
    head = ["id", "task", "variant", "length", "answer_format", "depths", "prompt_len", "output", "score", "found"]
    assert sorted(r["id"] for r in rows) == ["copy_dev_0", "niah_single_dev_0"] and list(rows[0])[:10] == head
    for r in rows:
        assert r["prompt_len"] <= 1024 and len(r["prompt_labels"]) == r["prompt_len"] and 0 <= r["score"] <= 1
    copy = next(r for r in rows if r["task"] == "copy")
    assert copy["answer_format"] == "json" and copy["n_generated"] == 12 and copy["tags"]  # the JSON tagger ran
    assert list(summary["tasks"]) == ["niah_single", "copy"] and summary["overall"]["n"] == 2
    assert "| niah_single | copy | Avg |" in (tmp_path / "summary.md").read_text()


def test_pask_eval_ruler_on_the_command_line(tmp_path):
    from pask.cli import app

    args = ["eval", "ruler", "--model", "smollm2-135m", "--dtype", "fp32", "--threads", "1", "--limit", "1"]
    args += ["--tasks", "vt", "--length", "512", "--max-new-tokens", "4", "--out", str(tmp_path)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["run"]["tasks"] == ["vt"] and summary["run"]["length"] == 512 and summary["overall"]["n"] == 1
    assert json.loads((tmp_path / "settings.json").read_text())["options"]["length"] == 512


def test_a_sweep_config_takes_the_ruler_options(tmp_path):
    from pask.experiments.sweep import parse_config

    data = {"results_dir": str(tmp_path), "models": ["smollm2-135m"], "tasks": ["ruler"], "splits": ["dev"]}
    data["policies"] = ["full"]
    cfg = parse_config({**data, "ruler": {"tasks": ["vt", "copy"], "length": 4096, "limit": 2}}, tmp_path)
    (cell,) = cfg.cells
    assert (cell.options["tasks"], cell.options["length"], cell.options["max_new_tokens"]) == (
        ["vt", "copy"],
        4096,
        512,
    )
    with pytest.raises(PaskError, match="'tasks' must be a non-empty list"):
        parse_config({**data, "ruler": {"tasks": "vt"}}, tmp_path)
