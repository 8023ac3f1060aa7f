"""OpenAI chat completions: a request body -> an engine :class:`~pask.runtime.engine.Request`, and the responses.

Grammar by request:

* ``tools`` with ``tool_choice`` ``"required"``: one or more native tool-call blocks
  (:func:`pask.tasks.function_calling.build_grammar`); a named function: calls of that function only;
  ``"auto"`` (the default with tools): tool calls or free text (text may not start with the call
  marker); ``"none"``: as without tools.
* ``response_format`` ``{"type": "json_schema", "json_schema": {"schema": ...}}``: JSON of that schema;
  ``{"type": "json_object"}``: any JSON object; ``{"type": "text"}`` or absent: free text.

Forced tool calls and JSON close their structure in the last quarter of ``max_tokens`` (at most
``CLOSE_MARGIN`` tokens: the engine's closing phase); ``auto`` and text requests are not closed
early. Every problem with a request is a :class:`RequestError` carrying its HTTP status and an
OpenAI-style error body; tool schemas are checked first (:func:`pask.tasks.function_calling.check_tools`),
so a contradictory one is a 400 naming the tool and the property.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from pask.errors import PaskError
from pask.runtime.tokens import Request, eos_ids
from pask.structure.constraint import Constraint, SchemaError, lark_json, ll_tokenizer
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
CLOSE_MARGIN = 128  # closing phase of tool / JSON requests: at most this many last tokens, a quarter of max_tokens
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class RequestError(PaskError):
    """A request the server refuses: HTTP ``status`` and an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = "not_found_error" if self.status == 404 else "invalid_request_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


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
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body (RequestError if malformed)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise RequestError(f"messages[{i}] needs a role (system, user, assistant or tool)", param="messages")
        m = dict(m)
        if m["role"] == "developer":
            m["role"] = "system"
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content):
                raise RequestError(f"messages[{i}]: only text content parts are supported", param="messages")
            m["content"] = "".join(texts)
        elif content is None:
            m["content"] = ""
        elif not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or a list of text parts", param="messages")
        for call in m.get("tool_calls") or []:  # chat templates want arguments as an object
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    raise RequestError(f"messages[{i}]: tool call arguments are not JSON", param="messages") from None
        out.append(m)
    return out


def _tools(body: dict) -> list[dict]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list", param="tools")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
            raise RequestError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}} with a name of "
                "letters, digits, '_' or '-' (at most 64)",
                param="tools",
            )
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        _check_schema(params, f"tools[{i}].function.parameters")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise RequestError("tool names must be unique", param="tools")
    try:  # a contradictory schema: a 400 naming the tool and property, before any grammar is built
        check_tools(out)
    except PaskError as e:
        raise RequestError(str(e), param="tools") from None
    return out


def _check_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise RequestError(f"{where} must be a JSON Schema object", param=where)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise RequestError(f"{where} is not a valid JSON Schema: {e.message}", param=where) from None


def _tool_choice(body: dict, tools: list[dict]) -> tuple[str, list[dict]]:
    """(mode, tools the grammar offers): mode tools | auto | none."""
    choice = body.get("tool_choice")
    if choice is not None and not tools:
        raise RequestError("'tool_choice' needs 'tools'", param="tool_choice")
    if not tools or choice == "none":
        return "none", []
    if choice in (None, "auto"):
        return "auto", tools
    if choice == "required":
        return "tools", tools
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if isinstance(choice, dict) and choice.get("type", "function") == "function" and isinstance(name, str):
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise RequestError(f"tool_choice names '{name}', which is not among the tools", param="tool_choice")
        return "tools", chosen
    raise RequestError(
        "tool_choice must be 'auto', 'required', 'none' or {'type': 'function', 'function': {'name': ...}}",
        param="tool_choice",
    )


def _response_schema(body: dict) -> dict | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise RequestError("response_format json_schema needs {'json_schema': {'schema': ...}}", "response_format")
        _check_schema(spec["schema"], "response_format.json_schema.schema")
        return spec["schema"]
    raise RequestError("response_format type must be text, json_object or json_schema", param="response_format")


def _grammar(tok, mode: str, tools: list[dict], schema: dict | None) -> str | None:
    if mode == "tools":
        return build_grammar(tools, tok)
    if mode == "auto":
        calls = build_grammar(tools, tok)
        if not calls.startswith("start: "):
            raise PaskError("unexpected tool-call grammar layout")
        special = marker(tok, TOOL_CALL_OPEN).startswith("<[")
        text = "/(?s:.+)/" if special else "/[^<](?s:.)*/"  # text never starts with the call marker
        return f"start: calls | TEXT\nTEXT: {text}\ncalls: " + calls.removeprefix("start: ")
    if schema is not None:
        return "start: " + lark_json(schema)
    return None


def _max_tokens(body: dict) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if v is not None:
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise RequestError(f"'{key}' must be a positive integer", param=key)
            return v
    return None


def build_chat_request(body: dict, tok, model_name: str, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> ChatRequest:
    """Validate an OpenAI chat-completion body and build its engine request (RequestError on bad input).

    ``max_new_tokens`` is the body's ``max_tokens`` (or ``max_completion_tokens``), else
    ``default_max_tokens`` (the caller may lower it to what the KV capacity allows).
    """
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError("'model' is required", param="model")
    if model != model_name:
        raise RequestError(f"model '{model}' does not exist; this server serves '{model_name}'", 404, "model",
                           "model_not_found")  # fmt: skip
    if body.get("n", 1) != 1:
        raise RequestError("only n = 1 is supported", param="n")
    if body.get("stop") not in (None, [], ""):
        raise RequestError("stop sequences are not supported: the grammar decides where outputs end", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", param="stream")
    opts = body.get("stream_options") or {}
    messages = _messages(body)
    tools = _tools(body)
    mode, offered = _tool_choice(body, tools)
    schema = _response_schema(body)
    if mode == "none":
        mode = "json" if schema is not None else "text"
    given = _max_tokens(body)
    max_tokens = given or default_max_tokens

    shown = tools if offered else []
    prompt = build_prompt(tok, FunctionCase("request", "serve", messages, [], tools=shown))
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    grammar = _grammar(tok, mode, offered, schema)
    constraint = None
    if grammar is not None:
        try:
            constraint = Constraint(ll_tokenizer(tok, eos_ids(tok)), grammar)
        except SchemaError as e:
            param = "response_format" if mode == "json" else "tools"
            raise RequestError(f"the schema cannot be used: {e}", param=param) from None
    # the closing phase ends structures near the limit; "auto" may be writing text, which it would cut short
    margin = min(CLOSE_MARGIN, max_tokens // 4) if mode in ("tools", "json") else 0
    request = Request(ids, constraint, max_tokens, close_margin=margin)
    include_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
    return ChatRequest(request, mode, prompt, stream, include_usage, given is not None, shown, offered)


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
