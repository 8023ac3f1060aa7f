"""BFCL function calling: cases, splits, JSON Schema conversion, prompt, grammar, parsing.

The model's native tool-call format (Qwen2.5) is one or more blocks::

    <tool_call>
    {"name": "f", "arguments": {...}}
    </tool_call>

separated by a newline. The grammar admits exactly that, each call's JSON
constrained by the offered tools.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from functools import lru_cache

from pask.errors import PaskError
from pask.structure.constraint import lark_json
from pask.structure.schema_check import check_json_schema
from pask.tasks.bfcl_checker import CATEGORIES, bfcl_data_dir, load_possible_answers

NON_LIVE = ("simple", "multiple", "parallel", "parallel_multiple")
LIVE = ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
SPLITS = ("calibration", "dev", "test")
# Non-live split sizes per category (calibration, dev, test): 200 / 200 / 600 overall.
SPLIT_SIZES = {
    "simple": (80, 80, 240),
    "multiple": (40, 40, 120),
    "parallel": (40, 40, 120),
    "parallel_multiple": (40, 40, 120),
}
SPLIT_SEED = 20260323

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_TYPE_MAP = {
    "dict": "object",
    "float": "number",
    "tuple": "array",
    "integer": "integer",
    "int": "integer",
    "string": "string",
    "str": "string",
    "boolean": "boolean",
    "bool": "boolean",
    "array": "array",
    "list": "array",
    "number": "number",
    "object": "object",
}


@dataclass
class FunctionCase:
    """One BFCL case with its tools in JSON Schema form."""

    id: str
    category: str
    messages: list[dict]
    functions: list[dict]  # BFCL docs, original names
    tools: list[dict] = field(default_factory=list)  # OpenAI-style tools, legal names
    name_map: dict[str, str] = field(default_factory=dict)  # legal name -> original
    possible_answer: list[dict] | None = None


def legal_name(name: str) -> str:
    """Map a BFCL function name to one the chat template and grammar accept."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", name.replace(".", "_"))


def _fits(value: object, json_type: str) -> bool:
    """Whether a JSON value is an instance of a JSON Schema type (a bool is not an integer)."""
    if json_type == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    python = {"string": str, "boolean": bool, "array": list, "object": dict}.get(json_type)
    return python is None or isinstance(value, python)


def _type_of(values: list) -> str | None:
    """The one JSON Schema type all ``values`` share (``number`` for ints and floats), or None."""
    for json_type in ("boolean", "integer", "number", "string", "array", "object"):
        if values and all(_fits(v, json_type) for v in values):
            return json_type
    return None


def _fit_enum(schema: dict) -> None:
    """Keep only the ``enum`` values of ``schema``'s type; drop the enum when none (or no values) remain."""
    if "enum" not in schema:
        return
    values = schema["enum"] if isinstance(schema["enum"], list) else []
    if "type" in schema:
        values = [v for v in values if _fits(v, schema["type"])]
    if values:
        schema["enum"] = values
    else:
        del schema["enum"]


def to_json_schema(node: dict | None) -> dict:
    """Convert a BFCL parameter doc to JSON Schema (dict→object, float→number, tuple→array, any→{}).

    BFCL's ``enum`` is made satisfiable, as BFCL's own type rules read it:

    * on an array, string (non-list) values name what each *element* may be: the enum moves to
      ``items`` (``{"type": "array", "enum": ["a", "b"]}`` → ``{"type": "array", "items":
      {"type": "string", "enum": ["a", "b"]}}``). A given ``items`` schema is kept and gets the
      enum, unless it has an enum of its own (kept instead); an ``items`` without a type gets the
      type all the values share. List values are whole-array values and stay on the array
      (other values are then dropped);
    * on any other typed parameter only the values of its type stay (an ``integer`` keeps its
      ints, not bools; a ``number`` its ints and floats; a ``string`` its strings; a ``boolean``
      its bools, so BFCL's ``["True", "False", "dontcare"]`` goes), and the enum is dropped when
      none remain (the parameter then takes any value of its type), as is an empty enum;
    * an untyped (``any``) parameter keeps its enum as given, mixed types included.
    """
    if not isinstance(node, dict):
        return {}
    out: dict = {}
    t = node.get("type")
    if isinstance(t, str):
        if t == "any":
            pass
        elif t in _TYPE_MAP:
            out["type"] = _TYPE_MAP[t]
        else:
            raise PaskError(f"unsupported BFCL type '{t}'")
    for key in ("description", "enum", "format", "minimum", "maximum", "pattern"):
        if key in node:
            out[key] = node[key]
    if "default" in node and node.get("default") is not None:
        out["default"] = node["default"]
    if out.get("type") == "array" and "items" in node:
        out["items"] = to_json_schema(node["items"])
    if out.get("type") == "object" and "properties" in node:
        props = node["properties"] or {}
        out["properties"] = {k: to_json_schema(v) for k, v in props.items()}
        req = [r for r in node.get("required", []) if r in props]
        out["required"] = req
        out["additionalProperties"] = False
    if out.get("type") == "array" and isinstance(out.get("enum"), list):
        values = out["enum"]
        if not any(isinstance(v, list) for v in values):  # element values: they belong on the items
            del out["enum"]
            items = out.setdefault("items", {})
            if "enum" not in items and values:
                items["enum"] = values
                if "type" not in items and _type_of(values) is not None:
                    items["type"] = _type_of(values)
                _fit_enum(items)
    _fit_enum(out)
    return out


def to_tools(functions: list[dict]) -> tuple[list[dict], dict[str, str]]:
    """BFCL function docs → OpenAI-style tools with legal names, plus the name map back."""
    tools, name_map = [], {}
    for f in functions:
        legal = legal_name(f["name"])
        if legal in name_map and name_map[legal] != f["name"]:
            raise PaskError(f"two functions map to the same legal name '{legal}'")
        name_map[legal] = f["name"]
        params = to_json_schema({**f.get("parameters", {}), "type": "dict"})
        params.setdefault("properties", {})
        params.setdefault("required", [])
        tools.append(
            {
                "type": "function",
                "function": {"name": legal, "description": f.get("description", ""), "parameters": params},
            }
        )
    return tools, name_map


def _read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _file_for(category: str) -> str:
    return "simple_python" if category == "simple" else category


@lru_cache(maxsize=16)
def _load_category(category: str) -> tuple[FunctionCase, ...]:
    if category not in CATEGORIES:
        raise PaskError(f"unknown BFCL category '{category}'; choose from: {', '.join(CATEGORIES)}")
    rows = _read_jsonl(bfcl_data_dir() / f"BFCL_v4_{_file_for(category)}.json")
    answers = load_possible_answers(category)
    cases = []
    for row in rows:
        tools, name_map = to_tools(row["function"])
        messages = row["question"][0] if row["question"] and isinstance(row["question"][0], list) else row["question"]
        cases.append(
            FunctionCase(
                id=row["id"],
                category=category,
                messages=list(messages),
                functions=row["function"],
                tools=tools,
                name_map=name_map,
                possible_answer=answers.get(row["id"]),
            )
        )
    return tuple(cases)


def split_ids(category: str, split: str) -> list[str]:
    """Fixed seeded, per-category (stratified) split; live categories are test-only."""
    if split not in (*SPLITS, "all"):
        raise PaskError(f"unknown split '{split}'; choose from: {', '.join((*SPLITS, 'all'))}")
    ids = [c.id for c in _load_category(category)]
    if split == "all":
        return ids
    if category in LIVE:
        return ids if split == "test" else []
    order = list(ids)
    random.Random(f"{SPLIT_SEED}:{category}").shuffle(order)
    n_cal, n_dev, n_test = SPLIT_SIZES[category]
    bounds = {"calibration": (0, n_cal), "dev": (n_cal, n_cal + n_dev), "test": (n_cal + n_dev, n_cal + n_dev + n_test)}
    lo, hi = bounds[split]
    chosen = set(order[lo:hi])
    return [i for i in ids if i in chosen]  # keep file order


def load_cases(categories: list[str], split: str = "test", limit: int | None = None) -> list[FunctionCase]:
    """Cases of the given categories and split; ``limit`` takes a stratified prefix per category."""
    out = []
    for cat in categories:
        by_id = {c.id: c for c in _load_category(cat)}
        ids = split_ids(cat, split)
        if limit is not None:
            ids = ids[:limit]
        out.extend(by_id[i] for i in ids)
    return out


# Optional system message (off by default: BFCL prompts as shipped). Tried as a way to make small
# models emit several calls; qwen2.5-coder-0.5b still stops after one, so it stays opt-in.
SYSTEM_PROMPT = (
    "You are a helpful assistant. If the request needs several function calls (several items, "
    "values or tasks), make all of them: one <tool_call></tool_call> block per call, before ending your turn."
)


def find_case(case_id: str) -> FunctionCase:
    """A case by id, in any category (``simple_python_3``, ``live_multiple_10-4-2``, ...)."""
    for cat in CATEGORIES:
        if case_id.startswith(_file_for(cat) + "_") or case_id.startswith(cat + "_"):
            for c in _load_category(cat):
                if c.id == case_id:
                    return c
    raise PaskError(f"unknown BFCL case id '{case_id}'")


def build_prompt(tokenizer, case: FunctionCase, system: str | None = None) -> str:
    """Render the case through the model's own chat template with ``tools=``.

    A template that ignores ``tools`` (e.g. SmolLM2's) gets them in a system message in the
    Hermes/Qwen style, so the model always sees the offered functions.
    """
    messages = case.messages
    if system and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": system}, *messages]
    text = tokenizer.apply_chat_template(messages, tools=case.tools, add_generation_prompt=True, tokenize=False)
    if all(t["function"]["name"] in text for t in case.tools):
        return text
    tools_text = "\n".join(json.dumps(t) for t in case.tools)
    preamble = (
        f"{system or 'You are a helpful assistant.'}\n\n# Tools\n\nYou may call one or more functions to assist "
        f"with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{tools_text}\n</tools>\n\nFor each function call, return a json object with function name and "
        f'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, '
        f'"arguments": <args-json-object>}}\n</tool_call>'
    )
    rest = [m for m in messages if m.get("role") != "system"]
    return tokenizer.apply_chat_template(
        [{"role": "system", "content": preamble}, *rest], add_generation_prompt=True, tokenize=False
    )


def call_schema(tool: dict) -> dict:
    """JSON Schema of one call ``{"name": ..., "arguments": {...}}`` for a tool."""
    fn = tool["function"]
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_tools(tools: list[dict]) -> None:
    """Raise :class:`PaskError` naming the tool and property if the tools cannot make a grammar.

    Needs no tokenizer or model, so callers run it before loading one. Checks each tool's shape
    (``{"type": "function", "function": {"name": ..., "parameters": {...}}}``, a legal unique
    name, an object ``parameters`` schema; a missing ``parameters`` means no arguments), each
    ``parameters`` schema with :func:`pask.structure.schema_check.check_json_schema` (the nesting
    depth, typos, the meta-schema, satisfiability and ``$ref`` cycles, llguidance's own compile),
    a schema without ``type`` checked as the object it must be.
    Messages read ``tool 'get_weather', property 'days': minimum 10 > maximum 1``.
    """
    if not isinstance(tools, list):
        raise PaskError(f"tools must be a list, got {type(tools).__name__}")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise PaskError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise PaskError(f"tools[{i}] has no name: 'function' needs a 'name' string")
        if not _TOOL_NAME.match(name):
            raise PaskError(
                f"tool '{name}': a name is 1-64 letters, digits, '_' or '-' (e.g. '{legal_name(name)[:64]}')"
            )
        if name in seen:
            raise PaskError(f"tool '{name}' is defined twice: tool names must be unique")
        seen.add(name)
        params = fn.get("parameters")
        if params is None:
            continue
        if not isinstance(params, dict):
            raise PaskError(f"tool '{name}': parameters must be a JSON Schema object, got {type(params).__name__}")
        declared = params.get("type", "object")
        if declared != "object" and not (isinstance(declared, list) and "object" in declared):
            raise PaskError(
                f"tool '{name}': parameters must be an object schema (type 'object'), got type {json.dumps(declared)}"
            )
        # arguments are an object: a schema without "type" is checked as one (else a string would satisfy it)
        check_json_schema(params if "type" in params else {"type": "object", **params}, f"tool '{name}'")


def marker(tokenizer, text: str) -> str:
    """Lark terminal for a tool-call marker: its single special token if the vocabulary has one."""
    if tokenizer is not None:
        tid = tokenizer.convert_tokens_to_ids(text)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            return f"<[{tid}]>"
    return json.dumps(text)


def build_grammar(tools: list[dict], tokenizer=None, max_calls: int | None = None) -> str:
    """Lark grammar: one or more native tool-call blocks, each constrained by the offered tools.

    After the first block the opening marker is optional: small models (qwen2.5-coder-0.5b)
    continue a parallel answer with the next call's JSON directly after ``</tool_call>\n``
    (measured: p({") = 0.74-0.98 vs p(<tool_call>) ~ 0 on BFCL parallel cases), and a grammar
    that insists on the marker turns those answers into a single call.
    """
    if not tools:
        raise PaskError("a request needs at least one tool")
    schema = {"anyOf": [call_schema(t) for t in tools]} if len(tools) > 1 else call_schema(tools[0])
    if max_calls is not None and max_calls < 1:
        raise PaskError(f"max_calls must be >= 1, got {max_calls}")
    repeat = '("\\n" later)*' if max_calls is None else f'("\\n" later){{0,{max_calls - 1}}}' if max_calls > 1 else ""
    open_, close = marker(tokenizer, TOOL_CALL_OPEN), marker(tokenizer, TOOL_CALL_CLOSE)
    return "\n".join(
        [
            f'start: call {repeat} "\\n"?',  # the model ends with "</tool_call>\n" then EOS
            f'call: {open_} "\\n" body "\\n" {close}',
            f'later: ({open_} "\\n")? body "\\n" {close}',
            f"body: {lark_json(schema)}",
        ]
    )


def parse_calls(text: str, name_map: dict[str, str] | None = None) -> list[dict[str, dict]]:
    """Parse tool-call blocks into BFCL's ``[{"name": {args}}]`` form (original names).

    Every ``</tool_call>`` closes one call; its opening marker may be missing (see build_grammar).
    """
    calls = []
    blocks = text.split(TOOL_CALL_CLOSE)[:-1]  # text before each closing marker
    for block in blocks:
        body = block.strip().removeprefix(TOOL_CALL_OPEN).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            raise PaskError(f"tool call is not valid JSON: {e}") from None
        name = obj.get("name")
        name = (name_map or {}).get(name, name)
        calls.append({name: obj.get("arguments", {})})
    return calls
