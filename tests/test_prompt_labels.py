"""Prompt-token labels: every schema value of the BFCL test tools is labelled, the rest is protected."""

from __future__ import annotations

import json

import pytest

from pask.structure.prompt_labels import find_tool_spans, label_prompt, label_sql_prompt
from pask.structure.tags import LABEL_PRIORITY, PromptLabel

FN, KEY, TYPE, ENUM = (
    PromptLabel.FUNCTION_NAME,
    PromptLabel.PARAMETER_KEY,
    PromptLabel.TYPE_CONSTRAINT,
    PromptLabel.ENUM_CONSTRAINT,
)
SCAF, PROT = PromptLabel.SCHEMA_SCAFFOLD, PromptLabel.PROTECTED_CONTENT


class Writer:
    """json.dumps(ensure_ascii=False) re-written by hand, recording the span of every labelled value."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.n = 0
        self.spans: list[tuple[int, int, PromptLabel]] = []  # content spans, quotes excluded
        self.descriptions: list[tuple[int, int]] = []

    def raw(self, s: str) -> None:
        self.parts.append(s)
        self.n += len(s)

    def scalar(self, v, label: PromptLabel | None = None) -> None:
        s = json.dumps(v, ensure_ascii=False)
        q = 1 if isinstance(v, str) else 0
        if label is not None and len(s) > 2 * q:
            self.spans.append((self.n + q, self.n + len(s) - q, label))
        self.raw(s)

    def value(self, v, mode: str = "plain") -> None:
        """mode: plain | schema | props | enum | required | types."""
        if isinstance(v, dict):
            self.raw("{")
            for i, (k, x) in enumerate(v.items()):
                if i:
                    self.raw(", ")
                self.scalar(k, KEY if mode == "props" else None)
                self.raw(": ")
                if mode == "props":
                    self.value(x, "schema")
                elif mode == "schema":
                    sub = {"properties": "props", "items": "schema", "enum": "enum", "required": "required"}
                    if k == "type":
                        self.value(x, "types")
                    elif k == "description" and isinstance(x, str):
                        self.descriptions.append((self.n + 1, self.n + len(json.dumps(x, ensure_ascii=False)) - 1))
                        self.value(x)
                    else:
                        self.value(x, sub.get(k, "plain"))
                elif mode == "enum":
                    self.value(x, "enum")
                else:
                    self.value(x)
            self.raw("}")
        elif isinstance(v, list):
            self.raw("[")
            for i, x in enumerate(v):
                if i:
                    self.raw(", ")
                self.value(x, mode if mode in ("enum", "required", "types") else "plain")
            self.raw("]")
        else:
            label = {"enum": ENUM, "required": KEY, "types": TYPE}.get(mode)
            self.scalar(v, label if (mode == "enum" or isinstance(v, str)) else None)

    def tool(self, tool: dict) -> str:
        fn = tool["function"]
        self.raw('{"type": "function", "function": {')
        for i, (k, x) in enumerate(fn.items()):
            if i:
                self.raw(", ")
            self.scalar(k)
            self.raw(": ")
            if k == "name":
                self.scalar(x, FN)
            elif k == "parameters":
                self.value(x, "schema")
            elif k == "description":
                self.descriptions.append((self.n + 1, self.n + len(json.dumps(x, ensure_ascii=False)) - 1))
                self.value(x)
            else:
                self.value(x)
        self.raw("}}")
        return "".join(self.parts)


@pytest.fixture(scope="module")
def cases():
    from pask.tasks.function_calling import load_cases

    return load_cases(["simple", "multiple", "parallel", "parallel_multiple"], split="test")


def test_every_schema_value_is_labelled(qwen_tokenizer, cases):
    assert len(cases) == 600
    counts = dict.fromkeys((FN, KEY, TYPE, ENUM), 0)
    from pask.tasks.function_calling import build_prompt

    for case in cases:
        prompt = build_prompt(qwen_tokenizer, case)
        labels = label_prompt(qwen_tokenizer, prompt, case.tools)
        offsets = qwen_tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        assert len(labels) == len(offsets)
        owner = [-1] * len(prompt)
        for k, (s, e) in enumerate(offsets):
            for p in range(s, e):
                owner[p] = k
        in_schema = bytearray(len(prompt))
        for tool in case.tools:
            w = Writer()
            text = w.tool(tool)
            assert text == json.dumps(tool, ensure_ascii=False)
            start = prompt.find(text)
            assert start >= 0, case.id
            in_schema[start : start + len(text)] = b"\1" * len(text)
            for s, e, label in w.spans:
                counts[label] += 1
                for p in range(start + s, start + e):
                    got = labels[owner[p]]
                    assert LABEL_PRIORITY[got] >= LABEL_PRIORITY[label], (case.id, prompt[start + s : start + e], got)
            for s, e in w.descriptions:  # descriptions are scaffold, unless a token reaches a quote
                for p in range(start + s, start + e):
                    k = owner[p]
                    if offsets[k][0] >= start + s and offsets[k][1] <= start + e:
                        assert labels[k] == SCAF, (case.id, prompt[offsets[k][0] : offsets[k][1]])
        for k, (s, e) in enumerate(offsets):
            if not any(in_schema[s:e]):
                assert labels[k] == PROT, (case.id, prompt[s:e])
            else:
                assert labels[k] != PROT
    assert min(counts.values()) > 100, counts


def _tokens(tok, text, labels):
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return [(text[s:e], lab) for (s, e), lab in zip(offsets, labels, strict=True)]


def test_labels_of_one_prompt(qwen_tokenizer):
    tool = {
        "type": "function",
        "function": {
            "name": "book_room",
            "description": "Book a room. The name of the hotel is required.",
            "parameters": {
                "type": "object",
                "properties": {
                    "hotel": {"type": "string", "description": "hotel name"},
                    "size": {"type": ["string", "null"], "enum": ["single", "double"]},
                    "nights": {"type": "integer", "enum": [1, 2, 7]},
                    "type": {"type": "object", "properties": {"name": {"type": "string"}}},
                },
                "required": ["hotel"],
            },
        },
    }
    prompt = qwen_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Book the hotel named type for 2 nights"}],
        tools=[tool],
        add_generation_prompt=True,
        tokenize=False,
    )
    offsets = qwen_tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    labels = label_prompt(qwen_tokenizer, prompt, [tool])
    schema_at = prompt.index('{"type": "function"')

    def at(needle: str, after: int = schema_at) -> set[PromptLabel]:
        """Labels of the tokens covering the first ``needle`` after ``after``."""
        s = prompt.index(needle, after)
        return {lab for (ts, te), lab in zip(offsets, labels, strict=True) if ts < s + len(needle) and te > s}

    assert at("book_room") == {FN}
    assert at("single") == {ENUM} and at("double") == {ENUM} and at("7]") <= {ENUM, SCAF}
    assert ENUM in at("7]")
    assert at("integer") == {TYPE} and TYPE in at("null")
    assert KEY in at('nights": {') and KEY in at('hotel": {') and KEY in at('hotel"]')
    assert KEY in at('"type": {"type": "object"') and TYPE in at('object", "properties": {"name"')
    assert KEY in at('name": {"type": "string"}}')  # a property called "name" is a key, not a function name
    assert at("a room. The") == {SCAF}  # description: inside the schema span
    assert at("<|im_start|>", 0) == {PROT}
    user = prompt.index("Book the hotel")
    assert {lab for (s, _), lab in zip(offsets, labels, strict=True) if s >= user} == {PROT}


def test_other_serialisations_are_found(qwen_tokenizer):
    tool = {"type": "function", "function": {"name": "f_x", "parameters": {"type": "object", "properties": {}}}}
    pretty = "Tools:\n" + json.dumps(tool["function"], indent=2) + "\nQuestion?"
    assert len(find_tool_spans(pretty, [tool])) == 1
    labels = label_prompt(qwen_tokenizer, pretty, [tool])
    assert FN in labels and TYPE in labels
    assert label_prompt(qwen_tokenizer, "no tools here {", [tool]) == [PROT] * len(
        qwen_tokenizer("no tools here {", add_special_tokens=False)["input_ids"]
    )


def test_sql_prompt_labels(qwen_tokenizer):
    ddl = "CREATE TABLE singer (\n  Singer_ID INTEGER PRIMARY KEY,\n  Name TEXT NOT NULL\n);"
    prompt = f"Schema:\n{ddl}\nQuestion: how many singers?"
    base = prompt.index("CREATE")

    def span(sub, kind, name=""):
        s = prompt.index(sub, base)
        return (s, s + len(sub), kind, name)

    spans = [
        (base, base + len(ddl), "scaffold", ""),
        span("singer", "table", "singer"),
        span("Singer_ID", "column", "Singer_ID"),
        span("INTEGER", "type"),
        span("PRIMARY KEY", "constraint"),
        span("Name", "column", "Name"),
        span("TEXT", "type"),
        span("NOT NULL", "constraint"),
    ]
    toks = _tokens(qwen_tokenizer, prompt, label_sql_prompt(qwen_tokenizer, prompt, spans))
    lab = {text.strip(): label for text, label in toks}
    assert lab["singer"] == FN and lab["INTEGER"] == TYPE and lab["PRIMARY"] == ENUM and lab["NULL"] == ENUM
    assert lab["Name"] == KEY and lab["CREATE"] == SCAF and lab["Question"] == PROT
    with pytest.raises(ValueError):
        label_sql_prompt(qwen_tokenizer, prompt, [(0, 3, "bogus", "")])
