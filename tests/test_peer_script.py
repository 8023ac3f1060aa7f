"""benchmarks/peer_llamacpp.py without llama.cpp: its refusal, its grammar conversion and its table."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks/peer_llamacpp.py"
_SPEC = importlib.util.spec_from_file_location("peer_llamacpp", SCRIPT)
peer = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(peer)

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def _fake_converter(monkeypatch, text: str) -> list:
    seen = []

    def convert(schema: str, prop_order=None):
        seen.append(schema)
        return text

    grammar = types.ModuleType("llama_cpp.llama_grammar")
    grammar.json_schema_to_gbnf = convert
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_grammar", grammar)
    return seen


def test_tool_grammar_wraps_the_converted_call_in_call_blocks(monkeypatch):
    seen = _fake_converter(monkeypatch, 'root ::= "{" space "}"\nspace ::= " "?\n')
    gbnf = peer.tool_gbnf([TOOL])
    assert gbnf.startswith('root ::= "<tool_call>\\n" call-body "\\n</tool_call>"')
    assert 'call-body ::= "{" space "}"' in gbnf and gbnf.count("root ::=") == 1
    assert '"name": {"const": "f"}' in seen[0]  # the call schema of pask's own grammar
    two = peer.tool_gbnf([TOOL, {**TOOL, "function": {**TOOL["function"], "name": "g"}}])
    assert two and '"anyOf"' in seen[-1]


def test_tool_grammar_refuses_a_body_that_refers_to_its_root(monkeypatch):
    _fake_converter(monkeypatch, 'root ::= item\nitem ::= root | "x"\n')
    with pytest.raises(RuntimeError, match="root rule"):
        peer.tool_gbnf([TOOL])


def test_without_llama_cpp_the_script_exits_2_with_the_install_command(tmp_path):
    code = (
        "import sys; sys.modules['llama_cpp'] = None; sys.argv = ['peer', '--skip-speed', '--bfcl', '0']; "
        f"import runpy; runpy.run_path({str(SCRIPT)!r}, run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "pip install llama-cpp-python==0.3.36 diskcache" in proc.stderr


def test_markdown_lists_every_row():
    data = {
        "model": "m",
        "weights": "int8",
        "threads": 2,
        "pask_decode_linears": "native INT8 GEMV",
        "llama_cpp": {"paths": ["AMX model buffer size = 1 MiB"]},
        "speed": [
            {
                "engine": "llama.cpp",
                "setting": "kv q4_0",
                "input": 2048,
                "concurrency": 1,
                "b": 0.28125,
                "prompt_tok_s": 900.0,
                "decode_tok_s": 40.0,
                "kv_bytes": 3.0e6,
                "generated": 30,
            },
            {
                "engine": "pask",
                "setting": "pask@0.25",
                "input": 2048,
                "concurrency": 1,
                "b": None,
                "prompt_tok_s": 800.0,
                "decode_tok_s": None,
                "kv_bytes": None,
                "generated": 1,
            },
        ],
        "accuracy": [{"engine": "pask", "setting": "full", "b": 1.0, "accuracy": 85.0}],
    }
    md = peer.markdown({**data, "speed_adopted": {"file": "f.jsonl", "rows": 2, "code_version": "abc1234"}})
    assert "Speed rows adopted from `f.jsonl` (2 rows, made at abc1234)." in md
    md = peer.markdown(data)
    assert "| 2048 | 1 | llama.cpp | kv q4_0 | 0.281 | 900.0 | 40.00 | 3.0 | 30 |" in md
    assert "| 2048 | 1 | pask | pask@0.25 | – | 800.0 | – | – | 1 |" in md
    assert "| pask | full | 1.000 | 85.0 |" in md and "AMX model buffer" in md
