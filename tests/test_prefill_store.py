"""Prefill store: a stored prefill hands the policy the same cache and statistics as a fresh one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pask.errors import PaskError
from pask.kv.stats import ALL, StatsRequest
from pask.policies import get_policy
from pask.policies.base import PolicyBase
from pask.runtime.engine import generate
from pask.runtime.prefill_store import ENV, PrefillEntry, PrefillStore


class _Requests(list):
    """Fresh requests at every use (a request's constraint is consumed by its generation)."""

    def __init__(self, lm, cases, max_new_tokens=12):
        from pask.evaluation.run_bfcl import prepare

        super().__init__(prepare(lm, c, max_new_tokens)[0] for c in cases)
        self.lm, self.cases, self.max_new_tokens = lm, cases, max_new_tokens

    def fresh(self, max_new_tokens=None):
        return _Requests(self.lm, self.cases, max_new_tokens or self.max_new_tokens)


@pytest.fixture(scope="module")
def requests_(smol):
    from pask.tasks.function_calling import load_cases

    return _Requests(smol, load_cases(["simple", "multiple"], split="test", limit=2))


class _Spy:
    """Counts the model's prefill forwards (inputs longer than one token)."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.n += ids is not None and ids.shape[1] > 1

    def close(self):
        self.handle.remove()


def _run(lm, reqs, policy, root, monkeypatch) -> tuple[list, int]:
    """Generate with the store at ``root`` (None: no store); (tokens and budget per request, prefill forwards)."""
    if root is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, str(root))
    spy = _Spy(lm.model)
    try:
        gens = generate(lm, reqs.fresh(), policy=policy)
    finally:
        spy.close()
    return [(g.token_ids, g.extra.get("budget")) for g in gens], spy.n


def _entries(root) -> int:
    return len(list(root.rglob("*.pt")))


@pytest.mark.parametrize(
    "name,params",
    [("snapkv", {"window": 16}), ("h2o", {}), ("criticalkv", {})],  # a window, ALL, value norms
)
def test_stored_prefill_gives_the_same_generation(smol, requests_, tmp_path, monkeypatch, name, params):
    """fp32: no store, first run (stores) and second run (loads, no prefill forward) agree exactly."""
    policy = get_policy(name, budget=0.5, **params)
    fresh, n_fresh = _run(smol, requests_, policy, None, monkeypatch)
    first, n_first = _run(smol, requests_, policy, tmp_path, monkeypatch)
    assert _entries(tmp_path) == len(requests_)
    second, n_second = _run(smol, requests_, policy, tmp_path, monkeypatch)
    n = len(requests_)  # the decode core prefills each prompt alone: one forward per request
    assert (n_fresh, n_first, n_second) == (n, n, 0)
    assert fresh == first == second
    assert all(len(t) > 0 for t, _ in fresh)


def test_one_stored_prefill_serves_every_policy(smol, requests_, tmp_path, monkeypatch):
    """Entries written under one policy (asking for nothing) serve window, ALL and value-norm requests."""
    _run(smol, requests_, get_policy("kivi-4", budget=0.5), tmp_path, monkeypatch)
    store = PrefillStore(tmp_path, smol.model)
    for w in (8, 16, 32, 64, 128, ALL, 10_000):
        req = StatsRequest(prefill_window=w, prefill_value_norm=True)
        assert all(store.get(r.prompt_ids, req) is not None for r in requests_), w
    assert store.get(requests_[0].prompt_ids, StatsRequest(prefill_window=24)) is None  # not a stored window
    e = store.get(requests_[0].prompt_ids, StatsRequest())
    n_layers = smol.model.config.num_hidden_layers
    assert len(e.keys) == n_layers and e.keys[0].shape[1] == len(requests_[0].prompt_ids)
    assert e.window_attention[ALL].shape == (n_layers, e.keys[0].shape[0], e.prompt_len)
    # each (layer, head) row of a window's attention sums to the window's query count
    torch.testing.assert_close(e.window_attention[16].sum(-1), torch.full((n_layers, e.keys[0].shape[0]), 16.0))


def test_long_prompts_record_all_only_when_asked(smol, requests_, tmp_path, monkeypatch):
    """Past ALL_WINDOW_MAX_PROMPT an entry written for a request asking nothing lacks the ALL window
    (quadratic in the prompt) but serves the short windows; an ALL request then misses, prefills
    again and stores the entry with ALL, which serves it from then on."""
    from pask.runtime import prefill_store

    monkeypatch.setattr(prefill_store, "ALL_WINDOW_MAX_PROMPT", 16)
    assert prefill_store.stored_windows(16) == prefill_store.STORED_WINDOWS
    assert ALL not in prefill_store.stored_windows(17)
    _run(smol, requests_, get_policy("kivi-4", budget=0.5), tmp_path, monkeypatch)
    store = PrefillStore(tmp_path, smol.model)
    ids = requests_[0].prompt_ids
    assert len(ids) > 128
    assert store.get(ids, StatsRequest(prefill_window=16, prefill_value_norm=True)) is not None
    assert store.get(ids, StatsRequest(prefill_window=ALL)) is None
    h2o = get_policy("h2o", budget=0.5)
    assert _run(smol, requests_, h2o, tmp_path, monkeypatch)[1] == len(requests_)  # misses: prefilled again
    assert store.get(ids, StatsRequest(prefill_window=ALL)) is not None
    assert _run(smol, requests_, h2o, tmp_path, monkeypatch)[1] == 0  # now every prompt is served


def test_statistics_from_the_store_equal_fresh_ones(smol, requests_, tmp_path, monkeypatch):
    """The tensors a policy sees in its context are equal with and without the store."""
    seen: dict[str, list] = {"fresh": [], "filling": [], "stored": []}

    @dataclasses.dataclass
    class Recorder(PolicyBase):
        budget: float = 0.5
        prefill_window: int = 32
        prefill_value_norm: bool = True
        phase: str = "fresh"
        name: str = "recorder"

        def prefill_actions(self, ctx):
            seen[self.phase].append((ctx.prefill_attention.clone(), ctx.prefill_value_norm.clone()))
            return []

        def step_actions(self, ctx):
            return []

    reqs = requests_.fresh(max_new_tokens=2)
    _run(smol, reqs, Recorder(), None, monkeypatch)
    _run(smol, reqs, Recorder(phase="filling"), tmp_path, monkeypatch)  # fills the store
    assert _run(smol, reqs, Recorder(phase="stored"), tmp_path, monkeypatch)[1] == 0
    assert len(seen["stored"]) == len(reqs)
    for (a0, v0), (a1, v1) in zip(seen["fresh"], seen["stored"], strict=True):
        assert torch.equal(a0, a1) and torch.equal(v0, v1)


def test_store_key_and_damage(smol, requests_, tmp_path, monkeypatch):
    ids = requests_[0].prompt_ids
    store = PrefillStore(tmp_path, smol.model)
    assert store.get(ids, StatsRequest()) is None and store.misses == 1  # empty store: miss
    _run(smol, _Requests(smol, requests_.cases[:1]), get_policy("kivi-4", budget=0.5), tmp_path, monkeypatch)
    assert store.get(ids, StatsRequest()) is not None and store.hits == 1
    assert store.get(ids[:-1], StatsRequest()) is None  # another prompt
    other = PrefillStore(tmp_path, smol.model)
    other.identity = {**other.identity, "dtype": "torch.bfloat16"}
    assert other.get(ids, StatsRequest()) is None  # another dtype, same directory: not served
    store.path(ids).write_bytes(b"not a torch file")
    with pytest.warns(UserWarning, match="unreadable"):
        assert store.get(ids, StatsRequest()) is None
    e = PrefillEntry([torch.zeros(1, 3, 4)], [torch.zeros(1, 3, 4)], torch.zeros(5), {}, torch.zeros(1, 1, 3))
    with pytest.raises(PaskError, match="prompt of"):
        store.put([1, 2], e)
    store.put([1, 2, 3], e)
    assert store.get([1, 2, 3], StatsRequest(prefill_window=8)) is None  # no window attention stored
    assert not list(tmp_path.rglob("*.tmp"))  # atomic writes leave no temporaries


def test_store_from_env_and_bad_directory(smol, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert PrefillStore.from_env(smol.model) is None
    monkeypatch.setenv(ENV, str(tmp_path / "s"))
    assert PrefillStore.from_env(smol.model).root == tmp_path / "s"
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(PaskError, match="cannot create"):
        PrefillStore(f / "sub", smol.model)


def _serve(lm, reqs, factory, store) -> tuple[list[list[int]], int]:
    """Staggered arrivals through the serving scheduler; (tokens per request, prefill forwards)."""
    from pask.runtime.scheduler import Job, Scheduler

    spy = _Spy(lm.model)
    sch = Scheduler(lm, factory, store=store)
    try:
        jobs = [Job(str(i), r) for i, r in enumerate(reqs)]
        sch.submit(jobs[0])
        sch.step()
        for j in jobs[1:]:
            sch.submit(j)
        sch.run_until_idle()
    finally:
        sch.close()
        spy.close()
    return [j.generated for j in jobs], spy.n


def test_serving_scheduler_loads_stored_prefills(smol, requests_, tmp_path, monkeypatch):
    """The scheduler prefills through the store: a second pass has no prefill forward and the same tokens."""
    monkeypatch.delenv(ENV, raising=False)
    factory = lambda: get_policy("h2o", budget=0.5)  # noqa: E731  (asks for the prefill's column sums)
    fresh, n_fresh = _serve(smol, requests_.fresh(), factory, None)
    store = PrefillStore(tmp_path, smol.model)
    first, n_first = _serve(smol, requests_.fresh(), factory, store)
    assert _entries(tmp_path) == len(requests_) and store.misses == len(requests_)
    second, n_second = _serve(smol, requests_.fresh(), factory, store)
    assert (n_fresh, n_first, n_second) == (len(requests_), len(requests_), 0)
    assert store.hits == len(requests_)
    assert fresh == first == second and all(fresh)
    monkeypatch.setenv(ENV, str(tmp_path))  # the default store is $PASK_PREFILL_STORE's
    assert _serve(smol, requests_.fresh(), factory, None) == (fresh, 0)
