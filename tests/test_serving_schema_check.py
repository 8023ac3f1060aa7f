"""The server checks tool schemas before any grammar is built or any decoding starts: an
unsatisfiable one is an HTTP 400 naming the tool and the property (``check_tools``)."""

from __future__ import annotations

import json

import httpx2 as httpx
import pytest

from pask.policies import FullPolicy
from pask.serving.protocol import RequestError, build_chat_request

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
UNSATISFIABLE = {
    "minimum above maximum": ({"type": "integer", "minimum": 10, "maximum": 1}, "minimum 10 > maximum 1"),
    "empty enum": ({"type": "string", "enum": []}, "enum is empty"),
}


def _body(prop: dict, **more) -> dict:
    params = {"type": "object", "properties": {"days": prop}, "required": ["days"]}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": params}}
    return {"model": "smollm2-135m", "messages": ASK, "tools": [tool], **more}


@pytest.fixture(scope="module")
def server(smol):
    """The app on a loopback port (uvicorn in a thread), Full KV."""
    from pask.serving.server import Service, serve_in_thread

    service = Service.build(smol, FullPolicy, capacity_tokens=4096, default_max_tokens=16)
    with serve_in_thread(service, start_timeout=30) as url:
        yield url, service


@pytest.mark.parametrize("case", list(UNSATISFIABLE))
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_unsatisfiable_tool_schema_is_a_400_naming_tool_and_property(server, case, choice):
    url, service = server
    prop, words = UNSATISFIABLE[case]
    before = service.metrics.requests.get("rejected", 0)
    r = httpx.post(
        f"{url}/v1/chat/completions",
        content=json.dumps(_body(prop, tool_choice=choice)),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "tools"
    assert "tool 'get_weather', property 'days'" in err["message"] and words in err["message"]
    assert service.metrics.requests.get("rejected", 0) == before + 1  # refused at validation, never decoded


def test_the_check_runs_before_the_tokenizer_is_used():
    """build_chat_request refuses the tools before it renders a prompt or compiles a grammar."""

    class NoTokenizer:
        def __getattr__(self, name):
            raise AssertionError(f"the tokenizer was used ({name})")

        def __call__(self, *args, **kwargs):
            raise AssertionError("the tokenizer was used")

    for prop, words in UNSATISFIABLE.values():
        with pytest.raises(RequestError, match=words) as e:
            build_chat_request(_body(prop), NoTokenizer(), "smollm2-135m")
        assert e.value.status == 400 and e.value.param == "tools" and "property 'days'" in str(e.value)
