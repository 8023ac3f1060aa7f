"""KVFetch's recall channel (pask.policies.kvfetch) on hand-built token sequences and a real
TieredCache (fp32, no model): the read pointer, the prefetch, iso-budget, and bad configurations."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

from pask.errors import PaskError
from pask.kv import Action, CacheConfig, CostModel, TieredCache
from pask.policies import SnapKVPolicy
from pask.policies._common import keep_count, release_to_count, with_generated
from pask.policies.base import PolicyBase, with_key_bits
from pask.policies.kvfetch import FetchPolicy, advance, best_candidate, prompt_index, successor_first
from pask.runtime.session import decide_row

HKV, D, LAYERS = 2, 64, 4
P = 400
SPAN = range(200, 260)  # the span the "model" copies


class KeepSet(PolicyBase):
    """A content-free inner policy: ranks the prompt by a fixed priority (``favour`` first, then
    earlier positions) and holds ``round(budget · n)`` tokens, generated tokens first."""

    name = "keepset"

    def __init__(self, budget: float, favour: list[int]):
        self.budget = budget
        self.favour = favour

    def prefill_actions(self, ctx):
        return self.step_actions(ctx)

    def step_actions(self, ctx):
        pr = -torch.arange(ctx.prompt_len, dtype=torch.float64) / ctx.prompt_len
        pr[self.favour] += 10.0
        pr = with_generated(pr.expand(ctx.num_groups, -1).clone(), ctx.length)
        return release_to_count(ctx, pr, keep_count(self.budget, ctx.length))


def prompt_tokens(seed: int = 0) -> list[int]:
    """Random ids, except that the copied span holds distinct ids no other position has."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 900, (P,), generator=g)
    ids[SPAN.start : SPAN.stop] = torch.arange(900, 900 + len(SPAN))
    return ids.tolist()


class Run:
    """A cache of one row fed ``P`` prompt tokens, driven by ``policy`` through the session's decide_row."""

    def __init__(self, policy, tokens: list[int], cold_bits: int = 2):
        cfg = LlamaConfig(
            hidden_size=4 * D, num_attention_heads=4, num_key_value_heads=HKV, head_dim=D,
            num_hidden_layers=LAYERS, intermediate_size=64, vocab_size=1024,
        )  # fmt: skip
        self.cache = TieredCache(cfg, with_key_bits(CacheConfig(num_groups=2, recent_window=8), policy), 1)
        self.costs = CostModel(D, 32, torch.float32)
        self.policy = policy
        self.tokens = list(tokens)
        self.g = torch.Generator().manual_seed(1)
        self._feed(len(tokens))
        self.decided = decide_row(self.cache, 0, policy.prefill_actions, 0, self.tokens, [], None, self.costs)

    def _feed(self, n: int) -> None:
        for layer in range(LAYERS):
            k = torch.randn(1, HKV, n, D, generator=self.g)
            self.cache.update(k, torch.randn(1, HKV, n, D, generator=self.g), layer)

    def step(self, token: int, tags=None) -> None:
        self._feed(1)
        self.tokens.append(token)
        self.decided = decide_row(
            self.cache, 0, self.policy.step_actions, self.decided, self.tokens, tags or [], None, self.costs
        )

    def held(self, group: int) -> set[int]:
        t = self.cache.tiers(0, group)
        return set(torch.nonzero(t != int(Action.R)).squeeze(1).tolist())

    def budget(self) -> float:
        held, full = self.cache.budget_bytes(live_only=True)
        return sum(held) / sum(full)

    def balance_share(self) -> float:
        """B's share of the key balance vectors (fixed bytes per layer once a low-bit tier is written)."""
        held = sum(layer.seqs[0].balance_bytes() for layer in self.cache.layers)
        return held / sum(self.cache.budget_bytes(live_only=True)[1])


def test_pointer_helpers_on_a_copy():
    prompt = torch.tensor([5, 1, 2, 3, 4, 1, 2, 9])
    index = prompt_index(prompt)
    assert index[1].tolist() == [1, 5] and index[2].tolist() == [2, 6]
    cands, runs = torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    for tok in (1, 2, 3):
        cands, runs = advance(prompt, index, cands, runs, tok)
    assert best_candidate(cands, runs) == (3, 3)  # the run 1, 2, 3 ends at position 3
    cands, runs = advance(prompt, index, cands, runs, 7)  # a token found nowhere: every candidate is lost
    assert best_candidate(cands, runs) is None


def test_successor_first_orders_by_distance_after_a_held_token():
    held = torch.zeros(20, dtype=torch.bool)
    held[[2, 10]] = True
    cands = torch.tensor([1, 3, 4, 9, 11, 12, 19])
    # gaps: 1 -> none before (largest), 3 -> 1, 4 -> 2, 9 -> 7, 11 -> 1, 12 -> 2, 19 -> 9
    assert successor_first(cands, held).tolist() == [3, 11, 4, 12, 9, 19, 1]


def test_pointer_fires_on_a_copy_and_fetches_exactly_the_cold_successors():
    tokens = prompt_tokens()
    head = [200, 201, 202]
    run = Run(FetchPolicy(KeepSet(0.3, head), budget=0.3, slots=16, cold_share=0.4, grace=2), tokens)
    for g in range(2):
        assert set(head) <= run.held(g)  # the inner policy keeps the span's head ...
        assert not set(range(203, 260)) <= run.held(g)  # ... and drops (demotes) its continuation
    for i, p in enumerate(head):
        run.step(tokens[p])
        assert run.policy.stats()["fires"] == (1 if i == 2 else 0)
    row = run.policy._rows[0]
    assert row.pointer == 202
    for g in range(2):
        ix = run.cache.index(0, g)
        window = set(range(203, 219))
        cold = {p for p in window if int(ix.cold_slot.t[p]) >= 0}
        assert cold and ix.fetched == cold  # exactly the cold successors, nothing else
        assert window - cold <= run.held(g)  # the rest of the window is hot anyway
    # the pointer advances with the copy and the slots slide by one
    run.step(tokens[203])
    assert row.pointer == 203 and run.policy.stats()["fires"] == 1
    for g in range(2):
        ix = run.cache.index(0, g)
        assert ix.fetched == {p for p in range(204, 220) if int(ix.cold_slot.t[p]) >= 0}
    # a separator the prompt does not have: the window is held (grace), and the next item just
    # ahead re-syncs the pointer without a new fire
    run.step(1023)
    assert row.pointer == 203 and all(run.cache.index(0, g).fetched for g in range(2))
    run.step(tokens[206])
    assert row.pointer == 206 and run.policy.stats()["fires"] == 1
    # the copy stops: after `grace` steps without a match the pointer is lost and every slot is
    # released (cold copies stay)
    for _ in range(2):
        run.step(1023)
        assert row.pointer == 206
    run.step(1023)
    assert row.pointer is None
    assert all(not run.cache.index(0, g).fetched for g in range(2))


class Ranked(KeepSet):
    """KeepSet with a ranking of its own: the cold tier admits its next best first."""

    def ranking(self, ctx):
        pr = -torch.arange(ctx.prompt_len, dtype=torch.float64) / ctx.prompt_len
        pr[self.favour] += 10.0
        pr[300:320] += 5.0  # just below the kept set
        return with_generated(pr.expand(ctx.num_groups, -1).clone(), ctx.length)


def test_cold_admission_by_the_inner_ranking_or_by_position():
    tokens = prompt_tokens()
    # room for 20 cold tokens: 0.1 * 0.3 * 400 / c (c = the fp32 cache's INT2 cost)
    c = CostModel(D, 32, torch.float32).l2_ratio
    share = 20.5 * c / (0.3 * P)
    run = Run(FetchPolicy(Ranked(0.3, [200, 201, 202]), budget=0.3, cold_share=share, admit="score"), tokens)
    ix = run.cache.index(0, 0)
    cold = set(torch.nonzero(ix.cold_slot.t[:P] >= 0).squeeze(1).tolist())
    assert cold == set(range(300, 320))  # the next best by the ranking
    run = Run(FetchPolicy(Ranked(0.3, [200, 201, 202]), budget=0.3, cold_share=share), tokens)  # default
    ix = run.cache.index(0, 0)
    cold = set(torch.nonzero(ix.cold_slot.t[:P] >= 0).squeeze(1).tolist())
    held = run.held(0)
    assert len(cold) == 20 and all(p - 1 in held or p - 1 in cold for p in cold)  # runs right after kept tokens


def test_pointer_stays_dormant_on_text_that_is_not_a_copy():
    tokens = prompt_tokens()
    run = Run(FetchPolicy(KeepSet(0.3, [200, 201]), budget=0.3, slots=16, cold_share=0.4), tokens)
    g = torch.Generator().manual_seed(7)
    for tok in torch.randint(0, 900, (40,), generator=g).tolist():
        run.step(tok)
    stats = run.policy.stats()
    assert stats["fires"] == 0 and stats["fetched"] == 0 and stats["active_steps"] == 0
    assert stats["demoted"] > 0


def test_grammar_trigger_fires_only_inside_a_value():
    from pask.structure.tags import FALLBACK, Next, State, Tag, TagClass

    value = Tag(TagClass.FREE_GENERATION, FALLBACK.role, State.STABLE, Next.NO_LOOKAHEAD)
    tokens = prompt_tokens()
    policy = FetchPolicy(KeepSet(0.3, [200, 201, 202]), budget=0.3, slots=8, cold_share=0.4, trigger="grammar")
    run = Run(policy, tokens)
    run.step(tokens[200], [FALLBACK])
    run.step(tokens[201], [FALLBACK, FALLBACK])  # two matches, but outside a value: dormant
    assert policy.stats()["fires"] == 0
    run.step(tokens[202], [FALLBACK, FALLBACK, value])  # inside a value: fires at min(min_run, 2)
    assert policy.stats()["fires"] == 1 and policy._rows[0].pointer == 202


@settings(max_examples=6, deadline=None)
@given(budget=st.sampled_from([0.2, 0.3, 0.5]), share=st.sampled_from([0.0, 0.3, 0.6]), copy=st.booleans())
def test_measured_budget_stays_at_the_target(budget, share, copy):
    tokens = prompt_tokens()
    plain = Run(KeepSet(budget, [200, 201, 202]), tokens)
    fetch = Run(FetchPolicy(KeepSet(budget, [200, 201, 202]), budget=budget, slots=16, cold_share=share), tokens)
    for i in range(24):
        tok = tokens[200 + i] if copy else 1000 + (i % 20)
        plain.step(tok)
        fetch.step(tok)
        n = P + i + 1
        assert fetch.budget() <= budget + 1.0 / n + fetch.balance_share() + 1e-9
        if not copy:  # dormant: the same measured B as the inner policy alone
            assert abs(fetch.budget() - plain.budget()) <= 2.0 / n + fetch.balance_share()
    assert abs(plain.budget() - budget) <= 1.0 / n


def test_hot_iso_keeps_the_inner_hot_set_and_adds_every_release_cold():
    budget, tokens = 0.3, prompt_tokens()
    plain = Run(KeepSet(budget, [200, 201, 202]), tokens)
    policy = FetchPolicy(KeepSet(budget, [200, 201, 202]), budget=budget, slots=16, iso="hot")
    fetch = Run(policy, tokens)
    for i in range(12):  # not a copy: dormant, the hot set is the inner policy's own
        plain.step(1000 + i)
        fetch.step(1000 + i)
        n = P + i + 1
        for g in range(2):
            held = fetch.held(g)
            assert held == plain.held(g)
            assert policy._rows[0].cold[g] == set(range(n)) - held  # every release went cold
        # the cold tier's bytes on top, (n - held) c: INT2 codes and scales against this test's
        # fp32 K/V, c = 0.094 per token (0.1875 against BF16)
        extra = fetch.budget() - plain.budget()
        assert 0.08 * (1 - budget) < extra < 0.11 * (1 - budget)
    for i in range(6):  # a copy: the fetch slots come out of the keep count, the hot set does not grow
        plain.step(tokens[200 + i])
        fetch.step(tokens[200 + i])
        assert len(fetch.held(0)) <= len(plain.held(0))
    assert policy.stats()["fires"] == 1 and policy.stats()["fetched"] > 0


def test_wraps_a_real_eviction_policy_and_passes_its_needs_through():
    inner = SnapKVPolicy(0.3, window=16)
    policy = FetchPolicy(inner, cold_bits=4)
    assert policy.budget == 0.3 and policy.name == "fetch-snapkv"
    assert policy.prefill_window == 16 and not policy.step_attention and not policy.needs_tags
    assert with_key_bits(CacheConfig(), policy).cold_bits == 4
    assert FetchPolicy(inner, trigger="grammar").needs_tags
    assert FetchPolicy(inner, count_attended=True).step_attention


@pytest.mark.parametrize(
    "bad",
    [
        {"slots": 0},
        {"slots": 2.5},
        {"cold_share": 1.0},
        {"cold_share": -0.1},
        {"cold_bits": 3},
        {"min_run": 0},
        {"grace": -1},
        {"admit": "random"},
        {"trigger": "attention"},
        {"iso": "bytes"},
        {"budget": 1.5},
    ],
)
def test_bad_configurations_raise(bad):
    with pytest.raises(PaskError):
        FetchPolicy(SnapKVPolicy(0.3), **bad)
    with pytest.raises(PaskError, match="inner must be a policy"):
        FetchPolicy("snapkv")


def tiny_llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=4 * D, num_attention_heads=4, num_key_value_heads=HKV, head_dim=D,
        num_hidden_layers=LAYERS, intermediate_size=64, vocab_size=1024,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def scripted(tokens: list[int]):
    """A next-token function that writes ``tokens`` whatever the logits say (a model that copies)."""
    return lambda row, logits, out=iter(tokens): next(out)


def test_decode_core_runs_the_channel_and_dormant_without_a_cold_share_changes_nothing():
    from pask.runtime.runner import decode_with_policy

    model = tiny_llama()
    tokens = prompt_tokens()
    steps = 20
    # dormant, no cold share: exactly the inner policy's logits
    noise = [1000 + i for i in range(steps)]
    plain = decode_with_policy(
        model, [tokens], SnapKVPolicy(0.3, window=16), steps, CacheConfig(), scripted(noise), keep_logits=True
    )
    fetch = FetchPolicy(SnapKVPolicy(0.3, window=16), slots=16, cold_share=0.0)
    res = decode_with_policy(model, [tokens], fetch, steps, CacheConfig(), scripted(noise), keep_logits=True)
    assert fetch.stats()["fires"] == 0
    assert all(torch.equal(a, b) for a, b in zip(plain.logits, res.logits, strict=True))
    # copying the span: the pointer fires, cold successors are fetched into H and read
    fetch = FetchPolicy(SnapKVPolicy(0.3, window=16), slots=16, cold_share=0.5)
    res = decode_with_policy(
        model, [tokens], fetch, steps, CacheConfig(), scripted(tokens[SPAN.start :]), keep_logits=True
    )
    stats = fetch.stats()
    assert stats["fires"] >= 1 and stats["fetched"] > 0 and stats["active_steps"] >= steps - 4
    assert res.budget.b_total <= 0.3 + 0.01


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policy", "fetch-kivi-4", "--budget", "0.33"], "releases tokens"),
        (["--policy", "fetch-snapkv"], "needs --budget"),
        (["--policy", "fetch-snapkv", "--budget", "0.33", "--policy-config", '{"slots": 0}'], "slots"),
        (["--policy", "fetch-snapkv", "--budget", "0.33", "--policy-config", '{"slotz": 3}'], "KVFetch's own options"),
        (["--policy", "fetch-snapkv", "--budget", "0.33", "--policy-config", '{"iso": "all"}'], "iso must be"),
        (["--policy", "fetch-pask", "--budget", "0.33"], "--table"),
        (
            ["--policy", "fetch-pask", "--table", "t.json", "--policy-config", '{"window": 3}'],
            "unknown option(s) window",
        ),
        (["--policy", "fetch-pask", "--table", "t.json", "--policy-config", '{"trigger": "x"}'], "trigger"),
    ],
)
def test_cli_refuses_bad_fetch_policies(args, message):
    from typer.testing import CliRunner

    from pask.cli import app

    res = CliRunner().invoke(app, ["eval", "bfcl", "--limit", "1", *args])
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output


def test_reports_name_and_order_fetch_cells_after_their_inner_policy():
    from pask.experiments.report import method_key, method_name
    from pask.experiments.sweep import _check_policy

    assert method_name("fetch-snapkv") == "SnapKV + KVFetch"
    order = sorted(["fetch-snapkv", "h2o", "snapkv", "full"], key=method_key)
    assert order == ["full", "h2o", "snapkv", "fetch-snapkv"]
    _check_policy("fetch-h2o")
    with pytest.raises(PaskError, match="unknown policy"):
        _check_policy("fetch-kivi-2")


def test_rows_of_a_batch_keep_their_own_channel():
    """One FetchPolicy over two rows (the decode core numbers them): the copying row fires, the other
    stays dormant, and each row's counters land in its own result."""
    from pask.runtime.runner import decode_with_policy

    model = tiny_llama()
    a, b = prompt_tokens(0), prompt_tokens(1)
    steps = 12
    scripts = {0: iter(a[SPAN.start : SPAN.start + steps]), 1: iter([1000 + i for i in range(steps)])}
    fetch = FetchPolicy(SnapKVPolicy(0.3, window=16), slots=16, cold_share=0.5)
    decode_with_policy(model, [a, b], fetch, steps, CacheConfig(), lambda row, logits: next(scripts[row]))
    assert fetch.stats(0)["fires"] >= 1 and fetch.stats(0)["fetched"] > 0
    assert fetch.stats(1)["fires"] == 0 and fetch.stats(1)["fetched"] == 0
    assert fetch.totals["steps"] == fetch.stats(0)["steps"] + fetch.stats(1)["steps"]


def test_the_kvfetch_report_pairs_partial_credit_cases_and_marks_uncounted_attention(tmp_path):
    import json

    from pask.experiments.report import collect, table_fetch

    def cell(policy: str, scores: list[float], channel: dict | None = None) -> None:
        d = tmp_path / "m" / "ruler" / "test" / f"{policy}-b0.2"
        d.mkdir(parents=True)
        budget = {"policy": {"kvfetch": channel}} if channel else {}
        rows = [{"id": f"c{i}", "score": s, "correct": s == 1.0, "budget": budget} for i, s in enumerate(scores)]
        (d / "cases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        mean = 100 * sum(scores) / len(scores)
        overall = {"n": len(scores), "correct": sum(s == 1.0 for s in scores), "score": mean}
        (d / "summary.json").write_text(json.dumps({"overall": overall, "measured_b": 0.2}))

    counts = {"steps": 10, "active_steps": 5, "fires": 1, "fetched": 8, "demoted": 3}
    cell("snapkv", [0.2, 0.5, 0.0, 1.0])
    cell("fetch-snapkv", [0.6, 0.5, 0.1, 0.9], counts)
    text = "\n".join(table_fetch(collect(tmp_path)))
    # partial credit: with ahead on c0 and c2, without ahead on c3, c1 tied (no case is fully right on one side only)
    row = next(line for line in text.splitlines() if "SnapKV + KVFetch" in line)
    assert "| 2 : 1, p = 1.000 |" in row
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[9] == "–"  # attended: not counted
    # a sweep cell that did not ask for the count but recorded attended: 0 (the older counter) shows "–";
    # one that asked shows its count
    for asked, shown in ((False, "–"), (True, "0.5")):
        d = tmp_path / "m" / "ruler" / "test" / "fetch-snapkv-b0.2"
        rows = [json.loads(line) for line in (d / "cases.jsonl").read_text().splitlines()]
        for r in rows:
            r["budget"]["policy"]["kvfetch"]["attended"] = 0 if not asked else 2 * (r["id"] == "c0")
        (d / "cases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        spec = {"policy": "fetch-snapkv", "policy_config": {"count_attended": True} if asked else {}}
        (d / "cell.json").write_text(
            json.dumps(
                {
                    "status": "done",
                    "n_cases": 4,
                    "spec": spec,
                    "cell": {"model": "m", "task": "ruler", "split": "test", "policy": "fetch-snapkv", "budget": 0.2},
                }
            )
        )
        lines = "\n".join(table_fetch(collect(tmp_path))).splitlines()
        row = next(line for line in lines if "SnapKV + KVFetch" in line)
        assert [c.strip() for c in row.strip("|").split("|")][9] == shown
