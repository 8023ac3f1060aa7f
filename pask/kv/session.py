"""KV sessions: how the decode loop talks to its cache (prefill, step, finish, budget).

:class:`DenseSession` is Full KV on transformers' ``DynamicCache`` (left-padded batch with an
attention mask). :class:`TieredSession` stores each row's tokens in a :class:`TieredCache` and
applies a policy's actions: at prefill for prompt tokens outside the recent window, and after
every step for tokens that just left it. When the policy asks for attention statistics
(:mod:`pask.kv.stats`), a collector attached to the cache records them during the forward and
they reach the policy in its :class:`SeqContext`. A finished row is dropped (its bytes are freed) after
its budget is recorded.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from pask.kv import stats
from pask.kv.attention import enable_pask_attention
from pask.kv.budget import CostModel
from pask.kv.cache import CacheConfig, TieredCache, config_for
from pask.kv.prefill_store import STORED_WINDOWS, PrefillEntry, PrefillStore
from pask.kv.stats import StatsCollector, StatsRequest
from pask.policies.base import Policy, SeqContext


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Left-padded input_ids, attention_mask, position_ids (0 at each row's first token), pad lengths."""
    width = max(len(r) for r in rows)
    pads = [width - len(r) for r in rows]
    ids = torch.tensor([[pad_id] * p + list(r) for p, r in zip(pads, rows, strict=True)], dtype=torch.long)
    mask = torch.tensor([[0] * p + [1] * len(r) for p, r in zip(pads, rows, strict=True)], dtype=torch.long)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos, pads


class DenseSession:
    """Full KV: one DynamicCache for the batch; finished rows are cut out of it (less compute)."""

    def __init__(self, model: torch.nn.Module, pad_id: int) -> None:
        self.model, self.pad_id = model, pad_id
        self.cache = DynamicCache()

    def prefill(self, requests) -> torch.Tensor:
        ids, self.mask, pos, _ = left_pad([r.prompt_ids for r in requests], self.pad_id)
        self.rows = list(range(len(requests)))  # batch row -> request index
        self.finished: set[int] = set()
        self.next_pos = pos[:, -1:] + 1
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask,
            position_ids=pos,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    def step(self, last: list[int | None], tags) -> torch.Tensor:
        keep = [i for i, r in enumerate(self.rows) if r not in self.finished]
        if len(keep) < len(self.rows):  # drop finished rows from the cache, mask and positions
            idx = torch.tensor(keep)
            self.cache.batch_select_indices(idx)
            self.mask, self.next_pos = self.mask[idx], self.next_pos[idx]
            self.rows = [self.rows[i] for i in keep]
        if (head := getattr(self.model, "_pask_masked_head", None)) is not None:
            head.select(self.rows)  # the forward holds the unfinished rows only
        feed = torch.tensor([[last[r] if last[r] is not None else self.pad_id] for r in self.rows])
        self.mask = torch.cat([self.mask, torch.ones((len(self.rows), 1), dtype=self.mask.dtype)], dim=1)
        out = self.model(
            input_ids=feed, attention_mask=self.mask, position_ids=self.next_pos, cache=self.cache, use_cache=True
        )
        self.next_pos = self.next_pos + 1
        logits = out.logits.new_zeros((len(last), out.logits.shape[-1]))
        logits[torch.tensor(self.rows)] = out.logits[:, -1]
        return logits

    def finish(self, row: int) -> None:
        """The row leaves the batch at the next step."""
        self.finished.add(row)

    def close(self) -> None:
        """Nothing to restore."""

    def budget(self, row: int) -> dict | None:
        return None


class TieredSession:
    """A TieredCache and a policy deciding H / INT4 / release per token x layer group."""

    def __init__(
        self,
        model: torch.nn.Module,
        policy: Policy,
        config: CacheConfig | None = None,
        store: PrefillStore | None = None,
    ) -> None:
        self.model, self.policy = model, policy
        self.config = config_for(policy, config)
        self.store = store if store is not None else PrefillStore.from_env(model)
        self._prev_attn = enable_pask_attention(model)

    def close(self) -> None:
        """Give the model back its previous attention implementation."""
        self.model.set_attn_implementation(self._prev_attn)

    def prefill(self, requests) -> torch.Tensor:
        self.requests = requests
        rows = [r.prompt_ids for r in requests]
        self.history = [list(r) for r in rows]
        self.decided = [0] * len(rows)
        self.samples: list[list[float]] = [[] for _ in rows]
        self.final: dict[int, dict] = {}
        self.cache = TieredCache(self.model.config, self.config, batch_size=len(rows))
        self.stats, logits = run_prefill(self.model, self.cache, rows, StatsRequest.of(self.policy), self.store)
        layer = self.cache.layers[0]
        spec = self.cache.spec
        self.int4_cost = CostModel(
            spec.head_dim, self.config.quant_group, layer.dtype or torch.bfloat16, self.config.low_bits
        ).l_ratio
        for row in range(len(rows)):
            extra = {}
            if self.stats is not None:
                extra["prefill_attention"], extra["prefill_value_norm"] = self.stats.take_prefill(row)
            self._decide(self.policy.prefill_actions, row, [], extra)
        return logits

    def step(self, last: list[int | None], tags: list[list]) -> torch.Tensor:
        live = [i for i, t in enumerate(last) if t is not None]
        for i in live:
            self.history[i].append(last[i])
        feed = torch.tensor([[t if t is not None else 0] for t in last])
        positions = torch.tensor([[self.cache.seq_length(i) if t is not None else 0] for i, t in enumerate(last)])
        if self.stats is not None:
            self.stats.begin_step()
        out = self.model(input_ids=feed, position_ids=positions, cache=self.cache, use_cache=True)
        for i in live:
            extra = {}
            if self.stats is not None:
                extra["step_attention"], extra["step_scores"] = self.stats.take_step(i)
            self._decide(self.policy.step_actions, i, tags[i], extra)
            self.samples[i].append(self._row_budget(i)["b_total"])
        self.cache.sample_budget()
        return out.logits[:, -1]

    def _decide(self, decide, row: int, tags: list, extra: dict | None = None) -> None:
        """Ask the policy about the positions that left the recent window since the last call."""
        labels = self.requests[row].prompt_labels
        self.decided[row] = decide_row(
            self.cache, row, decide, self.decided[row], self.history[row], tags, labels, self.int4_cost, extra
        )

    def _row_budget(self, row: int) -> dict:
        return row_budget(self.cache, row)

    def finish(self, row: int) -> None:
        """Record the row's final budget, then free its storage."""
        b = self._row_budget(row)
        s = self.samples[row]
        b["b_total_avg"] = sum(s) / len(s) if s else b["b_total"]
        self.final[row] = {k: round(v, 5) if isinstance(v, float) else v for k, v in b.items()}
        self.cache.drop(row)

    def budget(self, row: int) -> dict | None:
        return self.final.get(row)


def run_prefill(
    model: torch.nn.Module,
    cache: TieredCache,
    rows: list[list[int]],
    request: StatsRequest,
    store: PrefillStore | None,
    keep_stats: bool | None = None,
) -> tuple[StatsCollector | None, torch.Tensor]:
    """Prefill ``rows`` (left-padded) into ``cache``; return the attached statistics collector and the
    last logits ``[rows, V]``.

    With a ``store`` holding every row, the cache and the statistics are filled from it and the
    forward is skipped; otherwise the forward runs and, with a store, every row is stored (its
    collector then records every statistic a later policy may ask for). The collector exists when
    ``keep_stats`` (default: the ``request`` asks for any statistic) or when rows are stored.
    """
    keep = request.any if keep_stats is None else keep_stats
    stored = [store.get(r, request) for r in rows] if store is not None else []
    hit = bool(stored) and all(e is not None for e in stored)
    collector = None
    if keep or (store is not None and not hit):
        record = (STORED_WINDOWS, True) if store is not None and not hit else ((), False)
        collector = StatsCollector(request, cache.spec.num_layers, len(rows), *record)
    stats.attach(cache, collector)
    ids, mask, pos, pads = left_pad(rows, 0)
    cache.begin_prefill(pads)
    if hit:
        return collector, _load_prefill(cache, collector, stored, pads)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1]
    if store is not None:
        for b, ids_b in enumerate(rows):  # every row: K/V as the cache holds them, last logits, statistics
            windows, vn = collector.recorded_prefill(b)
            layers = [layer.seqs[b].h for layer in cache.layers]
            entry = PrefillEntry([h.view("k") for h in layers], [h.view("v") for h in layers], logits[b], windows, vn)
            store.put(ids_b, entry)
    return collector, logits


def _load_prefill(
    cache: TieredCache, collector: StatsCollector | None, entries: list[PrefillEntry], pads: list[int]
) -> torch.Tensor:
    """Fill the cache (and the statistics) from stored prefills, as the forward would have."""
    width = max(e.prompt_len for e in entries)
    for li in range(len(entries[0].keys)):
        k0 = entries[0].keys[li]
        shape = (len(entries), k0.shape[0], width, k0.shape[2])
        k, v = k0.new_zeros(shape), k0.new_zeros(shape)
        for b, e in enumerate(entries):
            k[b, :, pads[b] :], v[b, :, pads[b] :] = e.keys[li], e.values[li]
        cache.update(k, v, li)
    if collector is not None:
        for b, e in enumerate(entries):
            collector.put_prefill(b, e.window_attention, e.value_norm)
    return torch.stack([e.logits for e in entries])


def decide_row(
    cache: TieredCache,
    row: int,
    decide,
    decided: int,
    token_ids: list[int],
    tags: list,
    prompt_labels: list | None,
    int4_cost: float,
    extra: dict | None = None,
    seq: int | None = None,
) -> int:
    """Ask ``decide`` (a policy's ``prefill_actions`` / ``step_actions``) about the positions of ``row``
    that left the recent window since position ``decided``; apply its actions; return the new ``decided``.

    ``extra``: the statistics the policy asked for (SeqContext fields). ``seq``: the row the policy
    sees (default ``row``; a policy instance that serves one request alone sees it as row 0).
    """
    limit = max(0, cache.seq_length(row) - cache.config.recent_window)
    leaving = torch.arange(decided, max(decided, limit), dtype=torch.long)
    ctx = SeqContext(
        seq=row if seq is None else seq,
        prompt_len=cache.prompt_length(row),
        length=cache.seq_length(row),
        recent_window=cache.config.recent_window,
        num_groups=len(cache.groups),
        leaving=leaving,
        token_ids=token_ids,
        tags=tags,
        prompt_labels=prompt_labels,
        groups=cache.groups,
        int4_cost=int4_cost,
        tier_fn=lambda: torch.stack([cache.tiers(row, g) for g in range(len(cache.groups))]),
        **(extra or {}),
    )
    for group, positions, action in decide(ctx):
        cache.apply(row, group, positions, action)
    return int(leaving[-1]) + 1 if leaving.numel() else decided


def row_budget(cache: TieredCache, row: int) -> dict:
    """Measured budget of one live row: ``b_prompt``, ``b_decode``, ``b_total`` and ``held_bytes``."""
    held, full = cache._seq_bytes(row)
    ratio = [h / f if f else 1.0 for h, f in zip(held, full, strict=True)]
    total = sum(held) / sum(full) if sum(full) else 1.0
    return {"b_prompt": ratio[0], "b_decode": ratio[1], "b_total": total, "held_bytes": sum(held)}
