"""OpenAI chat completions: a request body -> an engine :class:`~pask.runtime.engine.Request`, and the responses.

Validation, in order (every refusal is a :class:`RequestError`: HTTP 400, or 404 for an unknown
model, with an OpenAI-style error body naming the parameter; nothing reaches the decode thread
before all of it passes):

1. :func:`parse_body`: strict JSON (no ``NaN`` / ``Infinity``), an object;
2. the raw body: JSON nesting at most :data:`MAX_JSON_DEPTH` levels, no lone UTF-16 surrogate in
   any string or key (neither can be tokenised or sent back as UTF-8);
3. ``model`` (404 if it is not the served one), then the typed models below
   (:class:`ChatCompletionRequest`, pydantic, strict: no coercion of ``"5"`` to 5 or ``true`` to 1;
   unknown fields are ignored, as OpenAI does);
4. the schemas (``tools[].function.parameters``, ``response_format.json_schema.schema``): nesting
   depth (:data:`pask.structure.schema_check.MAX_SCHEMA_DEPTH`), the meta-schema, then
   :func:`pask.tasks.function_calling.check_tools` / :func:`pask.structure.schema_check.check_response_format`
   (typos, satisfiability, ``$ref`` cycles that no finite value ends, llguidance's compile), so a
   contradictory or endlessly recursive schema is a 400 naming the tool and the property;
5. the grammar, compiled against the tokenizer and asked for its first mask: a grammar llguidance
   cannot use fails its own request with a short message (llguidance's internal state cut off).

Grammar by request:

* ``tools`` with ``tool_choice`` ``"required"``: one or more native tool-call blocks
  (:func:`pask.tasks.function_calling.build_grammar`); a named function: calls of that function only;
  ``"auto"`` (the default with tools): tool calls or free text (text may not start with the call
  marker); ``"none"``: as without tools.
* ``response_format`` ``{"type": "json_schema", "json_schema": {"schema": ...}}``: JSON of that schema;
  ``{"type": "json_object"}``: any JSON object; ``{"type": "text"}`` or absent: free text.

Forced tool calls and JSON close their structure in the last quarter of ``max_tokens`` (at most
``CLOSE_MARGIN`` tokens: the engine's closing phase); ``auto`` and text requests are not closed
early. ``temperature`` / ``top_p`` / ``seed`` go to the engine request when the runtime samples
(its :class:`~pask.runtime.tokens.Request` has those fields).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import jinja2
import jsonschema
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from pask.errors import PaskError
from pask.runtime.tokens import DEFAULT_CLOSE_MARGIN, Request, eos_ids
from pask.structure.constraint import (
    Constraint,
    SchemaError,
    allocate_mask,
    grammar_message,
    lark_json,
    ll_tokenizer,
)
from pask.structure.schema_check import check_response_format, check_schema_depth
from pask.tasks.function_calling import (
    TOOL_CALL_OPEN,
    FunctionCase,
    build_grammar,
    build_prompt,
    check_tools,
    marker,
    parse_calls,
)

DEFAULT_MAX_TOKENS = 256
# closing phase of tool / JSON requests: at most this many last tokens, a quarter of max_tokens
CLOSE_MARGIN = DEFAULT_CLOSE_MARGIN
MAX_JSON_DEPTH = 128  # nesting levels of the request body (a schema at MAX_SCHEMA_DEPTH needs about 70)
MAX_TEMPERATURE = 2.0
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range
_SAMPLING = ("temperature", "top_p", "seed")
_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads pairs valid surrogates: any left is lone


class RequestError(PaskError):
    """A request the server refuses: HTTP ``status`` and an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = "not_found_error" if self.status == 404 else "invalid_request_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


# -- the typed request ----------------------------------------------------------------------------
# Unions pick their branch by the input's JSON type (a callable Discriminator), so an error names the
# one branch meant; branch tags start with "=" and are left out of the parameter path of an error.
def _json_kind(value: Any) -> str | None:
    kinds = {str: "=string", list: "=list", dict: "=object"}
    return kinds.get(type(value))


def _one_of(*kinds: str) -> Any:
    return lambda v: k if (k := _json_kind(v)) in kinds else None


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class TextPart(_Model):
    type: Literal["text"]
    text: str


def _text_part(v: Any) -> str | None:
    return "=text" if isinstance(v, dict) and v.get("type") == "text" else None


Part = Annotated[
    Annotated[TextPart, Tag("=text")],
    Discriminator(_text_part, custom_error_type="pask_shape", custom_error_message=(
        "only text content parts are supported: {'type': 'text', 'text': ...}")),
]  # fmt: skip
Content = Annotated[
    Annotated[str, Tag("=string")] | Annotated[list[Part], Tag("=list")],
    Discriminator(_one_of("=string", "=list"), custom_error_type="pask_shape", custom_error_message=(
        "expected a string or a list of text parts")),
]  # fmt: skip


class FunctionCall(_Model):
    name: str
    arguments: Annotated[
        Annotated[str, Tag("=string")] | Annotated[dict[str, Any], Tag("=object")],
        Discriminator(_one_of("=string", "=object"), custom_error_type="pask_shape", custom_error_message=(
            "expected a JSON string (or an object)")),
    ]  # fmt: skip


class ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: FunctionName


def _tool_choice_kind(v: Any) -> str | None:
    if isinstance(v, str):
        return "=mode" if v in ("none", "auto", "required") else None
    return "=named" if isinstance(v, dict) else None


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("=mode")] | Annotated[NamedToolChoice, Tag("=named")],
    Discriminator(_tool_choice_kind),
]


class JsonSchemaSpec(_Model):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class TextFormat(_Model):
    type: Literal["text"]


class JsonObjectFormat(_Model):
    type: Literal["json_object"]


class JsonSchemaFormat(_Model):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


def _format_kind(v: Any) -> str | None:
    kind = v.get("type") if isinstance(v, dict) else None
    return f"={kind}" if kind in ("text", "json_object", "json_schema") else None


ResponseFormat = Annotated[
    Annotated[TextFormat, Tag("=text")]
    | Annotated[JsonObjectFormat, Tag("=json_object")]
    | Annotated[JsonSchemaFormat, Tag("=json_schema")],
    Discriminator(_format_kind),
]


class StreamOptions(_Model):
    include_usage: bool = False


class PaskExtension(_Model):
    """The request's ``pask`` extension field (the openai client sends it with ``extra_body``): the
    limits a MetaKV server chooses the request's KV configuration under (docs/metakv.md)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    max_latency_ms: Annotated[float, Field(gt=0)] | None = None
    max_kv_mb: Annotated[float, Field(gt=0)] | None = None


class ChatCompletionRequest(_Model):
    """The body of ``POST /v1/chat/completions`` as this server reads it (other OpenAI fields are ignored)."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    response_format: ResponseFormat | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    stop: Annotated[
        Annotated[str, Tag("=string")] | Annotated[list[str], Tag("=list")],
        Discriminator(_one_of("=string", "=list")),
    ] | None = None  # fmt: skip
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    pask: PaskExtension | None = None


# messages for an error at exactly these parameters (the OpenAI shape of the value)
_SHAPES = {
    "tool_choice": "tool_choice must be 'auto', 'required', 'none' or {'type': 'function', 'function': {'name': ...}}",
    "response_format": "response_format type must be text, json_object or json_schema",
    "max_tokens": "'max_tokens' must be a positive integer",
    "max_completion_tokens": "'max_completion_tokens' must be a positive integer",
    "stop": "'stop' must be a string or a list of strings",
    "temperature": f"'temperature' must be a number in [0, {MAX_TEMPERATURE:g}]",
    "top_p": "'top_p' must be a number in (0, 1]",
    "seed": "'seed' must be a non-negative integer below 2**64",
    "pask.max_latency_ms": "'pask.max_latency_ms' must be a positive number",
    "pask.max_kv_mb": "'pask.max_kv_mb' must be a positive number",
}
_EXPECTED = {
    "string_type": "a string",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    names = {str: "a string", int: "an integer", float: "a number", list: "a list", dict: "an object"}
    return names.get(type(value), "null" if value is None else type(value).__name__)


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not str(part).startswith("="):  # a union branch tag
            out += f".{part}" if out else str(part)
    return out


def _error(err: dict) -> RequestError:
    """The RequestError of one pydantic error."""
    path = _path(err["loc"])
    kind = err["type"]
    if kind == "missing":
        return RequestError(f"missing required parameter: '{path}'", param=path)
    if path in _SHAPES:
        return RequestError(f"{_SHAPES[path]}, got {_short(err.get('input'))}", param=path)
    if kind in _EXPECTED:
        got = _kind(err.get("input"))
        return RequestError(f"invalid type for '{path}': expected {_EXPECTED[kind]}, got {got}", param=path)
    return RequestError(f"invalid value for '{path}': {err['msg']}", param=path)


def _short(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = _kind(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validate_chat_body(body: Any) -> ChatCompletionRequest:
    """The typed request of a parsed body (RequestError naming the first bad parameter)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    check_json_value(body)
    return _typed(body)


def _typed(body: dict) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise _error(e.errors(include_url=False)[0]) from None


def check_json_value(value: Any, where: str = "") -> None:
    """RequestError if ``value`` nests deeper than :data:`MAX_JSON_DEPTH` or holds a lone surrogate
    in a string or key (an iterative walk: no recursion on hostile input)."""
    stack: list[tuple[Any, tuple, int]] = [(value, (), 0)]
    while stack:
        node, loc, depth = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                at = _path((where, *loc) if where else loc) or "body"
                raise RequestError(
                    f"invalid value for '{at}': a lone UTF-16 surrogate (such as \\ud800) is not valid Unicode",
                    param=at if at != "body" else None,
                )
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            at = _path((where, *loc[:2]) if where else loc[:2]) or None
            raise RequestError(f"the request nests deeper than {MAX_JSON_DEPTH} levels (at '{at}')", param=at)
        if isinstance(node, dict):
            for key, sub in node.items():
                if isinstance(key, str) and _SURROGATE.search(key):
                    at = _path((where, *loc) if where else loc) or "body"
                    raise RequestError(f"invalid key in '{at}': a lone UTF-16 surrogate is not valid Unicode",
                                       param=at if at != "body" else None)  # fmt: skip
                stack.append((sub, (*loc, key), depth + 1))
        else:
            stack.extend((sub, (*loc, i), depth + 1) for i, sub in enumerate(node))


@dataclass
class ChatRequest:
    """A validated chat-completion request, ready for the scheduler."""

    request: Request
    mode: str  # text | json | tools | auto
    prompt: str = ""  # the rendered prompt
    stream: bool = False
    include_usage: bool = False
    max_tokens_given: bool = False
    prompt_tools: list[dict] = field(default_factory=list)  # tools shown in the prompt
    tools: list[dict] = field(default_factory=list)  # tools the grammar offers
    limits: dict | None = None  # the ``pask`` extension's limits (MetaKV), as given
    choice: Any = None  # MetaKV's Choice for this request (set by a meta server)
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body (RequestError if malformed, or nested too deep to parse)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, NaN, an integer of over 4300 digits
        raise RequestError(f"malformed JSON body: {e}") from None
    except RecursionError:
        raise RequestError(f"malformed JSON body: it nests deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def _messages(req: ChatCompletionRequest) -> list[dict]:
    """The messages as chat templates want them (text parts joined, tool call arguments as objects)."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls is not None:
            calls = []
            for j, call in enumerate(m.tool_calls):
                args = call.function.arguments
                if isinstance(args, str):
                    where = f"messages[{i}].tool_calls[{j}].function.arguments"
                    try:
                        args = json.loads(args, parse_constant=_no_constant)
                    except (ValueError, RecursionError):
                        raise RequestError(f"'{where}' is not JSON", param=where) from None
                    check_json_value(args, where)
                fn = {"name": call.function.name, "arguments": args}
                calls.append({**({"id": call.id} if call.id is not None else {}), "type": "function", "function": fn})
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tools(req: ChatCompletionRequest) -> list[dict]:
    if not req.tools:
        return []
    out = []
    for i, t in enumerate(req.tools):
        fn = t.function
        params = fn.parameters or {"type": "object", "properties": {}}
        _check_schema(params, f"tools[{i}].function.parameters")
        if "type" not in params:  # arguments are an object (check_tools checks it as one)
            params = {"type": "object", **params}
        spec = {"name": fn.name, **({"description": fn.description} if fn.description is not None else {})}
        out.append({"type": "function", "function": {**spec, "parameters": params}})
    try:  # names, a contradictory or endless schema: a 400 naming the tool and property, before any grammar
        check_tools(out)
    except PaskError as e:
        raise RequestError(str(e), param="tools") from None
    return out


def _check_schema(schema: dict, where: str) -> None:
    """The nesting depth, then the meta-schema (the deeper checks follow in check_tools / check_response_format)."""
    try:
        check_schema_depth(schema, where)
    except PaskError as e:
        raise RequestError(str(e), param=where) from None
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise RequestError(f"{where} is not a valid JSON Schema: {e.message}", param=where) from None


def _tool_choice(req: ChatCompletionRequest, tools: list[dict]) -> tuple[str, list[dict]]:
    """(mode, tools the grammar offers): mode tools | auto | none."""
    choice = req.tool_choice
    if choice is not None and not tools:
        raise RequestError("'tool_choice' needs 'tools'", param="tool_choice")
    if not tools or choice == "none":
        return "none", []
    if choice in (None, "auto"):
        return "auto", tools
    if choice == "required":
        return "tools", tools
    name = choice.function.name
    chosen = [t for t in tools if t["function"]["name"] == name]
    if not chosen:
        raise RequestError(f"tool_choice names '{name}', which is not among the tools", param="tool_choice")
    return "tools", chosen


def _response_schema(req: ChatCompletionRequest) -> dict | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    schema = fmt.json_schema.schema_
    _check_schema(schema, "response_format.json_schema.schema")
    try:
        check_response_format(schema)
    except PaskError as e:
        raise RequestError(str(e), param="response_format") from None
    return schema


def _local_refs(schema: Any) -> bool:
    """Whether a schema holds a local ``$ref`` (``#`` or ``#/...``)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _grammar_tools(tools: list[dict]) -> list[dict]:
    """The tools as the grammar embeds them: parameters with local $refs get an ``$id`` of their own, so
    ``#`` and ``#/$defs/...`` still mean the parameters schema inside the call schema around it."""
    out = []
    for t in tools:
        fn = t["function"]
        params = fn["parameters"]
        if "$id" not in params and _local_refs(params):
            params = {"$id": f"urn:pask:tool:{fn['name']}", **params}
            t = {**t, "function": {**fn, "parameters": params}}
        out.append(t)
    return out


def _grammar(tok, mode: str, tools: list[dict], schema: dict | None) -> str | None:
    if mode == "tools":
        return build_grammar(_grammar_tools(tools), tok)
    if mode == "auto":
        calls = build_grammar(_grammar_tools(tools), tok)
        if not calls.startswith("start: "):
            raise PaskError("unexpected tool-call grammar layout")
        special = marker(tok, TOOL_CALL_OPEN).startswith("<[")
        text = "/(?s:.+)/" if special else "/[^<](?s:.)*/"  # text never starts with the call marker
        return f"start: calls | TEXT\nTEXT: {text}\ncalls: " + calls.removeprefix("start: ")
    if schema is not None:
        return "start: " + lark_json(schema)
    return None


def _compile(tok, grammar: str, param: str) -> Constraint:
    """The grammar's Constraint, its first mask computed once: a grammar llguidance cannot use is
    this request's 400, never an error inside the decode loop (where it would end every request)."""
    try:
        constraint = Constraint(ll_tokenizer(tok, eos_ids(tok)), grammar)
        constraint.mask(allocate_mask(1, constraint.vocab_size), 0)
    except (SchemaError, ValueError, RuntimeError, TypeError) as e:
        raise RequestError(f"the schema cannot be used: {grammar_message(e)}", param=param) from None
    return constraint


def _max_tokens(req: ChatCompletionRequest) -> int | None:
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def _sampling(req: ChatCompletionRequest) -> dict:
    """temperature / top_p / seed for the engine Request, those given that it has (a runtime without
    sampling decodes greedily)."""
    have = {f.name for f in dataclasses.fields(Request)}
    return {k: getattr(req, k) for k in _SAMPLING if k in have and getattr(req, k) is not None}


def build_chat_request(body: dict, tok, model_name: str, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> ChatRequest:
    """Validate an OpenAI chat-completion body and build its engine request (RequestError on bad input).

    ``max_new_tokens`` is the body's ``max_tokens`` (or ``max_completion_tokens``), else
    ``default_max_tokens`` (the caller may lower it to what the KV capacity allows).
    """
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    check_json_value(body)
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError("'model' is required", param="model")
    if model != model_name:
        raise RequestError(f"model '{model}' does not exist; this server serves '{model_name}'", 404, "model",
                           "model_not_found")  # fmt: skip
    req = _typed(body)
    if req.n != 1:
        raise RequestError("only n = 1 is supported", param="n")
    if req.stop not in (None, [], ""):
        raise RequestError("stop sequences are not supported: the grammar decides where outputs end", param="stop")
    messages = _messages(req)
    tools = _tools(req)
    mode, offered = _tool_choice(req, tools)
    schema = _response_schema(req)
    if mode == "none":
        mode = "json" if schema is not None else "text"
    given = _max_tokens(req)
    max_tokens = given or default_max_tokens

    shown = tools if offered else []
    try:
        prompt = build_prompt(tok, FunctionCase("request", "serve", messages, [], tools=shown))
    except jinja2.TemplateError as e:  # a template's raise_exception: roles out of order...
        raise RequestError(f"the model's chat template refuses the messages: {e}", param="messages") from None
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    grammar = _grammar(tok, mode, offered, schema)
    constraint = None
    if grammar is not None:
        constraint = _compile(tok, grammar, "response_format" if mode == "json" else "tools")
    # the closing phase ends structures near the limit; "auto" may be writing text, which it would cut short
    margin = min(CLOSE_MARGIN, max_tokens // 4) if mode in ("tools", "json") else 0
    try:
        request = Request(ids, constraint, max_tokens, close_margin=margin, **_sampling(req))
    except PaskError as e:  # the runtime's own check of the sampling fields
        raise RequestError(str(e), param=next((k for k in _SAMPLING if k in str(e)), None)) from None
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    limits = req.pask.model_dump() if req.pask is not None else None
    return ChatRequest(request, mode, prompt, req.stream, include_usage, given is not None, shown, offered, limits)


def attach_tagging(chat: ChatRequest, tok) -> None:
    """Structural tagger and prompt labels for a policy that reads them (PASK), on tool requests."""
    from pask.structure.json_tagger import JsonCallTagger
    from pask.structure.prompt_labels import label_prompt

    if chat.tools:
        chat.request.tagger = JsonCallTagger(chat.tools)
        chat.request.prompt_labels = label_prompt(tok, chat.prompt, chat.prompt_tools)


# -- responses ----------------------------------------------------------------------------------
def tool_calls_of(text: str) -> list[dict] | None:
    """OpenAI ``tool_calls`` of a tool-call output (None if it holds no complete call)."""
    if "</tool_call>" not in text:
        return None
    try:
        calls = parse_calls(text)
    except PaskError:
        return None
    out = []
    for call in calls:
        ((name, args),) = call.items()
        out.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
        )
    return out or None


def finish_reason(stop: str, calls: list | None) -> str:
    if stop == "length":
        return "length"
    return "tool_calls" if calls else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(chat: ChatRequest, model: str, text: str, stop: str, n_generated: int, extra: dict) -> dict:
    """A non-streaming ``chat.completion`` response."""
    calls = tool_calls_of(text) if chat.mode in ("tools", "auto") else None
    message: dict[str, Any] = {"role": "assistant", "content": None if calls else text}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": chat.id,
        "object": "chat.completion",
        "created": chat.created,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(stop, calls), "logprobs": None}],
        "usage": usage(len(chat.request.prompt_ids), n_generated),
        "pask": extra,
    }


def chunk(chat: ChatRequest, model: str, delta: dict, reason: str | None = None, **more) -> dict:
    """One ``chat.completion.chunk`` of a stream."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]
    return {
        "id": chat.id,
        "object": "chat.completion.chunk",
        "created": chat.created,
        "model": model,
        "choices": choices,
        **more,
    }


def sse(obj: dict | str) -> str:
    """A server-sent event line."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"
