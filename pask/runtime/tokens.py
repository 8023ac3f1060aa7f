"""The token rules of the decode core: requests and generations, the choice of each token under
the grammar (greedy, or sampled with ``temperature`` / ``top_p`` / ``seed``; masks, closing phase),
recording a token and its stop reason, the masked head's plan.

:class:`pask.runtime.scheduler.Scheduler` applies them in its step; :func:`pask.runtime.engine.generate`
(static batches) and every other decode path go through that step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pask.errors import PaskError
from pask.runtime.masked_head import allowed_tokens
from pask.structure.constraint import Constraint, SchemaError, apply_mask

MAX_TEMPERATURE = 2.0
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range


def check_sampling(temperature: Any, top_p: Any, seed: Any) -> None:
    """PaskError naming the field if ``temperature`` is not in [0, 2], ``top_p`` not in (0, 1] or
    ``seed`` not a non-negative integer (or None). Booleans are not numbers here."""

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    if not number(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise PaskError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {temperature!r}")
    if not number(top_p) or not 0 < top_p <= 1:
        raise PaskError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED):
        raise PaskError(f"seed must be a non-negative integer (below 2**64) or None, got {seed!r}")


def new_generator(seed: int | None) -> torch.Generator:
    """The random stream of one sampled request: seeded with ``seed``, or with a fresh random seed
    when None (``generator.initial_seed()`` tells which)."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


DEFAULT_CLOSE_MARGIN = 128  # the closing phase of a request that sets no margin (at most half its allowance)


@dataclass
class Request:
    """One generation request: prompt token ids and an optional grammar constraint.

    ``temperature`` 0 (the default, and what evaluations use) decodes greedily; above 0 each token
    is drawn from the grammar-masked distribution at that temperature, restricted to the ``top_p``
    nucleus, from a random stream seeded with ``seed`` (None: a fresh random seed). See
    :func:`pick_tokens`.
    """

    prompt_ids: list[int]
    constraint: Constraint | None = None
    max_new_tokens: int = 256
    parse: Callable[[str], Any] | None = None  # task parser for the final text
    close_margin: int | None = None  # last tokens of the allowance spent closing (None: closing_from's default)
    tagger: Any = None  # structural tagger: ``step(token_bytes) -> Tag`` (JsonCallTagger, SqlTagger)
    prompt_labels: list | None = None  # semantic label per prompt token (for policies and --save-tags)
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling (with temperature > 0)
    seed: int | None = None  # seed of the sampling stream (None: a fresh random seed)

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p, self.seed)

    @property
    def closing_from(self) -> int:
        """The generated-token count at which the closing phase starts: the last ``close_margin``
        tokens of the allowance; by default the last 128, at most its second half (a margin as large
        as the allowance would close the structure from the first token: --max-new-tokens 96 wrote
        'SELECT "}}"')."""
        margin = self.close_margin
        if margin is None:
            margin = min(DEFAULT_CLOSE_MARGIN, self.max_new_tokens // 2)
        return self.max_new_tokens - margin

    @property
    def sampled(self) -> bool:
        """Whether tokens are drawn (temperature > 0) rather than taken greedily."""
        return self.temperature > 0


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
    extra: dict = field(default_factory=dict)  # tags, budget


_NOTHING = torch.empty(0, dtype=torch.long)


def plan_head(
    head, requests: list[Request], live: list[bool], bitmask: torch.Tensor, vocab: int
) -> dict[int, SchemaError]:
    """Fill the next step's masks of the live constrained rows and give ``head`` their allowed tokens.

    Returns the rows whose grammar failed (their error; such a row gets the full head): a failing
    grammar is its own request's error, not the batch's.

    The masks are filled one row after another: llguidance's parallel fill (``LLExecutor``) was slower
    in paired served runs on 2 cores (its threads compete with the decode thread's OpenMP worker)."""
    plan: list[torch.Tensor | None] = []
    failed: dict[int, SchemaError] = {}
    for i, r in enumerate(requests):
        if not live[i]:
            plan.append(_NOTHING)  # a finished row still in the batch needs no logits
        elif r.constraint is not None:
            try:
                r.constraint.mask(bitmask, i)
            except SchemaError as e:
                failed[i] = e
                plan.append(None)
                continue
            plan.append(allowed_tokens(bitmask[i], vocab))
        else:
            plan.append(None)
    head.plan = plan
    return failed


def pick_tokens(
    logits: torch.Tensor,
    requests: list[Request],
    generated: list[list[int]],
    live: list[bool],
    bitmask: torch.Tensor,
    closers: torch.Tensor,
    masked: bool | list[bool] = False,
    rngs: list[torch.Generator | None] | None = None,
) -> list[int]:
    """Next token of each row under its grammar (``bitmask`` from ``allocate_mask``, >= rows).

    ``masked``: ``bitmask`` already holds the live constrained rows' masks for this step (one flag
    for all rows, or one per row).

    A row whose request has ``temperature`` 0 takes the argmax of its masked logits (greedy). A
    live row with ``temperature`` > 0 draws its token (:func:`sample_token`) from ``rngs[i]``, its
    request's own stream (:func:`new_generator`), kept by the caller across steps so the draws go on
    rather than restart; each row's draw depends on its own logits and stream only, never on its
    batch-mates.

    A live row in its closing phase (from :attr:`Request.closing_from` on) takes the
    first legal token of ``closers`` instead (see :func:`closing_tokens`). Rows that are not live get
    an unconstrained argmax (ignored by the caller).

    A greedy constrained row whose grammar allows at most :data:`~pask.runtime.masked_head.NARROW`
    tokens takes the argmax over those tokens' logits alone (the same token as over its masked row:
    the first largest; a row whose allowed logits are all ``-inf`` takes the full path, whose argmax
    is then token 0); the other rows convert, mask and scan the whole vocabulary.
    """
    fresh = masked if isinstance(masked, list) else [masked] * len(requests)
    nxt = [0] * len(requests)
    rest: list[int] = []  # rows that take the full-vocabulary path
    for i, r in enumerate(requests):
        if r.constraint is not None and live[i]:
            if not fresh[i]:
                r.constraint.mask(bitmask, i)
            if not r.sampled and len(generated[i]) < r.closing_from:  # a greedy row: its allowed ids suffice
                ids = allowed_tokens(bitmask[i], logits.shape[-1])  # None past NARROW allowed tokens
                if ids is not None and ids.numel():
                    sub = logits[i, ids].float()
                    k = int(sub.argmax())
                    if not bool(sub[k] == -math.inf):  # all -inf: the full row's argmax is token 0
                        nxt[i] = int(ids[k])  # the first largest, as argmax over the masked row
                        continue
        else:
            bitmask[i].fill_(-1)
        rest.append(i)
    if not rest:
        return nxt
    rows: dict[int, torch.Tensor] = {}  # row -> its masked FP32 logits
    for i in rest:  # one row at a time
        row = logits[i].float()
        apply_mask(row, bitmask[i])
        rows[i] = row
        nxt[i] = int(row.argmax())
    for i, r in enumerate(requests):
        if i not in rows:
            continue
        if live[i] and r.sampled:
            rng = rngs[i] if rngs is not None else None
            if rng is None:
                raise ValueError("a sampled request needs its random stream: pass rngs (see new_generator)")
            nxt[i] = sample_token(rows[i], r.temperature, r.top_p, rng, greedy=nxt[i])
    for i, r in enumerate(requests):  # near the token limit: close the structure, don't truncate
        if i not in rows:
            continue
        closing = len(generated[i]) >= r.closing_from
        if live[i] and r.constraint is not None and closing:
            last2 = generated[i][-2:]
            for k in torch.isfinite(rows[i][closers]).nonzero()[:, 0].tolist():
                c = int(closers[k])
                if last2 != [c, c]:  # never a third time in a row (SQL allows endless newlines)
                    nxt[i] = c
                    break
    return nxt


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, rng: torch.Generator, greedy: int) -> int:
    """Draw one token from a row's masked FP32 ``logits`` (disallowed tokens ``-inf``).

    The allowed logits are scaled by ``1 / temperature`` (after subtracting their maximum, so a tiny
    temperature cannot overflow), turned into probabilities, and cut to the nucleus: the most
    probable tokens (ties in token order) down to the first whose cumulative probability reaches
    ``top_p``. One uniform number from ``rng`` then picks a token by inverse CDF. When only one
    token remains (a grammar step with one legal token, or a nucleus of one) it is taken without
    a draw, so it costs nothing and is the greedy token ``greedy``; the stream is then consumed only
    on real choices, which are the same ones in any batch.
    """
    ids = torch.isfinite(logits).nonzero()[:, 0]
    if ids.numel() <= 1:
        return greedy
    x = logits[ids]
    p = torch.softmax((x - x.max()) / temperature, dim=-1)
    if top_p < 1:
        p, order = torch.sort(p, descending=True, stable=True)
        ids = ids[order]
        cum = torch.cumsum(p, dim=-1)
        keep = int(((cum - p) < top_p).sum())  # at least the most probable token
        if keep == 1:
            return greedy
        p, ids = p[:keep], ids[:keep]
    nz = p > 0  # probabilities that underflowed are never drawn
    if not bool(nz.all()):
        p, ids = p[nz], ids[nz]
    if ids.numel() == 1:  # every other probability underflowed: the maximum is left
        return greedy
    cum = torch.cumsum(p, dim=-1)
    u = torch.rand((), generator=rng, dtype=torch.float64)
    j = int(torch.searchsorted(cum.double(), u * cum[-1].double(), right=True))
    return int(ids[min(j, ids.numel() - 1)])


def accept_token(r: Request, t: int, generated: list[int], tags: list, eos: set[int], token_bytes) -> str | None:
    """Record token ``t`` of request ``r`` (tagger, grammar); return its stop reason, or None to go on.

    EOS stops without being recorded; ``generated`` and ``tags`` are extended in place.
    """
    if t in eos:
        return "eos"
    generated.append(t)
    if r.tagger is not None:
        tags.append(r.tagger.step(token_bytes([t])))
    if r.constraint is not None:
        r.constraint.consume(t)
        if r.constraint.is_done():
            return "grammar"
    if len(generated) >= r.max_new_tokens:
        return "length"
    return None


def make_generation(
    tok, r: Request, generated: list[int], tags: list, stop: str | None, prefill_ms: float, tpot_ms: float, budget=None
) -> Generation:
    """The :class:`Generation` of a finished request (text decoded, parsed by its task parser)."""
    text = tok.decode(generated, skip_special_tokens=False)
    g = Generation(text, generated, len(r.prompt_ids), stop or "length", prefill_ms, tpot_ms)
    if r.tagger is not None:
        g.extra["tags"] = tags
    if budget is not None:
        g.extra["budget"] = budget
    if r.parse is not None:
        try:
            g.parsed = r.parse(text)
        except Exception as e:  # the task decides what a parse failure means
            g.parse_error = str(e)
    return g


# Closing tokens in the order tried (after EOS and the call-closing marker): quote-first ones
# before bare brackets, so an open string is closed rather than filled with bracket text; then
# SQL's closers (a parenthesis, a single-quoted literal's end). The same closer is not taken a
# third time in a row: a newline is legal almost everywhere in SQL and would loop.
CLOSER_TEXTS = ("\n", '"}}', '"}', '"]', '"', "]}}", "]}", "}}", "]", "}", ")", "'")


def closing_tokens(tok, eos: set[int]) -> torch.Tensor:
    """Tokens that end a value or a structure (plus EOS and the call-closing marker).

    A request that reaches :attr:`Request.closing_from` takes the first legal one in this
    order (the grammar mask still applies): a small model stuck repeating inside one value
    (endless digits, list items, a string) then finishes a valid call instead of being cut off.
    """
    ids = sorted(eos)
    close = tok.convert_tokens_to_ids("</tool_call>")
    if isinstance(close, int) and close != tok.unk_token_id:
        ids.append(close)
    for text in CLOSER_TEXTS:
        enc = tok(text, add_special_tokens=False)["input_ids"]
        if len(enc) == 1 and enc[0] not in ids:
            ids.append(enc[0])
    return torch.tensor(ids)


def eos_ids(tok) -> list[int]:
    """Token ids that end an assistant turn (EOS plus the chat end-of-turn token)."""
    ids = {tok.eos_token_id}
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        tid = tok.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid != tok.unk_token_id and tid is not None:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)
