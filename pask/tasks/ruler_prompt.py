"""A RULER case's prompt, sized to its target token length with the model's tokenizer.

The user message is the case's instruction, its context (the haystack with the needles or copy item
placed at their depths) and its question. In text mode the prompt is the message through the chat
template followed by the answer prefix (the model continues the prefix, as in RULER). In JSON mode
the model is offered one tool, ``give_answer``, whose parameters are the answer's schema
(:func:`answer_tool`), and answers with one call of it in its native tool-call format, so the
grammar, tagger and prompt labels are the function-calling ones.

Sizing: the message goes through the chat template once, with a marker where the context goes; the
context then takes the largest number of units (essay words, noise sentences, cwe list entries, fwe
coded words) whose whole prompt still has at most ``case.length`` tokens: an interpolation search
over the unit count (:func:`largest_fit`), a handful of tokenizations of the whole prompt per case.
The count found is remembered per tokenizer and case, so a second build tokenizes once. A prompt
is thus at most ``length`` tokens and short of it by less than one unit (a few tokens), except for
cwe when its word pool runs out (far beyond the documented lengths).
"""

from __future__ import annotations

import random
import weakref
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pask.errors import PaskError
from pask.tasks.function_calling import FunctionCase, build_prompt
from pask.tasks.ruler_data import NOISE, RulerCase, cwe_pool, essay_words, fwe_counts, sentence_ends

ANSWER_TOOL = "give_answer"
CONTEXT_MARK = "@@RULER_CONTEXT@@"
_SEPARATORS = {"inline": " ", "line": "\n", "block": "\n\n"}


@dataclass(frozen=True)
class Prompt:
    """A built prompt: its text and token ids, where the context lies in the text (characters) and
    how many haystack units it holds."""

    text: str
    ids: list[int]
    context: tuple[int, int]
    units: int


# -- the answer schema ------------------------------------------------------------------------------------
def answer_tool(case: RulerCase) -> dict:
    """The one tool of a JSON answer: a list of strings under ``case.answer_key``, or for a copied
    record one string argument per field (in the record's order, all required)."""
    if case.answer_key:
        props = {case.answer_key: {"type": "array", "items": {"type": "string"}}}
    else:
        props = {line.split(": ", 1)[0]: {"type": "string"} for line in case.references}
    params = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    fn = {"name": ANSWER_TOOL, "description": "Give the answer to the question.", "parameters": params}
    return {"type": "function", "function": fn}


def answer_lines(case: RulerCase, args: dict) -> list[str]:
    """The lines a JSON answer stands for: the list's items, or a record's ``key: value`` fields."""
    if case.answer_key:
        values = args.get(case.answer_key)
        return [str(v) for v in values] if isinstance(values, list) else []
    return [f"{k}: {v}" for k, v in args.items()]


# -- contexts -----------------------------------------------------------------------------------------------
def _place(units: list[str], boundaries: list[int], case: RulerCase) -> str:
    """``units`` joined by spaces, each insert at the boundary (index into ``units``) nearest its depth."""
    n = len(units)
    at = []
    for depth, _ in case.inserts:
        k = min(bisect_left(boundaries, depth * n), len(boundaries) - 1)
        if k > 0 and depth * n - boundaries[k - 1] <= boundaries[k] - depth * n:
            k -= 1
        at.append(boundaries[k])
    pieces: list[tuple[str, bool]] = []
    last = 0
    for pos, (_, text) in zip(at, case.inserts, strict=True):
        if pos > last:
            pieces.append((" ".join(units[last:pos]), False))
        pieces.append((text, True))
        last = max(last, pos)
    if last < n:
        pieces.append((" ".join(units[last:]), False))
    sep = _SEPARATORS[case.style]
    out = []
    for i, (text, inserted) in enumerate(pieces):
        if i:
            out.append(sep if inserted or pieces[i - 1][1] else " ")
        out.append(text)
    return "".join(out)


def _cycle(seq: tuple, start: int, n: int) -> list:
    out: list = []
    while len(out) < n:
        out.extend(seq[start : start + n - len(out)])
        start = 0
    return out


def _context_fn(case: RulerCase) -> tuple[Callable[[int], str], int]:
    """The context with ``n`` units, and the most units there are (or are worth trying)."""
    most = 8 * case.length
    if case.haystack == "essay":
        words, ends = essay_words(), sentence_ends()

        def essay(n: int) -> str:
            stop = _cycle(ends, case.start, n)
            return _place(_cycle(words, case.start, n), [0, *[j for j in range(1, n) if stop[j - 1]], n], case)

        return essay, most
    if case.haystack == "noise":
        return lambda n: _place(_cycle(NOISE, 0, n), list(range(n + 1)), case), most
    if case.haystack == "cwe":
        pool = cwe_pool(case)
        common, uncommon = case.repeats

        def cwe(n: int) -> str:
            listed = list(case.words) * common + pool[:n] * uncommon
            random.Random(f"pask-ruler:order:{case.seed}").shuffle(listed)
            return " ".join(f"{i}. {w}" for i, w in enumerate(listed, 1))

        return cwe, len(pool)
    if case.haystack == "fwe":

        def fwe(n: int) -> str:
            coded = [w for w, c in zip(case.words, fwe_counts(len(case.words), n), strict=True) for _ in range(c)]
            random.Random(f"pask-ruler:order:{case.seed}").shuffle(coded)
            return " ".join(coded)

        return fwe, most
    raise PaskError(f"case {case.id}: unknown haystack '{case.haystack}'")


# -- sizing -------------------------------------------------------------------------------------------------
def largest_fit(count: Callable[[int], int], target: int, limit: int) -> int | None:
    """The largest ``n`` in ``[0, limit]`` with ``count(n) <= target``, for a non-decreasing, nearly
    linear ``count``; None when not even ``count(0)`` fits. Interpolates inside the bracket and
    checks each probe's neighbour (the answer is usually found in two or three rounds), bisecting
    after four rounds."""
    lo, c_lo = 0, count(0)
    if c_lo > target:
        return None
    hi = min(limit, max(1, target))
    c_hi = count(hi)
    while c_hi <= target:
        if hi >= limit:
            return hi
        lo, c_lo = hi, c_hi
        hi = min(limit, 2 * hi)
        c_hi = count(hi)
    rounds = 0
    while hi - lo > 1:
        guess = lo + (target - c_lo) * (hi - lo) // max(1, c_hi - c_lo) if rounds < 4 else (lo + hi) // 2
        mid = min(max(guess, lo + 1), hi - 1)
        c = count(mid)
        if c <= target:
            lo, c_lo = mid, c
            nxt = mid + 1
        else:
            hi, c_hi = mid, c
            nxt = mid - 1
        if lo < nxt < hi:
            c = count(nxt)
            if c <= target:
                lo, c_lo = nxt, c
            else:
                hi, c_hi = nxt, c
        rounds += 1
    return lo


_FITTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {case: units}


def _remembered(tokenizer: Any) -> dict:
    try:
        return _FITTED.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that takes no weak reference: nothing is remembered
        return {}


def _template(case: RulerCase, tokenizer: Any) -> str:
    """The whole prompt with :data:`CONTEXT_MARK` in place of the context."""
    messages = [{"role": "user", "content": f"{case.instruction}\n\n{CONTEXT_MARK}\n\n{case.question}"}]
    if case.answer_format == "json":
        return build_prompt(tokenizer, FunctionCase(case.id, "ruler", messages, [], tools=[answer_tool(case)]))
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return prompt + case.answer_prefix


def build(case: RulerCase, tokenizer: Any) -> Prompt:
    """The case's prompt at its target length (see the module docstring); PaskError when the
    instruction, question and inserts alone are longer than the target."""
    head, mark, tail = _template(case, tokenizer).partition(CONTEXT_MARK)
    if not mark:
        raise PaskError(f"case {case.id}: the chat template dropped the context marker")
    context, limit = _context_fn(case)
    seen: dict[int, tuple[str, list[int]]] = {}  # units -> (context, prompt ids)

    def count(n: int) -> int:
        if n not in seen:
            text = context(n)
            seen[n] = text, tokenizer(head + text + tail, add_special_tokens=False)["input_ids"]
        return len(seen[n][1])

    memo = _remembered(tokenizer)
    n = memo.get(case)
    if n is None:
        n = largest_fit(count, case.length, limit)
        if n is None:
            raise PaskError(
                f"ruler length {case.length} is too short for {case.task}: its prompt without a haystack "
                f"already takes {count(0)} tokens of this tokenizer"
            )
        memo[case] = n
    count(n)
    text, ids = seen[n]
    return Prompt(head + text + tail, ids, (len(head), len(head) + len(text)), n)


__all__ = ["ANSWER_TOOL", "CONTEXT_MARK", "Prompt", "answer_lines", "answer_tool", "build", "largest_fit"]
