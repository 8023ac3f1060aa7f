"""The decode loop: batched greedy generation under grammar constraints.

A batch of requests is left-padded and prefilled together, then decoded one
token per step; each request has its own constraint and stop condition. The
KV cache is an explicit transformers ``Cache`` made by ``cache_factory`` (the
tiered cache plugs in here).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from pask.models import LoadedModel
from pask.structure.constraint import Constraint, allocate_mask, apply_mask, ll_tokenizer


@dataclass
class Request:
    """One generation request: prompt token ids and an optional grammar constraint."""

    prompt_ids: list[int]
    constraint: Constraint | None = None
    max_new_tokens: int = 256
    parse: Callable[[str], Any] | None = None  # task parser for the final text
    tagger: Any = None  # structural tagger: ``step(token_bytes) -> Tag`` (JsonCallTagger, SqlTagger)
    prompt_labels: list | None = None  # semantic label per prompt token (for policies and --save-tags)


@dataclass
class Generation:
    """Result of one request."""

    text: str
    token_ids: list[int]
    prompt_len: int
    stop_reason: str  # grammar | eos | length
    prefill_ms: float
    tpot_ms: float  # decode time per step of its batch
    parsed: Any = None
    parse_error: str | None = None
    extra: dict = field(default_factory=dict)


def _left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, n - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, n - len(s) :] = 1
    return ids, mask


@torch.inference_mode()
def generate(
    lm: LoadedModel,
    requests: list[Request],
    cache_factory: Callable[[], Any] = DynamicCache,
) -> list[Generation]:
    """Greedy-decode a batch of requests together; stop each on grammar completion, EOS or length."""
    model, tok = lm.model, lm.tokenizer
    eos = set(eos_ids(tok))
    pad = tok.pad_token_id
    b = len(requests)
    ids, mask = _left_pad([r.prompt_ids for r in requests], pad)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = cache_factory()

    t0 = time.perf_counter()
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
    prefill_ms = (time.perf_counter() - t0) * 1e3

    token_bytes = ll_tokenizer(tok, sorted(eos)).decode_bytes
    tags: list[list] = [[] for _ in range(b)]
    bitmask = allocate_mask(b, out.logits.shape[-1])
    generated: list[list[int]] = [[] for _ in range(b)]
    stop: list[str | None] = [None] * b
    next_pos = pos[:, -1:] + 1
    steps, t1 = 0, time.perf_counter()
    while True:
        logits = out.logits[:, -1, :].float()
        for i, r in enumerate(requests):
            if r.constraint is not None and stop[i] is None:
                r.constraint.mask(bitmask, i)
            else:
                bitmask[i].fill_(-1)
        apply_mask(logits, bitmask)
        nxt = logits.argmax(-1).tolist()
        for i, r in enumerate(requests):
            if stop[i] is not None:
                continue
            t = nxt[i]
            if t in eos:
                stop[i] = "eos"
                continue
            generated[i].append(t)
            if r.tagger is not None:
                tags[i].append(r.tagger.step(token_bytes([t])))
            if r.constraint is not None:
                r.constraint.consume(t)
                if r.constraint.is_done():
                    stop[i] = "grammar"
            if stop[i] is None and len(generated[i]) >= r.max_new_tokens:
                stop[i] = "length"
        if all(s is not None for s in stop):
            break
        feed = torch.tensor([[g[-1] if g and stop[i] is None else pad] for i, g in enumerate(generated)])
        mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype)], dim=1)
        out = model(input_ids=feed, attention_mask=mask, position_ids=next_pos, cache=cache, use_cache=True)
        next_pos = next_pos + 1
        steps += 1
    tpot_ms = (time.perf_counter() - t1) * 1e3 / max(steps, 1)

    results = []
    for i, r in enumerate(requests):
        text = tok.decode(generated[i], skip_special_tokens=False)
        g = Generation(text, generated[i], len(r.prompt_ids), stop[i] or "length", prefill_ms, tpot_ms)
        if r.tagger is not None:
            g.extra["tags"] = tags[i]
        if r.parse is not None:
            try:
                g.parsed = r.parse(text)
            except Exception as e:  # the task decides what a parse failure means
                g.parse_error = str(e)
        results.append(g)
    return results


def eos_ids(tok) -> list[int]:
    """Token ids that end an assistant turn (EOS plus the chat end-of-turn token)."""
    ids = {tok.eos_token_id}
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        tid = tok.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid != tok.unk_token_id and tid is not None:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)
