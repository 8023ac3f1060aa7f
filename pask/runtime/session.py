"""How the decode core talks to a tiered cache: prefill (from the prefill store or a forward),
a policy's decisions on the positions leaving the recent window, a row's measured budget.

When the policy asks for attention statistics (:mod:`pask.kv.stats`), a collector attached to the
cache records them during the forward and they reach the policy in its :class:`SeqContext`.
"""

from __future__ import annotations

import torch

from pask.kv import stats
from pask.kv.budget import CostModel
from pask.kv.cache import TieredCache
from pask.kv.stats import StatsCollector, StatsRequest
from pask.policies.base import SeqContext
from pask.runtime.prefill_store import PrefillEntry, PrefillStore, stored_windows


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Left-padded input_ids, attention_mask, position_ids (0 at each row's first token), pad lengths."""
    width = max(len(r) for r in rows)
    pads = [width - len(r) for r in rows]
    ids = torch.tensor([[pad_id] * p + list(r) for p, r in zip(pads, rows, strict=True)], dtype=torch.long)
    mask = torch.tensor([[0] * p + [1] * len(r) for p, r in zip(pads, rows, strict=True)], dtype=torch.long)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos, pads


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
        filling = store is not None and not hit  # then every statistic a later policy may ask for
        record = (stored_windows(max(len(r) for r in rows)), True) if filling else ((), False)
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
    costs: CostModel,
    extra: dict | None = None,
    seq: int | None = None,
    ops: list | None = None,
) -> int:
    """Ask ``decide`` (a policy's ``prefill_actions`` / ``step_actions``) about the positions of ``row``
    that left the recent window since position ``decided``; apply its actions; return the new ``decided``.

    ``extra``: the statistics the policy asked for (SeqContext fields). ``seq``: the row the policy
    sees (default ``row``; a policy instance that serves one request alone sees it as row 0).
    ``ops``: append the actions there as ``(row, group, positions, action)`` instead of applying
    them (a decode step applies every row's at once: :meth:`TieredCache.apply_many`).
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
        int4_cost=costs.l_ratio,
        int2_cost=costs.l2_ratio,
        tier_fn=lambda: torch.stack([cache.tiers(row, g) for g in range(len(cache.groups))]),
        **(extra or {}),
    )
    mine = [(row, group, positions, action) for group, positions, action in decide(ctx)]
    if ops is not None:
        ops.extend(mine)
    elif mine:
        cache.apply_many(mine)  # actions and KVFetch's recall channel, in order
    return int(leaving[-1]) + 1 if leaving.numel() else decided


def row_budget(cache: TieredCache, row: int) -> dict:
    """Measured budget of one live row: ``b_prompt``, ``b_decode``, ``b_total`` and ``held_bytes``."""
    held, full = cache._seq_bytes(row)
    ratio = [h / f if f else 1.0 for h, f in zip(held, full, strict=True)]
    total = sum(held) / sum(full) if sum(full) else 1.0
    return {"b_prompt": ratio[0], "b_decode": ratio[1], "b_total": total, "held_bytes": sum(held)}
