"""`pask` command line: generate, eval, bench, inspect.

Every user error (bad model name, corrupt model part, bad request file, unknown
category, ...) is a :class:`PaskError`: one clear message, exit code 2, no traceback.
"""

from __future__ import annotations

import functools
import json
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from pask.errors import PaskError
from pask.models import DEFAULT_MODEL

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Parser-aware structural KV persistence.")
eval_app = typer.Typer(no_args_is_help=True, help="Evaluate a model + KV policy on a task.")
bench_app = typer.Typer(no_args_is_help=True, help="Micro-benchmarks.")
app.add_typer(eval_app, name="eval")
app.add_typer(bench_app, name="bench")
console = Console(stderr=True)


def user_errors(fn):
    """Turn PaskError (and a few predictable OS errors) into one message + exit 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PaskError as e:
            console.print(f"[bold red]error:[/] {e}")
            raise typer.Exit(2) from None
        except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
            console.print(f"[bold red]error:[/] {e.strerror}: {e.filename}")
            raise typer.Exit(2) from None

    return wrapper


def _threads(n: int | None) -> None:
    import torch

    if n:
        torch.set_num_threads(n)


def _dtype(name: str):
    import torch

    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
    if name not in table:
        raise PaskError(f"unknown dtype '{name}'; choose bf16 or fp32")
    return table[name]


def progress_bar() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )


@app.command()
@user_errors
def generate(
    request_file: Annotated[Path, typer.Argument(help="JSON file: {'messages': [...], 'tools': [...]}")],
    model: Annotated[str, typer.Option(help="embedded name, local dir or hub id")] = DEFAULT_MODEL,
    max_new_tokens: int = 384,
    dtype: str = "bf16",
    threads: int | None = None,
    save_tags: Annotated[bool, typer.Option(help="include per-token structural tags")] = False,
) -> None:
    """Run one request (messages + OpenAI-style tools) under the tool-call grammar; print the calls."""
    from pask.engine import Request, eos_ids
    from pask.engine import generate as run
    from pask.models import load_model
    from pask.structure.constraint import Constraint, ll_tokenizer
    from pask.tasks.function_calling import build_grammar, parse_calls

    req = _read_request(request_file)
    _threads(threads)
    lm = load_model(model, dtype=_dtype(dtype))
    tok = lm.tokenizer
    prompt = tok.apply_chat_template(req["messages"], tools=req["tools"], add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    constraint = Constraint(ll_tokenizer(tok, eos_ids(tok)), build_grammar(req["tools"], tok))
    request = Request(ids, constraint, max_new_tokens, parse=parse_calls)
    if save_tags:
        from pask.structure.json_tagger import JsonCallTagger

        request.tagger = JsonCallTagger(req["tools"])
    (g,) = run(lm, [request])
    result = {"calls": g.parsed, "text": g.text, "stop": g.stop_reason, "tpot_ms": round(g.tpot_ms, 2)}
    if save_tags:
        pieces = [tok.decode([t]) for t in g.token_ids]
        result["tags"] = [{"token": p, "tag": str(t)} for p, t in zip(pieces, g.extra["tags"], strict=True)]
    print(json.dumps(result))


def _read_request(path: Path) -> dict:
    try:
        req = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PaskError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(req, dict) or not isinstance(req.get("messages"), list) or not req["messages"]:
        raise PaskError(f"{path}: expected an object with a non-empty 'messages' list")
    tools = req.get("tools")
    if not isinstance(tools, list) or not tools:
        raise PaskError(f"{path}: expected a non-empty 'tools' list")
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise PaskError(f"{path}: every tool needs {{'type': 'function', 'function': {{'name': ...}}}}")
        fn.setdefault("parameters", {"type": "object", "properties": {}})
    return req


@eval_app.command("bfcl")
@user_errors
def eval_bfcl(
    model: Annotated[str, typer.Option(help="embedded name, local dir or hub id")] = DEFAULT_MODEL,
    policy: Annotated[str, typer.Option(help="KV policy")] = "full",
    budget: Annotated[float | None, typer.Option(help="target total KV budget B in (0, 1]")] = None,
    split: Annotated[str, typer.Option(help="calibration | dev | test | all")] = "test",
    categories: Annotated[str, typer.Option(help="comma-separated BFCL categories")] = (
        "simple,multiple,parallel,parallel_multiple"
    ),
    limit: Annotated[int | None, typer.Option(help="at most N cases per category")] = None,
    batch_size: Annotated[int, typer.Option(help="requests decoded together")] = 8,
    max_new_tokens: int = 384,
    out: Annotated[Path | None, typer.Option(help="output dir (resumes if it has results)")] = None,
    dtype: str = "bf16",
    threads: int | None = None,
    save_tags: Annotated[bool, typer.Option(help="store per-token tags and prompt labels")] = False,
    policy_config: Annotated[str | None, typer.Option(help="policy parameters as JSON")] = None,
    table: Annotated[Path | None, typer.Option(help="frozen PASK table (with --policy pask)")] = None,
    allow_transfer: Annotated[bool, typer.Option(help="use a PASK table calibrated on another model")] = False,
) -> None:
    """Evaluate BFCL categories; writes cases.jsonl, summary.json and summary.md (paper Table 1 layout)."""
    from pask.evaluation.run_bfcl import run_bfcl, table_markdown
    from pask.models import load_model
    from pask.tasks.function_calling import load_cases

    cats = [c.strip() for c in categories.split(",") if c.strip()]
    cases = load_cases(cats, split=split, limit=limit)  # validates categories/split before the model loads
    if not cases:
        raise PaskError(f"no cases for categories {cats} in split '{split}'")
    if budget is not None and not 0 < budget <= 1:
        raise PaskError(f"--budget must be in (0, 1], got {budget}")
    if policy == "pask" and table is None:
        raise PaskError("--policy pask needs --table FILE (made by `pask calibrate`)")
    kv_policy = None if policy == "pask" else make_policy(policy, budget, policy_config)
    out = out or Path("runs") / f"bfcl-{model.replace('/', '_')}-{policy}-{split}"
    _threads(threads)
    lm = load_model(model, dtype=_dtype(dtype))
    if policy == "pask":
        from pask.policies.pask import make_pask_policy

        kv_policy = make_pask_policy(table, budget, fingerprint=lm.fingerprint, allow_transfer=allow_transfer)
    meta = {"model": lm.name, "policy": policy, "budget": budget, "split": split, "categories": cats}
    meta["command"] = "pask " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    with progress_bar() as bar:
        task = bar.add_task(f"bfcl {policy}", total=len(cases))
        advance = lambda n: bar.advance(task, n)  # noqa: E731
        summary = run_bfcl(lm, cases, out, batch_size, max_new_tokens, kv_policy, advance, meta, save_tags)
    print(table_markdown(summary, meta))
    console.print(f"results: {out}/")


@app.command()
@user_errors
def inspect(
    case: Annotated[str, typer.Option(help="BFCL case id, e.g. simple_python_0")],
    task: Annotated[str, typer.Option(help="task (bfcl)")] = "bfcl",
    model: Annotated[str, typer.Option(help="embedded name, local dir or hub id")] = DEFAULT_MODEL,
    html: Annotated[Path | None, typer.Option(help="also write a self-contained HTML page")] = None,
    max_new_tokens: int = 384,
    threads: int | None = None,
) -> None:
    """Run one case; show prompt labels and generated tokens with their structural tags (coloured)."""
    from pask.engine import generate as run
    from pask.evaluation.run_bfcl import prepare
    from pask.inspect import render, write_html
    from pask.models import load_model
    from pask.tasks.function_calling import find_case

    if task != "bfcl":
        raise PaskError(f"unknown task '{task}'; inspect supports: bfcl")
    c = find_case(case)
    _threads(threads)
    lm = load_model(model)
    req, err = prepare(lm, c, max_new_tokens, tagging=True)
    if err:
        raise PaskError(f"{case}: {err}")
    (g,) = run(lm, [req])
    tok = lm.tokenizer
    console = render(
        [tok.decode([t]) for t in req.prompt_ids],
        req.prompt_labels,
        [tok.decode([t]) for t in g.token_ids],
        g.extra["tags"],
        f"{c.id} ({lm.name})",
    )
    if html:
        write_html(console, html)
        globals()["console"].print(f"wrote {html}")


@app.command()
@user_errors
def calibrate(
    model: Annotated[str, typer.Option(help="embedded name, local dir or hub id")] = DEFAULT_MODEL,
    task: Annotated[str, typer.Option(help="task (bfcl)")] = "bfcl",
    split: Annotated[str, typer.Option(help="calibration split (never test or live)")] = "calibration",
    budget: Annotated[float, typer.Option(help="target total KV budget B in (0, 1]")] = 0.33,
    out: Annotated[Path, typer.Option(help="table file to write (work dir beside it; resumable)")] = Path(
        "pask-table.json"
    ),
    limit: Annotated[int | None, typer.Option(help="at most N cases per category")] = None,
    batch_size: int = 8,
    dtype: str = "bf16",
    threads: int | None = None,
) -> None:
    """Offline calibration: sensitivity floors + distortion-ranked upgrades -> frozen PASK table."""
    from pask.calibration.calibrate import calibrate_command, report_path_for

    if not 0 < budget <= 1:
        raise PaskError(f"--budget must be in (0, 1], got {budget}")
    _threads(threads)
    with progress_bar() as bar:
        tasks: dict[str, int] = {}

        def progress(phase: str, advance: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], advance=advance, total=total)

        table = calibrate_command(model, task, split, budget, out, limit, batch_size, _dtype(dtype), progress)
    console.print(f"table: {out} (expected B {table.expected_b:.3f}); report: {report_path_for(out)}")


@bench_app.command("kv")
@user_errors
def bench_kv_cmd(
    model: Annotated[str, typer.Option(help="embedded name, local dir or hub id")] = DEFAULT_MODEL,
    contexts: Annotated[str, typer.Option(help="comma-separated context lengths")] = "2048,8192,32768",
    mix: Annotated[str, typer.Option(help="H:INT4:release fractions outside the recent window")] = "0.34:0.33:0.33",
    repeats: int = 30,
    threads: int = 1,
    as_json: Annotated[bool, typer.Option("--json", help="print the raw JSON result")] = False,
) -> None:
    """KV bytes held vs Full KV, cost-model discrepancy, mixed vs full decode-attention time, model step time."""
    from pask.kv.bench import bench_kv

    try:
        ctx = [int(c) for c in contexts.split(",") if c.strip()]
        fractions = [float(x) for x in mix.split(":")]
    except ValueError:
        raise PaskError("--contexts takes integers like 2048,8192 and --mix fractions like 0.34:0.33:0.33") from None
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        raise PaskError(f"--mix must be three non-negative fractions summing to 1, got {mix}")
    if not ctx or min(ctx) < 16:
        raise PaskError("--contexts must be lengths >= 16")
    result = bench_kv(model, ctx, fractions, repeats=repeats, threads=threads)
    if as_json:
        print(json.dumps(result, indent=2))
        return
    nan = float("nan")
    table = [
        "| context | B measured | B cost model | attention speed-up | model step speed-up |",
        "|---|---|---|---|---|",
    ]
    for c in result["contexts"]:
        cells = (
            str(c["context"]),
            f"{c.get('b_measured', nan):.4f}",
            f"{c.get('b_cost_model', nan):.4f}",
            f"{c.get('attention_speedup', nan):.2f}x",
            f"{c.get('model_step_speedup_vs_full_tiered', nan):.2f}x",
        )
        table.append("| " + " | ".join(cells) + " |")
    print("\n".join(table))


def make_policy(name: str, budget: float | None, config: str | None = None):
    """The policy object for a name; ``full`` is Full KV on DynamicCache (None).

    Budget-controlled policies start from their tuned configuration (``pask/policies/configs.json``,
    written by tuning on the dev split) at that budget; ``--policy-config`` overrides it.
    """
    from pask.policies import get_policy
    from pask.policies.tuning import tuned_config

    try:
        user = json.loads(config) if config else {}
    except json.JSONDecodeError as e:
        raise PaskError(f"--policy-config is not valid JSON: {e}") from None
    if not isinstance(user, dict):
        raise PaskError("--policy-config must be a JSON object")
    if name == "full":
        if budget not in (None, 1.0) or user:
            raise PaskError("policy 'full' keeps every token (B = 1) and takes no configuration")
        return None
    kwargs = dict(user)
    if budget is not None:
        kwargs = {**tuned_config(name, budget), **user, "budget": budget}
    try:
        return get_policy(name, **kwargs)
    except TypeError as e:
        raise PaskError(f"bad configuration for policy '{name}': {e}") from None


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
