"""Decode loop: cached decoding is exact (fp32), batching does not change greedy outputs."""

from __future__ import annotations

import torch

from pask.runtime.engine import Request, generate


def _prompt(lm, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    return lm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_cached_decoding_matches_full_recompute(smol):
    """fp32: logits with the KV cache equal a full forward over the whole prefix, 32 steps."""
    from transformers import DynamicCache

    model = smol.model
    ids = torch.tensor([_prompt(smol, "Write a short poem about the sea.")])
    cache = DynamicCache()
    with torch.inference_mode():
        out = model(input_ids=ids, cache=cache, use_cache=True)
        seq = ids
        worst = 0.0
        for _ in range(32):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            out = model(input_ids=nxt, cache=cache, use_cache=True)
            full = model(input_ids=seq).logits[:, -1]
            worst = max(worst, (out.logits[:, -1] - full).abs().max().item())
    assert worst <= 1e-4, worst


def test_batched_generation_equals_single(smol):
    """Left-padded batches give the same greedy tokens as one request at a time."""
    prompts = [_prompt(smol, t) for t in ("Hi!", "Name three prime numbers and explain why they are prime.")]
    single = [generate(smol, [Request(p, max_new_tokens=12)])[0].token_ids for p in prompts]
    batched = [g.token_ids for g in generate(smol, [Request(p, max_new_tokens=12) for p in prompts])]
    assert batched == single
    assert all(len(t) > 0 for t in single)


def test_generation_reports_timings_and_stop(smol):
    (g,) = generate(smol, [Request(_prompt(smol, "Count to three."), max_new_tokens=5)])
    assert g.stop_reason in {"eos", "length"}
    assert len(g.token_ids) <= 5
    assert g.prefill_ms > 0 and g.tpot_ms >= 0
    assert g.prompt_len > 0


def test_policy_run_reports_measured_budget_and_keeps_grammar(smol):
    """A tiered policy through the engine: constrained output stays valid, budget is measured per request."""
    from pask.evaluation.run_bfcl import prepare, schema_valid
    from pask.policies import StaticMixPolicy
    from pask.tasks.function_calling import load_cases

    cases = load_cases(["simple"], split="test", limit=2)
    reqs = [prepare(smol, c, 48)[0] for c in cases]
    gens = generate(smol, reqs, policy=StaticMixPolicy(0.2, 0.4, 0.4))
    for c, g in zip(cases, gens, strict=True):
        b = g.extra["budget"]
        assert 0.2 < b["b_prompt"] < 0.5 and 0 < b["b_total"] < 1
        assert set(b) >= {"b_prompt", "b_decode", "b_total", "b_total_avg", "held_bytes"}
        if g.stop_reason != "length":
            assert schema_valid(c, g.text) is None
    assert smol.model.config._attn_implementation == "sdpa"  # restored after the batch


def test_requests_close_their_structure_before_the_token_limit(smol):
    """Near max_new_tokens the engine picks legal closing tokens: outputs parse instead of being cut."""
    from pask.evaluation.run_bfcl import prepare, schema_valid
    from pask.tasks.function_calling import load_cases

    cases = load_cases(["simple", "parallel"], split="test", limit=2)
    reqs = []
    for c in cases:
        req = prepare(smol, c, 64)[0]
        req.close_margin = 40  # force the closing phase early
        reqs.append(req)
    for c, g in zip(cases, generate(smol, reqs), strict=True):
        assert g.stop_reason in {"eos", "grammar"}, g.text
        assert schema_valid(c, g.text) is None, g.text


def test_resume_drops_a_torn_last_line(tmp_path):
    from pask.evaluation.case_rows import read_done, repair_jsonl

    path = tmp_path / "cases.jsonl"
    path.write_text('{"id": "a"}\n{"id": "b", "out')  # killed mid-write
    repair_jsonl(path)
    with open(path, "a") as f:
        f.write('{"id": "c"}\n')
    assert list(read_done(path)) == ["a", "c"]
    repair_jsonl(tmp_path / "missing.jsonl")  # nothing to repair


def test_sql_closing_phase_does_not_loop_on_newlines(smol):
    """A newline is legal almost anywhere in SQL: the closing phase must not spend the allowance on it."""
    from pask.evaluation.run_sql import prepare, select_cases

    cases = select_cases("test", limit=2)
    reqs = []
    for c in cases:
        req = prepare(smol, c, 40)[0]
        req.close_margin = 36  # closing from the 5th token on
        reqs.append(req)
    nl = smol.tokenizer("\n", add_special_tokens=False)["input_ids"][0]
    for g in generate(smol, reqs):
        ids = g.token_ids
        assert not any(ids[k] == ids[k + 1] == ids[k + 2] == nl for k in range(len(ids) - 2)), g.text


def test_the_closing_phase_takes_at_most_half_a_small_allowance():
    """--max-new-tokens 96 once closed the query from its first token ('SELECT "}}"'): the default
    margin (128) is at most half the allowance; a margin given is kept."""
    from pask.runtime.tokens import Request

    assert Request([1], max_new_tokens=96).closing_from == 48
    assert Request([1], max_new_tokens=256).closing_from == 128
    assert Request([1], max_new_tokens=1000).closing_from == 872
    assert Request([1], max_new_tokens=40, close_margin=36).closing_from == 4
    assert Request([1], max_new_tokens=40, close_margin=0).closing_from == 40
