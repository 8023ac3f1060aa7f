"""The public Python API (pask.load, pask.generate) and the README's example."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import pask
from pask.errors import PaskError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def test_generate_returns_calls_budget_and_timings(smol):
    out = pask.generate(smol, MESSAGES, tools=TOOLS, policy="kivi-4", budget=0.5, max_new_tokens=48)
    assert out.stop_reason in ("grammar", "length", "eos")
    assert out.calls is not None and all(c["name"] == "get_weather" for c in out.calls)
    assert 0 < out.budget["b_total"] <= 1
    assert set(out.timings) == {"prefill_ms", "tpot_ms"}


def test_full_kv_is_the_default_and_measures_b_one(smol):
    out = pask.generate(smol, MESSAGES, tools=TOOLS, max_new_tokens=32)
    assert out.budget["b_total"] == 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budget": 0.0, "policy": "kivi-4"}, "budget"),
        ({"budget": 1.5, "policy": "kivi-4"}, "budget"),
        ({"policy": "pask"}, "needs a budget"),
        ({"policy": "nosuch", "budget": 0.5}, "nosuch"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_arguments_are_clear_errors(smol, kwargs, message):
    with pytest.raises(PaskError, match=message):
        pask.generate(smol, MESSAGES, tools=TOOLS, **kwargs)


def test_unsatisfiable_tool_schema_names_tool_and_property(smol):
    bad = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 1}},
                    "required": ["n"],
                },
            },
        }
    ]
    with pytest.raises(PaskError, match=r"tool 'f', property 'n'"):
        pask.generate(smol, MESSAGES, tools=bad)


def test_load_refuses_bad_dtype_and_weights():
    with pytest.raises(PaskError, match="dtype must be one of"):
        pask.load("smollm2-135m", dtype="int3")
    with pytest.raises(PaskError, match="weight format must be one of"):
        pask.load("smollm2-135m", weights="int2")


def test_unknown_attribute():
    with pytest.raises(AttributeError):
        _ = pask.nothing_here


@pytest.mark.slow
def test_readme_example_runs():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if b.startswith("import pask")]
    exec(compile(code, "README.md", "exec"), {})
