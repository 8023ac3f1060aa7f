"""`pask` command line: generate, eval, bench, inspect.

Every user error (bad model name, corrupt model part, bad request file, unknown
category, ...) is a :class:`PaskError`: one clear message, exit code 2, no traceback.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shlex
import sys
import time
import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from pask.errors import PaskError
from pask.evaluation.continuous import check_batching
from pask.experiments.sweep import code_version, file_sha256, machine
from pask.kv.budget import check_budget
from pask.policies.factory import make_policy
from pask.runtime.models import DEFAULT_MODEL
from pask.serving.replicas import serving_model, serving_policy_factory

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Parser-aware structural KV persistence.")
bench_app = typer.Typer(no_args_is_help=True, help="Micro-benchmarks.")
app.add_typer(bench_app, name="bench")
meta_app = typer.Typer(
    no_args_is_help=True, help="MetaKV: choose a KV configuration per request under latency and memory limits."
)
app.add_typer(meta_app, name="meta")
console = Console(stderr=True)


def _error(message: str) -> None:
    """One error line: never hard-wrapped (a path in it stays copyable), brackets printed as they are."""
    from rich.markup import escape

    console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)


def user_errors(fn):
    """Turn PaskError (and a few predictable OS errors) into one message + exit 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PaskError as e:
            _error(str(e))
            raise typer.Exit(2) from None
        except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
            _error(f"{e.strerror}: {e.filename}")
            raise typer.Exit(2) from None

    return wrapper


# options shared by several commands
ModelOpt = Annotated[str, typer.Option(help="embedded name, local dir or hub id")]
BudgetOpt = Annotated[float | None, typer.Option(help="target total KV budget B in (0, 1]")]
BatchOpt = Annotated[int, typer.Option(help="requests decoded together")]
BatchingOpt = Annotated[
    str, typer.Option(help="static (a batch runs to its longest case) or continuous (a freed row takes the next case)")
]
OutDirOpt = Annotated[Path | None, typer.Option(help="output dir (resumes if it has results)")]
SaveTagsOpt = Annotated[bool, typer.Option(help="store per-token tags and prompt labels")]
PolicyConfigOpt = Annotated[str | None, typer.Option(help="policy parameters as JSON")]
TableOpt = Annotated[Path | None, typer.Option(help="frozen PASK table (with --policy pask)")]
TransferOpt = Annotated[bool, typer.Option(help="use a PASK table calibrated on another model or task")]
PrefillStoreOpt = Annotated[
    Path | None,
    typer.Option(help="reuse prompt prefills across runs from this directory (sets $PASK_PREFILL_STORE)"),
]
DtypeOpt = Annotated[str, typer.Option(help="weights' dtype: bf16, fp32 or fp16")]
WeightsOpt = Annotated[
    str | None,
    typer.Option(
        help="linear layers' format: bf16, int8 or int4 (weight-only, groups of 32; docs/performance.md); "
        "default $PASK_WEIGHTS or bf16"
    ),
]
MetaOpt = Annotated[Path | None, typer.Option(help="--policy meta: the MetaKV predictor file (`pask meta fit`)")]
MaxLatencyOpt = Annotated[
    float | None,
    typer.Option(help="--policy meta: latency limit in ms (serve: the default; a request's own overrides it)"),
]
MaxKvOpt = Annotated[
    float | None,
    typer.Option(help="--policy meta: KV limit in MB = 10^6 bytes (serve: the default; a request's own overrides it)"),
]
ThreadsOpt = Annotated[int | None, typer.Option(help="torch threads (default: torch's choice)")]


def _threads(n: int | None, prefill_store: Path | None = None) -> None:
    """Set torch's thread count and, if given, the prefill store (:mod:`pask.runtime.prefill_store`)."""
    import torch

    if n:
        torch.set_num_threads(n)
    if prefill_store is not None:
        from pask.runtime.prefill_store import ENV

        os.environ[ENV] = str(prefill_store)


def _dtype(name: str):
    from pask.serving.replicas import torch_dtype

    return torch_dtype(name)


def progress_bar() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )


def load_pask_table(table: Path | None, task: str, fingerprint: str | None, allow_transfer: bool = False):
    """The frozen PASK table of ``--table``, checked against the model's fingerprint and the task."""
    from pask.policies.table import load

    if table is None:
        raise PaskError(f"--policy pask needs --table FILE (made by `pask calibrate --task {task}`)")
    from pask.policies.pask import check_task

    frozen = load(table, fingerprint=fingerprint, allow_transfer=allow_transfer)
    if check_task(frozen, task, allow_transfer):
        console.print(f"[yellow]warning:[/] {table} was calibrated for task '{frozen.task}', used on '{task}'")
    return frozen


def _policy_builder(task: str, policy: str, budget: float | None, config: str | None, table, allow_transfer: bool):
    """Check an eval's policy arguments before the model loads; return ``lm -> KV policy`` (None: Full KV)."""
    if budget is not None:
        check_budget(budget, "--budget")
    if policy not in ("pask", "fetch-pask"):
        kv_policy = make_policy(policy, budget, config, task)
        return lambda lm: kv_policy
    if table is None:
        raise PaskError(f"--policy {policy} needs --table FILE (made by `pask calibrate --task {task}`)")
    fetch = None
    if policy == "fetch-pask":  # KVFetch around PASK: the configuration is the wrapper's
        from pask.policies.factory import fetch_pask_options

        fetch = fetch_pask_options(config)  # checked before the model loads
    elif config is not None:
        raise PaskError("--policy pask takes its configuration from --table, not --policy-config")

    def build(lm):
        from pask.policies.pask import make_pask_policy

        frozen = load_pask_table(table, task, lm.fingerprint, allow_transfer)
        pask = make_pask_policy(frozen, budget if fetch is None else None)  # fetch-pask: a hot-budget table
        if fetch is None:
            return pask
        from pask.policies.factory import make_fetch

        return make_fetch(policy, budget, fetch, task, inner=pask)

    return build


def _meta_options(task: str, meta: Path | None, max_latency_ms, max_kv_mb, budget, table, policy_config):
    """`--policy meta`'s options (`pask eval`, `pask serve`), checked before the model loads: the
    predictor (format and task; its model once loaded: ``MetaPredictor.check_model``) and the limits."""
    from pask.meta.predictor import load as load_predictor
    from pask.meta.selection import Constraints, check_limit

    if meta is None:
        raise PaskError("--policy meta needs --meta FILE (a predictor made by `pask meta fit`)")
    if budget is not None or table is not None or policy_config is not None:
        raise PaskError("--policy meta takes its configurations from --meta, not --budget / --table / --policy-config")
    limits = Constraints(check_limit(max_latency_ms, "--max-latency-ms"), check_limit(max_kv_mb, "--max-kv-mb"))
    return load_predictor(meta, task=task), limits


def _meta_builder(task: str, meta: Path | None, max_latency_ms, max_kv_mb, budget, table, policy_config):
    """`pask eval --policy meta`: (``(lm, batch_size) -> MetaSelector``, the settings' record of the
    predictor and limits)."""
    from pask.meta.selector import MetaSelector

    pred, limits = _meta_options(task, meta, max_latency_ms, max_kv_mb, budget, table, policy_config)

    def build(lm, batch_size: int):
        pred.check_model(lm.fingerprint)
        return MetaSelector(pred, limits, fingerprint=lm.fingerprint, batch_size=batch_size)

    return build, json.dumps({"meta_sha256": file_sha256(meta), **limits.to_json()})


def _command() -> str:
    """This process's command line as a shell would retype it."""
    return "pask " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _run_meta(meta: dict, table: Path | None = None) -> dict:
    """An eval's run record plus the command line, the code version and the PASK table's hash."""
    out = {**meta, "command": _command(), "code_version": code_version(), "machine": machine()}
    if table is not None:
        out["table_sha256"] = file_sha256(Path(table))
    return out


def _with_progress(label: str, total: int, run):
    """``run(advance)`` under one progress bar of ``total`` cases."""
    with progress_bar() as bar:
        task = bar.add_task(label, total=total)
        return run(lambda n: bar.advance(task, n))


@app.command()
@user_errors
def generate(
    request_file: Annotated[
        Path,
        typer.Argument(help="JSON file: {'messages': [...], 'tools': [...]} (or 'response_format' for JSON output)"),
    ],
    model: ModelOpt = DEFAULT_MODEL,
    policy: Annotated[str, typer.Option(help="KV policy (full, pask, kivi-4, snapkv, h2o, ...)")] = "full",
    budget: BudgetOpt = None,
    table: TableOpt = None,
    policy_config: PolicyConfigOpt = None,
    allow_transfer: TransferOpt = False,
    max_new_tokens: Annotated[int, typer.Option(help="at most this many generated tokens")] = 384,
    dtype: DtypeOpt = "bf16",
    weights: WeightsOpt = None,
    threads: ThreadsOpt = None,
    save_tags: Annotated[bool, typer.Option(help="include each generated token's structural tag")] = False,
) -> None:
    """Run one request under the tool-call grammar (or a JSON schema) with a KV policy; print one JSON line.

    The line holds the calls, the text, the stop reason, the measured budget B and the timings.
    --policy pask without --table takes the committed table for the model and budget (pask/tables/).
    The request, its schemas and the policy options are checked before the model loads.
    """
    from pask import api

    req = _read_request(request_file)
    if max_new_tokens < 1:
        raise PaskError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    dtype = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(dtype, dtype)
    if dtype not in ("bf16", "fp32", "fp16"):
        raise PaskError(f"unknown dtype '{dtype}'; choose bf16, fp32 or fp16")
    weights = _weights(weights)
    table, frozen, config = _generate_policy(model, policy, budget, table, policy_config, allow_transfer)
    _threads(threads)
    lm = api.load(model, dtype, weights)
    if frozen is not None and frozen.fingerprint != lm.fingerprint and not allow_transfer:
        raise PaskError(
            f"{table} was calibrated on model {frozen.model_name or '?'} ({frozen.fingerprint}), not on "
            f"{lm.name} ({lm.fingerprint}): calibrate a table for this model (`pask calibrate`), "
            "or pass --allow-transfer to use it anyway"
        )
    with warnings.catch_warnings(record=True) as caught:  # a calibration transfer's warning: one line
        warnings.simplefilter("always", UserWarning)
        out = api.generate(
            lm,
            req["messages"],
            tools=req.get("tools"),
            response_format=req.get("response_format"),
            policy=policy,
            budget=budget,
            table=table,
            policy_config=config,
            max_new_tokens=max_new_tokens,
            allow_transfer=allow_transfer,
            save_tags=save_tags,
        )
    for w in caught:
        console.print(f"[yellow]warning:[/] {w.message}")
    result = {"model": lm.name, "policy": policy, "target_b": budget}
    if table is not None:
        result["table"] = str(table)
    result |= {"calls": out.calls, "text": out.text, "stop_reason": out.stop_reason}
    if req.get("response_format") is not None:
        result["value"] = out.value
    result |= {"n_generated": len(out.token_ids), "budget": out.budget, "timings": out.timings}
    if save_tags and out.tags is not None:
        pieces = [lm.tokenizer.decode([t]) for t in out.token_ids]
        result["tags"] = [{"token": p, "tag": t} for p, t in zip(pieces, out.tags, strict=True)]
    print(json.dumps(result))


def _generate_policy(
    model: str, policy: str, budget: float | None, table: Path | None, config: str | None, allow_transfer: bool
):
    """Check `pask generate`'s policy options before the model loads: (the PASK table's path, the
    table, the parsed --policy-config). ``--policy pask`` without ``--table`` takes the committed
    table of the model and budget; a table's file, format, task and budget are checked here, its
    model fingerprint after the load."""
    if budget is not None:
        check_budget(budget, "--budget")
    if policy != "pask":
        if table is not None:
            raise PaskError("--table is for --policy pask")
        make_policy(policy, budget, config)  # unknown policy, bad budget or configuration
        return None, None, json.loads(config) if config else None
    if config:
        raise PaskError("--policy-config does not apply to --policy pask: its parameters are the table's")
    if budget is None:
        raise PaskError("--policy pask needs --budget B (the budget its table was calibrated for, e.g. 0.33)")
    if table is None:
        from pask.policies.table import default_table

        table = default_table(model, "bfcl", budget)
        if table is None:
            raise PaskError(
                f"--policy pask needs --table FILE: no committed PASK table for model '{model}' at budget {budget:g} "
                f"(committed: {_committed_tables()}); make one with "
                f"`pask calibrate --task bfcl --model {model} --budget {budget:g} --out T.json`"
            )
    frozen = load_pask_table(table, "bfcl", None, allow_transfer)
    if frozen.target_b is not None and abs(frozen.target_b - budget) > 1e-9:
        raise PaskError(f"{table} was calibrated for B = {frozen.target_b:g}, not --budget {budget:g}")
    return table, frozen, None


def _committed_tables() -> str:
    """The committed function-calling tables, e.g. ``qwen2.5-coder-0.5b at B 0.25, 0.33``."""
    import re

    from pask.policies.table import INDEXED_DEFAULTS, TABLES_DIR

    found: dict[str, list[float]] = {}
    for path in TABLES_DIR.glob("*-bfcl-b*.json"):
        if m := re.fullmatch(r"(.+)-bfcl-b([0-9.]+)\.json", path.name):
            found.setdefault(m[1], []).append(float(m[2]))
    for (model, task, budget), name in INDEXED_DEFAULTS.items():
        if task == "bfcl" and (TABLES_DIR / name).is_file():
            found.setdefault(model, []).append(float(budget))
    return "; ".join(f"{k} at B {', '.join(f'{b:g}' for b in sorted(v))}" for k, v in sorted(found.items())) or "none"


def _read_request(path: Path) -> dict:
    """The request file's object: 'messages' and 'tools' or 'response_format', checked (tool schemas
    included, :func:`pask.tasks.function_calling.check_tools`) before any model loads."""
    from pask.structure.schema_check import check_response_format
    from pask.tasks.function_calling import check_tools

    try:
        req = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PaskError(f"{path} is not valid JSON: {e}") from None
    except UnicodeDecodeError:
        raise PaskError(f"{path} is not UTF-8 text") from None
    if not isinstance(req, dict) or not isinstance(req.get("messages"), list) or not req["messages"]:
        raise PaskError(f"{path}: expected an object with a non-empty 'messages' list")
    for i, m in enumerate(req["messages"]):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise PaskError(f"{path}: messages[{i}] must be an object with a 'role' and a 'content'")
    tools, fmt = req.get("tools"), req.get("response_format")
    if fmt is not None:
        if tools is not None:
            raise PaskError(f"{path}: give 'tools' or 'response_format', not both")
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        spec = fmt.get("json_schema") if kind == "json_schema" else None
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not (kind == "json_object" or isinstance(schema, dict)):
            raise PaskError(
                f"{path}: response_format must be {{'type': 'json_schema', 'json_schema': {{'schema': {{...}}}}}} "
                "or {'type': 'json_object'}"
            )
        if schema is not None:
            check_response_format(schema)
        return req
    if not isinstance(tools, list) or not tools:
        raise PaskError(f"{path}: expected a non-empty 'tools' list (or a 'response_format')")
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise PaskError(f"{path}: every tool needs {{'type': 'function', 'function': {{'name': ...}}}}")
        fn.setdefault("parameters", {"type": "object", "properties": {}})
    check_tools(tools)
    return req


@app.command("eval")
@user_errors
def eval_task(
    task: Annotated[
        str,
        typer.Argument(
            metavar="TASK", help="bfcl (function calling) | sql (text-to-SQL) | ruler (long context) | registered"
        ),
    ],
    model: ModelOpt = DEFAULT_MODEL,
    policy: Annotated[str, typer.Option(help="KV policy")] = "full",
    budget: BudgetOpt = None,
    split: Annotated[
        str, typer.Option(help="calibration | dev | test (sql: database-disjoint) | all (every case)")
    ] = "test",
    categories: Annotated[
        str | None, typer.Option(help="bfcl: comma-separated BFCL categories (default: the four non-live ones)")
    ] = None,
    data_dir: Annotated[
        Path | None, typer.Option(help="sql: dir with dev.json, tables.json, database/<db_id>/<db_id>.sqlite")
    ] = None,
    sql_scope: Annotated[
        str | None,
        typer.Option(
            help="sql: on = the grammar plus the scope check (no column the query's FROM clause lacks), "
            "off = the grammar alone (default: on)"
        ),
    ] = None,
    length: Annotated[
        int | None, typer.Option(help="ruler: the prompt's length in tokens (default 8192; 4096 / 8192 / 16384)")
    ] = None,
    tasks: Annotated[
        str | None, typer.Option(help="ruler: comma-separated sub-tasks, e.g. niah_single,copy (default: all)")
    ] = None,
    option: Annotated[
        list[str] | None, typer.Option("--option", "-o", help="another option of the task, KEY=VALUE (repeatable)")
    ] = None,
    limit: Annotated[
        int | None,
        typer.Option(help="bfcl: at most N cases per category; sql: the split's first N; ruler: N per sub-task"),
    ] = None,
    batch_size: BatchOpt = 8,
    batching: BatchingOpt = "static",
    max_new_tokens: Annotated[int | None, typer.Option(help="generation allowance (default: the task's)")] = None,
    out: OutDirOpt = None,
    dtype: str = "bf16",
    weights: WeightsOpt = None,
    threads: int | None = None,
    save_tags: SaveTagsOpt = False,
    policy_config: PolicyConfigOpt = None,
    table: TableOpt = None,
    allow_transfer: TransferOpt = False,
    prefill_store: PrefillStoreOpt = None,
    force: Annotated[
        bool, typer.Option(help="--out holds results made with other settings: discard them and start over")
    ] = False,
    meta: MetaOpt = None,
    max_latency_ms: MaxLatencyOpt = None,
    max_kv_mb: MaxKvOpt = None,
) -> None:
    """Evaluate a model + KV policy on TASK; writes cases.jsonl, summary.json and summary.md.

    --policy meta (MetaKV) chooses each case's configuration among the predictor file's candidates
    under --max-latency-ms / --max-kv-mb (docs/metakv.md); each row records the choice.

    bfcl: accuracy per category (paper Table 1); sql: execution accuracy per difficulty (Table 12);
    ruler: string-match recall per sub-task (RULER) at --length tokens.
    Rerun with the same --out to resume; a folder made with other settings (settings.json) is
    refused unless --force.
    """
    from pask.evaluation.runner import check_settings, run_task
    from pask.runtime.models import load_model
    from pask.tasks import get_task

    t = get_task(task)
    check_batching(batching, "--batching")
    for name, value in (("--limit", limit), ("--batch-size", batch_size), ("--max-new-tokens", max_new_tokens)):
        if value is not None and value < 1:
            raise PaskError(f"{name} must be >= 1, got {value}")
    flags = {"categories": categories, "data_dir": data_dir, "sql_scope": sql_scope, "length": length, "tasks": tasks}
    options = _task_options(t, flags, option)
    cases = t.cases(split, limit, **options)  # checks the split, the options and the data before the model loads
    if not cases:
        given = {k: v for k, v in options.items() if v is not None}
        raise PaskError(f"no {task} cases in split '{split}'" + "".join(f" for {k} {v}" for k, v in given.items()))
    if policy == "meta":
        build, policy_config = _meta_builder(task, meta, max_latency_ms, max_kv_mb, budget, table, policy_config)
        check_batching(batching, "--batching")
        if batching != "continuous":
            raise PaskError("--policy meta needs --batching continuous (each configuration decodes its own group)")
    elif meta is not None or max_latency_ms is not None or max_kv_mb is not None:
        raise PaskError("--meta, --max-latency-ms and --max-kv-mb are options of --policy meta")
    else:
        build = _policy_builder(task, policy, budget, policy_config, table, allow_transfer)
    out = out or Path("runs") / f"{task}-{model.replace('/', '_')}-{policy}-{split}"
    weights = _weights(weights)
    settings = _eval_settings(t, model, policy, budget, policy_config, table, split, max_new_tokens, dtype, options)
    if weights != "bf16":  # a run's rows depend on it (bf16 runs keep their settings as before)
        settings["weights"] = weights
    check_settings(out, settings, force)  # before the model loads; run_task checks again (a no-op)
    _threads(threads, prefill_store)
    lm = load_model(model, dtype=_dtype(dtype), weights=weights)
    selector = None
    if policy == "meta":
        selector, kv_policy = build(lm, batch_size), None
    else:
        kv_policy = build(lm)
    record = {"model": lm.name, "policy": policy, "budget": budget, "split": split, **t.run_record(limit, options)}
    record = _run_meta(record, table if policy == "pask" else None)
    if selector is not None:
        record["meta"] = {"predictor": str(meta), **selector.defaults.to_json(), "candidates": list(selector.allowed)}
    args = (batch_size, max_new_tokens, kv_policy)
    summary = _with_progress(
        f"{task} {policy}",
        len(cases),
        lambda advance: run_task(
            t, lm, cases, out, *args, advance, record, save_tags, batching, settings, force, selector, **options
        ),
    )
    print(t.markdown(summary, record))
    console.print(f"results: {out}/")


def _eval_settings(t, model, policy, budget, policy_config, table, split, max_new_tokens, dtype, options) -> dict:
    """What an eval's rows depend on (``out/settings.json``); not the limit, batching or threads,
    which only choose and schedule the cases."""
    try:
        config = json.loads(policy_config) if policy_config is not None else None
    except json.JSONDecodeError:
        config = policy_config
    local = Path(model)
    return {
        "task": t.name,
        "split": split,
        "model": str(local.resolve()) if local.is_dir() else model,
        "policy": policy,
        "budget": budget,
        "policy_config": config,
        "table_sha256": file_sha256(Path(table)) if policy == "pask" and table is not None else None,
        "max_new_tokens": max_new_tokens or t.default_max_new_tokens,
        "dtype": str(_dtype(dtype)).removeprefix("torch."),
        "options": {
            k: str(Path(v).resolve()) if k in t.path_options and v is not None else v for k, v in options.items()
        },
    }


# the task options with a flag of their own on `pask eval` (any other: --option KEY=VALUE)
TASK_FLAGS = {
    "categories": "--categories",
    "data_dir": "--data-dir",
    "sql_scope": "--sql-scope",
    "length": "--length",
    "tasks": "--tasks",
}


def _task_options(task, flags: dict, option: list[str] | None) -> dict:
    """The options of ``task`` from its flags (None: not given) and ``--option KEY=VALUE`` items,
    defaults filled in; PaskError for an option the task does not take."""
    takes = ", ".join(TASK_FLAGS.get(k, f"--option {k}=...") for k in task.options) or "no options"
    given: dict = {}
    for key, value in flags.items():
        if value is not None:
            if key not in task.options:
                raise PaskError(f"{TASK_FLAGS[key]} is not an option of task {task.name} (it takes: {takes})")
            given[key] = value
    for item in option or []:
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise PaskError(f"--option takes KEY=VALUE, got {item!r}")
        if key not in task.options:
            raise PaskError(f"task {task.name} has no option '{key}' (it takes: {takes})")
        if key in given:
            raise PaskError(f"task option '{key}' given twice")
        try:
            given[key] = json.loads(raw)
        except json.JSONDecodeError:
            given[key] = raw
    for key, value in given.items():  # a list option from the command line: comma-separated
        if isinstance(task.options[key], list) and isinstance(value, str):
            given[key] = [v.strip() for v in value.split(",") if v.strip()]
    return task.resolve_options(given)


@app.command()
@user_errors
def inspect(
    case: Annotated[str, typer.Option(help="BFCL case id, e.g. simple_python_0")],
    task: Annotated[str, typer.Option(help="task: bfcl or sql")] = "bfcl",
    model: ModelOpt = DEFAULT_MODEL,
    html: Annotated[Path | None, typer.Option(help="also write a self-contained HTML page")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="generation allowance (default: the task's)")] = None,
    threads: int | None = None,
) -> None:
    """Run one case; show prompt labels and generated tokens with their structural tags (coloured)."""
    from pask.evaluation.run_bfcl import prepare
    from pask.experiments.inspect_case import render, write_html
    from pask.runtime.engine import generate as run
    from pask.runtime.models import load_model
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
    model: ModelOpt = DEFAULT_MODEL,
    task: Annotated[str, typer.Option(help="task: bfcl or sql")] = "bfcl",
    split: Annotated[
        str, typer.Option(help="calibration split (never test or live); join splits with +, e.g. calibration+dev")
    ] = "calibration",
    budget: Annotated[float, typer.Option(help="target total KV budget B in (0, 1]")] = 0.33,
    out: Annotated[Path, typer.Option(help="table file to write (work dir beside it; resumable)")] = Path(
        "pask-table.json"
    ),
    limit: Annotated[int | None, typer.Option(help="bfcl: at most N cases per category; sql: the first N")] = None,
    categories: Annotated[
        str | None, typer.Option(help="bfcl: comma-separated non-live categories (default: all four)")
    ] = None,
    pool_groups: Annotated[
        bool, typer.Option(help="probe each item in all layer groups at once (G x fewer runs; see report)")
    ] = False,
    distortion_batches: Annotated[
        int | None, typer.Option(help="replay only N control batches (evenly spaced) for Runtime-D")
    ] = None,
    probe_cases: Annotated[
        int | None,
        typer.Option(help="screened sensitivity: probe only N control-correct cases (spread over categories)"),
    ] = None,
    distortion_scope: Annotated[
        str, typer.Option(help="Runtime-D for 'all' candidates or only those the floors 'allowed'")
    ] = "all",
    alpha_d: Annotated[float, typer.Option(help="tolerance of decode buckets (accuracy drop, 0.05 = 5 pp)")] = 0.05,
    alpha_p: Annotated[float, typer.Option(help="tolerance of prompt buckets (accuracy drop)")] = 0.02,
    actions: Annotated[
        str, typer.Option(help="lossy actions to probe: L,L2,R (four-action table) or L,R (BF16 / INT4 / release)")
    ] = "L,L2,R",
    fit: Annotated[
        str,
        typer.Option(
            help="a budget below the floors: 'floors' keeps them (the paper; the table misses its target) or "
            "'sensitivity' relaxes them, least accuracy per byte first, until it fits"
        ),
    ] = "floors",
    envelope: Annotated[
        str,
        typer.Option(
            help="harm order of the lossy actions: 'chain' (release >= INT2 >= INT4, the paper) or 'branch' "
            "(release and INT2 each >= INT4)"
        ),
    ] = "chain",
    b_offset: Annotated[
        float,
        typer.Option(
            help="dev check correction: B measured on dev minus the expected B; the solver aims at "
            "budget - offset (see docs/calibration.md)"
        ),
    ] = 0.0,
    l2_key_bits: Annotated[
        int,
        typer.Option(
            help="key width of the L2 action: 2 (INT2 keys and values) or 4 (K4V2: INT4 keys, INT2 values; "
            "the L2 tier then costs 0.25 of BF16 instead of 0.1875)"
        ),
    ] = 2,
    batch_size: int = 8,
    dtype: str = "bf16",
    threads: int | None = None,
    prefill_store: PrefillStoreOpt = None,
) -> None:
    """Offline calibration: sensitivity floors + distortion-ranked upgrades -> frozen PASK table."""
    from pask.calibration.calibrate import calibrate_command, check_b_offset, check_probe_actions, report_path_for
    from pask.calibration.solver import ENVELOPES, FITS

    check_budget(budget, "--budget")
    check_b_offset(budget, b_offset)
    if distortion_scope not in ("all", "allowed"):
        raise PaskError(f"--distortion-scope must be 'all' or 'allowed', got {distortion_scope!r}")
    for flag, value, choices in (("--fit", fit, FITS), ("--envelope", envelope, ENVELOPES)):
        if value not in choices:
            raise PaskError(f"{flag} must be {' or '.join(map(repr, choices))}, got {value!r}")
    for name, a in (("--alpha-d", alpha_d), ("--alpha-p", alpha_p)):
        if not 0 <= a < 1:
            raise PaskError(f"{name} must be in [0, 1), got {a}")
    probe_actions = check_probe_actions(a.strip() for a in actions.split(",") if a.strip())
    if l2_key_bits not in (2, 4):
        raise PaskError(f"--l2-key-bits must be 2 or 4, got {l2_key_bits}")
    _threads(threads, prefill_store)
    with progress_bar() as bar:
        tasks: dict[str, int] = {}

        def progress(phase: str, advance: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], advance=advance, total=total)

        cats = [c.strip() for c in categories.split(",") if c.strip()] if categories else None
        table = calibrate_command(
            model,
            task,
            split,
            budget,
            out,
            limit,
            batch_size,
            _dtype(dtype),
            progress,
            categories=cats,
            pool_groups=pool_groups,
            distortion_batches=distortion_batches,
            probe_cases=probe_cases,
            distortion_scope=distortion_scope,
            alpha_d=alpha_d,
            alpha_p=alpha_p,
            actions=probe_actions,
            fit=fit,
            envelope_kind=envelope,
            b_offset=b_offset,
            l2_key_bits=l2_key_bits,
        )
    console.print(f"table: {out} (expected B {table.expected_b:.3f}); report: {report_path_for(out)}")


@bench_app.command("kv")
@user_errors
def bench_kv_cmd(
    model: ModelOpt = DEFAULT_MODEL,
    contexts: Annotated[str, typer.Option(help="comma-separated context lengths")] = "2048,8192,32768",
    mix: Annotated[
        str, typer.Option(help="H:INT4:release[:INT2] fractions outside the recent window")
    ] = "0.34:0.33:0.33",
    repeats: int = 30,
    threads: int = 1,
    as_json: Annotated[bool, typer.Option("--json", help="print the raw JSON result")] = False,
    policy: Annotated[
        str | None, typer.Option(help="comma-separated policies: measure their overhead per decode step instead")
    ] = None,
    budget: Annotated[float, typer.Option(help="target budget of the --policy runs")] = 0.33,
    cases: Annotated[int, typer.Option(help="BFCL test cases per category for --policy")] = 2,
    batch_size: Annotated[int, typer.Option(help="batch size of the --policy runs")] = 8,
    table: Annotated[Path | None, typer.Option(help="PASK table when --policy includes pask")] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="write JSON + markdown with provenance into this dir (kv.*; --policy: policy_overhead.*)"),
    ] = None,
    allow_dirty: Annotated[
        bool, typer.Option(help="write --out into benchmarks/results/ even with uncommitted code changes")
    ] = False,
) -> None:
    """KV bytes held vs Full KV, cost-model discrepancy, mixed vs full decode-attention time, model step time.

    With ``--policy``: each policy's overhead per decode step on real BFCL cases (decisions, cache
    actions, the rest of the step), next to Full KV and the all-H tiered cache in the same run.
    """
    from pask.experiments.provenance import check_clean, write_result

    if out is not None:
        check_clean(out, allow_dirty)  # before the run, not after it
    if policy is not None:
        _bench_policy_overhead(model, policy, budget, cases, batch_size, threads, table, out, allow_dirty)
        return
    from pask.bench.kv import bench_kv

    try:
        ctx = [int(c) for c in contexts.split(",") if c.strip()]
        fractions = [float(x) for x in mix.split(":")]
    except ValueError:
        raise PaskError("--contexts takes integers like 2048,8192 and --mix fractions like 0.34:0.33:0.33") from None
    if len(fractions) not in (3, 4) or any(not f >= 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        raise PaskError(
            f"--mix must be three or four (H:INT4:release:INT2) non-negative fractions summing to 1, got {mix}"
        )
    if not ctx or min(ctx) < 16:
        raise PaskError("--contexts must be lengths >= 16")
    result = bench_kv(model, ctx, fractions, repeats=repeats, threads=threads)
    if as_json:
        print(json.dumps(result, indent=2))
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
    if out is not None:
        js, _ = write_result(out / "kv", result, "\n".join(table) + "\n", command=_command(), allow_dirty=allow_dirty)
        console.print(f"results: {js}")
    if not as_json:
        print("\n".join(table))


@app.command()
@user_errors
def tune(
    policy: Annotated[str, typer.Option(help="baseline to tune (h2o, snapkv, rocketkv, criticalkv, lazyeviction)")],
    budget: Annotated[float, typer.Option(help="target total KV budget B in (0, 1]")] = 0.33,
    task: Annotated[str, typer.Option(help="bfcl (function calling) or sql (text-to-SQL, by EX)")] = "bfcl",
    model: ModelOpt = DEFAULT_MODEL,
    split: Annotated[str, typer.Option(help="tuning split: dev (never test or live)")] = "dev",
    categories: Annotated[str, typer.Option(help="bfcl: comma-separated non-live categories")] = (
        "simple,multiple,parallel,parallel_multiple"
    ),
    limit: Annotated[int | None, typer.Option(help="bfcl: at most N cases per category; sql: the first N")] = None,
    search: Annotated[str, typer.Option(help="grid (Table 8 product) or coordinate (one knob at a time)")] = "grid",
    grid: Annotated[
        str | None, typer.Option(help='JSON {"param": [values], ...} searched instead of the Table 8 grid')
    ] = None,
    batch_size: int = 8,
    batching: BatchingOpt = "static",
    max_new_tokens: Annotated[int | None, typer.Option(help="generation allowance (default: the task's)")] = None,
    out: Annotated[Path | None, typer.Option(help="work dir: tuning log + one run dir per configuration")] = None,
    configs: Annotated[
        Path | None, typer.Option(help="file of chosen configurations (default: the task's, in pask/policies/)")
    ] = None,
    dtype: str = "bf16",
    threads: int | None = None,
    prefill_store: PrefillStoreOpt = None,
) -> None:
    """Search a baseline's Table 8 grid on a task's dev split (resumable); record the best configuration.

    The choice goes to the task's own file (``configs.json`` for BFCL, ``configs_sql.json`` for SQL),
    which evaluations and sweeps of that task read at that budget.
    """
    from pask.experiments.sweep import TASKS
    from pask.policies import get_policy
    from pask.policies.tuning import TABLE8_GRIDS, configs_path_for, parse_grid
    from pask.policies.tuning import tune as run_tune
    from pask.runtime.models import load_model

    if task not in ("bfcl", "sql"):
        raise PaskError(f"unknown task '{task}': choose bfcl or sql")
    check_budget(budget, "--budget")
    if split == "test":
        raise PaskError("tuning on the test split would leak it: use --split dev")
    if search not in ("grid", "coordinate"):
        raise PaskError(f"unknown search '{search}': choose grid or coordinate")
    check_batching(batching, "--batching")
    get_policy(policy, budget=budget)  # unknown policy: clear error before the model loads
    if policy not in TABLE8_GRIDS:
        raise PaskError(f"no Table 8 grid for policy '{policy}'; tunable: {', '.join(sorted(TABLE8_GRIDS))}")
    search_grid = parse_grid(policy, budget, grid) if grid is not None else None
    if task == "bfcl":
        from pask.evaluation.run_bfcl import run_bfcl as run_task
        from pask.tasks.function_calling import LIVE, load_cases

        cats = [c.strip() for c in categories.split(",") if c.strip()]
        if live := [c for c in cats if c in LIVE]:
            raise PaskError(f"live categories {live} are evaluation-only: never tune on them")
        cases = load_cases(cats, split=split, limit=limit)
        if not cases:
            raise PaskError(f"no cases for categories {cats} in split '{split}'")
        score_key = "accuracy"
    else:
        from pask.evaluation.run_sql import run_sql as run_task
        from pask.evaluation.run_sql import select_cases

        if split != "dev":
            raise PaskError("SQL tuning runs on the dev split (calibration is PASK's, test is the evaluation's)")
        cases = select_cases(split, limit)
        score_key = "ex"
    max_new_tokens = max_new_tokens or TASKS[task].defaults["max_new_tokens"]  # the evaluations' allowance
    configs = configs or configs_path_for(task)
    prefix = "tune" if task == "bfcl" else "tune-sql"
    out = out or Path("runs") / f"{prefix}-{model.replace('/', '_')}-{policy}-b{budget:g}"
    _threads(threads, prefill_store)
    lm = load_model(model, dtype=_dtype(dtype))

    def evaluate(name: str, b: float, params: dict) -> dict:
        tag = "-".join(f"{k}={v}" for k, v in sorted(params.items())) or "default"
        run_dir = out / tag
        meta = {"model": lm.name, "policy": name, "budget": b, "split": split, "params": params}
        with progress_bar() as bar:
            progress = bar.add_task(f"{name} {tag}", total=len(cases))
            s = run_task(
                lm,
                cases,
                run_dir,
                batch_size,
                max_new_tokens,
                get_policy(name, budget=b, **params),
                lambda n: bar.advance(progress, n),
                meta,
                batching=batching,
            )
        return {"score": s["overall"][score_key], "measured_b": s["measured_b"], "n": s["overall"]["n"]}

    best = run_tune(policy, budget, search_grid, evaluate, out / "tuning.jsonl", configs, search)
    console.print(f"{policy} at B={budget:g} ({task}): chosen {best} -> {configs}")


@app.command()
@user_errors
def sweep(
    config: Annotated[Path, typer.Option(help="sweep config (TOML): models x tasks x policies x budgets x splits")],
    ray: Annotated[
        str | None, typer.Option(help="run cells as Ray tasks: local (start Ray here), auto or a cluster ADDRESS")
    ] = None,
    force: Annotated[bool, typer.Option(help="delete and rerun cells made by another code version or config")] = False,
    results: Annotated[Path | None, typer.Option(help="results directory (overrides the config's results_dir)")] = None,
    threads: Annotated[int | None, typer.Option(help="torch threads per process (overrides the config)")] = None,
    shard_size: Annotated[int | None, typer.Option(help="cases per Ray task (default: spread over the CPUs)")] = None,
    dry_run: Annotated[bool, typer.Option(help="list the cells and what a run would do; run nothing")] = False,
    adopt: Annotated[
        bool, typer.Option(help="take finished `pask eval` results of the same cell (model, policy, budget, cases)")
    ] = False,
    only: Annotated[
        list[str] | None,
        typer.Option(help="run only the cells matching KEY=V1,V2 (model, task, split, policy, budget; repeatable)"),
    ] = None,
    prefill_store: PrefillStoreOpt = None,
) -> None:
    """Run an evaluation sweep: resumable cells, one progress bar, per-cell timing in a record file."""
    from pask.experiments.ray_shards import run_cells_ray
    from pask.experiments.sweep import load_config, plan, record_path, run_sweep, select_cells

    cfg = load_config(config, results_dir=results, threads=threads)
    _threads(None, prefill_store)
    if only:
        cfg = select_cells(cfg, only)
    if dry_run:
        for p in plan(cfg, code_version(), overwrite=force, dry_run=True, adopt=adopt):
            print(f"{p.state:7s} {p.n_done:5d}/{len(p.cases):<5d} {p.dir}")
        return
    with progress_bar() as bar:
        task = bar.add_task("sweep", total=None)

        def progress(done: int, total: int, cell: str) -> None:
            bar.update(task, completed=done, total=total, description=f"sweep {cell}".rstrip())

        record = run_sweep(
            cfg, overwrite=force, progress=progress, ray_address=ray, shard_size=shard_size, adopt=adopt,
            ray_runner=run_cells_ray if ray else None,
        )  # fmt: skip
    lines = ["| cell | state | n | run now | wall s | accuracy | B |", "|---|---|---:|---:|---:|---:|---:|"]
    for name, c in record["cells"].items():
        acc = "–" if c.get("accuracy") is None else f"{c['accuracy']:.2f}"
        b = "–" if c.get("measured_b") is None else f"{c['measured_b']:.3f}"
        run_now, wall = c.get("cases_run", 0), c.get("wall_s", 0.0)
        lines.append(f"| {name} | {c['state']} | {c['n']} | {run_now} | {wall:.1f} | {acc} | {b} |")
    print("\n".join(lines))
    rec = record_path(cfg).name
    console.print(f"results: {cfg.results_dir}/ (record: {rec}); tables, plots: `pask report {cfg.results_dir}`")


@app.command()
@user_errors
def report(
    results_dir: Annotated[Path, typer.Argument(help="results directory (as written by `pask sweep`)")],
    out: Annotated[Path | None, typer.Option(help="output directory (default RESULTS_DIR/report)")] = None,
    table: Annotated[
        list[Path] | None, typer.Option(help="calibration table file for the Figure 9 scatter (repeatable)")
    ] = None,
    bars_budget: Annotated[float, typer.Option(help="target budget of the per-category bar plot")] = 0.33,
) -> None:
    """Paper-style tables (markdown), a CSV of every cell and PNG plots of a results directory."""
    from pask.experiments.report import write_report

    rep = write_report(results_dir, out, table or [], bars_budget)
    print(rep.markdown.read_text(), end="")
    console.print(f"report: {rep.markdown}; csv: {rep.csv}; plots: {', '.join(p.path.name for p in rep.plots)}")


@app.command()
@user_errors
def serve(
    model: ModelOpt = DEFAULT_MODEL,
    policy: Annotated[str, typer.Option(help="KV policy (full, pask, snapkv, h2o, ...)")] = "full",
    budget: BudgetOpt = None,
    port: int = 8000,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    table: TableOpt = None,
    capacity_tokens: Annotated[int | None, typer.Option(help="logical KV capacity in Full-KV tokens")] = None,
    max_batch: Annotated[int | None, typer.Option(help="at most N requests decoding together")] = None,
    max_tokens: Annotated[int, typer.Option(help="default max_tokens of a request")] = 256,
    policy_config: PolicyConfigOpt = None,
    allow_transfer: TransferOpt = False,
    prefill_store: PrefillStoreOpt = None,
    dtype: str = "bf16",
    weights: WeightsOpt = None,
    threads: Annotated[
        int | None,
        typer.Option(
            help="torch threads; with --ray: per replica, also its Ray CPUs (default there: the cores / N "
            "with --ray local, else 1)"
        ),
    ] = None,
    replicas: Annotated[
        int, typer.Option(help="serving replicas, each with its own model and KV pool; more than 1 needs --ray")
    ] = 1,
    ray: Annotated[
        str | None,
        typer.Option(
            help="run the replicas as a Ray Serve application behind one address: local (start Ray here), "
            "auto or a cluster ADDRESS"
        ),
    ] = None,
    max_body_bytes: Annotated[int, typer.Option(help="larger request bodies get 413")] = 1 << 20,
    max_queue: Annotated[int, typer.Option(help="requests waiting to decode; one more gets 429")] = 64,
    request_timeout: Annotated[
        float, typer.Option(help="seconds from arrival; later requests are cancelled (504); 0: none")
    ] = 300.0,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="PASK_API_KEY", show_default=False, help="require 'Authorization: Bearer KEY' on /v1/* (401)"
        ),
    ] = None,
    docs: Annotated[bool, typer.Option(help="serve /docs, /redoc and /openapi.json")] = False,
    meta: MetaOpt = None,
    max_latency_ms: MaxLatencyOpt = None,
    max_kv_mb: MaxKvOpt = None,
    meta_candidates: Annotated[
        str | None,
        typer.Option(help="--policy meta: comma-separated candidates to offer (default: all; one cache must fit them)"),
    ] = None,
) -> None:
    """OpenAI-compatible server (/v1/chat/completions, /v1/models, /health, /metrics) with continuous batching.

    With ``--replicas N --ray local|auto|ADDRESS``: N replicas on Ray Serve behind one address
    (docs/serving.md, "Replicas on Ray Serve"). With ``--policy meta --meta FILE``: MetaKV chooses each
    request's configuration under the limits, per request in the body's ``pask`` field
    (docs/metakv.md); the response's ``pask.meta`` says which, and /metrics counts them.
    """
    from pask.serving.server import Limits, Service
    from pask.serving.server import serve as run_server

    if replicas < 1:
        raise PaskError(f"--replicas must be >= 1, got {replicas}")
    if replicas > 1 and ray is None:
        raise PaskError(
            f"--replicas {replicas} runs on Ray Serve: add --ray local (start Ray here), --ray auto or --ray ADDRESS"
        )
    limits = Limits(  # checks the values before the model loads
        max_body_bytes=max_body_bytes,
        max_queue=max_queue,
        request_timeout=request_timeout or None,
        api_key=api_key or None,
        docs=docs,
    )
    if budget is not None:
        check_budget(budget, "--budget")
    if capacity_tokens is not None and capacity_tokens < 1:
        raise PaskError(f"--capacity-tokens must be >= 1, got {capacity_tokens}")
    meta_args = _serve_meta_args(
        policy, meta, max_latency_ms, max_kv_mb, meta_candidates, budget, table, policy_config, ray
    )
    if policy not in ("pask", "meta"):
        serving_policy_factory(policy, budget, policy_config)  # fail before the model loads
    elif policy == "pask" and table is None:
        raise PaskError("--policy pask needs --table FILE (made by `pask calibrate --task bfcl`)")
    if ray is not None:  # the replicas on Ray Serve: everything is checked here, before Ray starts
        from pask.serving.replicas import ReplicaSpec, deploy

        per = threads if threads is not None else max(1, (os.cpu_count() or 1) // replicas) if ray == "local" else 1
        spec = ReplicaSpec(
            model=model, dtype=dtype, weights=weights, policy=policy, budget=budget, policy_config=policy_config,
            table=str(table) if table else None, allow_transfer=allow_transfer, capacity_tokens=capacity_tokens,
            max_batch=max_batch, max_tokens=max_tokens, limits=limits, threads=per,
            prefill_store=str(prefill_store) if prefill_store else None,
        )  # fmt: skip
        if limits.api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
            console.print(f"[yellow]warning:[/] listening on {host} without an API key (--api-key or $PASK_API_KEY)")
        console.print(f"starting {replicas} replicas of {model} ({per} threads each) on Ray ({ray})...")

        def ready(url: str) -> None:
            console.print(f"serving {model} with policy {policy}: {replicas} replicas on {url}/v1 (Ctrl-C stops)")

        deploy(spec, replicas, ray, host, port, on_ready=ready)
        return
    _threads(threads, prefill_store)
    lm = _serving_model(model, dtype, weights)
    selector = factory = None
    if meta_args is not None:  # the scheduler is built from the selector's probe: one cache for all, checked
        from pask.meta.selector import MetaSelector

        pred, defaults, allowed = meta_args
        pred.check_model(lm.fingerprint)
        selector = MetaSelector(pred, defaults, allowed, lm.fingerprint, max_batch)
    else:
        factory = serving_policy_factory(policy, budget, policy_config, table, lm.fingerprint, allow_transfer)
    service = Service.build(
        lm, factory, capacity_tokens, max_batch=max_batch, default_max_tokens=max_tokens, limits=limits,
        selector=selector,
    )  # fmt: skip
    if limits.api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        console.print(f"[yellow]warning:[/] listening on {host} without an API key (--api-key or $PASK_API_KEY)")
    console.print(f"serving {lm.name} with policy {policy} on http://{host}:{port}/v1")
    run_server(service, host, port)


@app.command("calibrate-bellows")
@user_errors
def calibrate_bellows(
    out: Annotated[Path, typer.Option(help="the projections file to write (safetensors)")],
    n: Annotated[int, typer.Option(help="adjacent layers sharing one latent")] = 4,
    model: ModelOpt = DEFAULT_MODEL,
    task: Annotated[str, typer.Option(help="whose prompts: calibration split to fit, dev split held out")] = "bfcl",
    cases: Annotated[int, typer.Option(help="calibration prompts to fit on")] = 64,
    held_cases: Annotated[int, typer.Option(help="dev prompts for the held-out error (0: none)")] = 32,
    ridge: Annotated[
        list[float] | None,
        typer.Option(
            help="ridge term, relative to the mean diagonal of X^T X; repeat it to keep the value with "
            "the lowest mean held-out (dev) error [default: 1e-4]"
        ),
    ] = None,
    latent: Annotated[
        str,
        typer.Option(
            help="first: the group's first-layer normed input; middle: its lower-middle layer's; "
            "pca: the group's K/V on their leading principal directions"
        ),
    ] = "first",
    dim: Annotated[int | None, typer.Option(help="pca: the latent's size (default: the model's hidden size)")] = None,
    key_dim: Annotated[
        int | None,
        typer.Option(
            help="pca: split the latent, its first KEY_DIM values the keys' own principal directions and the "
            "rest the values' (keys are rebuilt from KEY_DIM values only: less decode compute)"
        ),
    ] = None,
    dtype: DtypeOpt = "bf16",
    threads: ThreadsOpt = None,
    report: Annotated[
        Path | None, typer.Option(help="also write the per-layer error table here (STEM.md / .json, with provenance)")
    ] = None,
    allow_dirty: Annotated[
        bool, typer.Option(help="write --report into benchmarks/results/ even with uncommitted code changes")
    ] = False,
) -> None:
    """BellowsKV (issue 32): fit each layer's projection from its group's shared latent (the group's
    first-layer normed input) to its pre-RoPE keys and values; print the per-layer error table."""
    from pask.calibration.bellows import fit, fit_pca, markdown, source
    from pask.experiments.provenance import check_clean, write_result
    from pask.runtime.models import load_model
    from pask.tasks import get_task

    if cases < 1 or held_cases < 0:
        raise PaskError("--cases must be >= 1 and --held-cases >= 0")
    ridge = ridge or [1e-4]
    if any(not math.isfinite(r) or r < 0 for r in ridge):
        raise PaskError(f"--ridge must be finite numbers >= 0, got {', '.join(map(str, ridge))}")
    if len(ridge) > 1 and not held_cases:
        raise PaskError("choosing among several --ridge values needs held-out prompts (--held-cases > 0)")
    source(range(1), latent)  # --latent checked before the model loads
    if dim is not None and (latent != "pca" or dim < 1):
        raise PaskError("--dim is the size of a pca latent (--latent pca): a positive integer")
    if key_dim is not None and (latent != "pca" or dim is None or key_dim < 1):
        raise PaskError("--key-dim splits a pca latent of a given size: --latent pca --dim D --key-dim K, 0 < K < D")
    if latent == "pca" and len(ridge) > 1:
        raise PaskError("a pca latent has no ridge: give --ridge only with --latent first|middle")
    if report is not None:
        check_clean(report, allow_dirty)
    t = get_task(task)
    opts = t.resolve_options({})
    fit_cases = t.cases("calibration", None, **opts)
    held = t.cases("dev", None, **opts) if held_cases else []
    _threads(threads)
    lm = load_model(model, dtype=_dtype(dtype))

    def prompts(cs: list, k: int) -> list[list[int]]:
        step = max(len(cs) // k, 1)  # spread over the split (its categories come in blocks)
        return [t.request(c, lm.tokenizer, **opts).prompt_ids for c in cs[::step][:k]]

    fit_p, held_p = prompts(fit_cases, cases), prompts(held, held_cases) if held_cases else []
    t0 = time.perf_counter()
    total = len(fit_p) + len(held_p)
    if latent == "pca":
        proj = _with_progress(f"bellows n={n}", total, lambda adv: fit_pca(lm, fit_p, held_p, n, dim, adv, key_dim))
    else:
        proj = _with_progress(f"bellows n={n}", total, lambda adv: fit(lm, fit_p, held_p, n, ridge, adv, latent))
    proj.meta |= {"task": task, "wall_s": round(time.perf_counter() - t0, 1), "command": _command()}
    proj.save(out)
    md = markdown(proj, lm.model.config)
    if report is not None:
        data = {"model": lm.name, "n": n, "latent": latent, "ridge": proj.ridge, "errors": proj.errors,
                "meta": proj.meta}  # fmt: skip
        write_result(report, data, md, command=_command(), allow_dirty=allow_dirty)
    print(md, end="")
    console.print(f"projections: {out}")


@meta_app.command("fit")
@user_errors
def meta_fit(
    config: Annotated[
        list[Path], typer.Option("--config", help="sweep config of dev / calibration cells (repeatable)")
    ],
    out: Annotated[Path, typer.Option(help="the predictor file to write (JSON)")],
    model: ModelOpt = DEFAULT_MODEL,
    dtype: DtypeOpt = "bf16",
    folds: Annotated[int, typer.Option(help="cross-validation folds for the held-out errors (1: none)")] = 5,
    timing: Annotated[
        Path | None,
        typer.Option(help="timing profile (`pask meta time`) for the latency lines (default: the cells' timings)"),
    ] = None,
    threads: ThreadsOpt = None,
) -> None:
    """Fit MetaKV's predictors (output length, latency, KV bytes, P(correct)) on dev cells; write FILE.

    One cell per candidate configuration, every cell on the calibration or dev split (never test
    or live), one task. The file is tied to the model's fingerprint, like a PASK table.
    """
    from pask.experiments.metakv import fit_from_configs
    from pask.runtime.models import load_model

    if folds < 1:
        raise PaskError(f"--folds must be >= 1, got {folds}")
    for c in config:
        if not c.is_file():
            raise PaskError(f"sweep config {c} does not exist")
    profile = None
    if timing is not None:
        try:
            profile = json.loads(timing.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            profile = None
        if not isinstance(profile, dict) or not isinstance(profile.get("samples"), list):
            raise PaskError(f"{timing} is not a timing profile (made by `pask meta time`)")
    _threads(threads)
    lm = load_model(model, dtype=_dtype(dtype))
    t0 = time.perf_counter()
    record = {"command": _command(), "code_version": code_version(), "machine": machine()}
    pred = fit_from_configs(config, lm, folds, record, profile)
    pred.fit["wall_s"] = round(time.perf_counter() - t0, 1)
    pred.save(out)
    cv = pred.fit.get("cv") or {}
    console.print(
        f"fitted {len(pred.names)} candidates on {pred.fit['n_cases']} cases ({pred.fit['n_rows']} rows); "
        f"held out: AUC {cv.get('auc_mean', '-')}, MAE output {cv.get('mae_n_out', '-')} tokens, "
        f"KV {cv.get('mae_kv_mb', '-')} MB, latency {cv.get('mae_latency_ms', '-')} ms"
    )
    console.print(f"predictor: {out}")


@meta_app.command("time")
@user_errors
def meta_time(
    config: Annotated[Path, typer.Option(help="sweep config of the candidates (its dev cases give the prompts)")],
    out: Annotated[Path, typer.Option(help="result stem: writes .json and .md")],
    model: ModelOpt = DEFAULT_MODEL,
    dtype: DtypeOpt = "bf16",
    batch_sizes: Annotated[str, typer.Option(help="comma-separated batch sizes to time")] = "1,16",
    steps: Annotated[int, typer.Option(help="decode steps per run")] = 12,
    group: Annotated[int, typer.Option(help="distinct prompts per length class (short / long)")] = 4,
    threads: ThreadsOpt = None,
    allow_dirty: Annotated[
        bool, typer.Option(help="write into benchmarks/results/ even with uncommitted code changes")
    ] = False,
) -> None:
    """Time every candidate in turn on the same dev prompts (prefill alone; decode steps at each batch
    size): the latency profile `pask meta fit --timing` fits MetaKV's latency lines on."""
    from pask.experiments.metakv import measure_timing, timing_markdown
    from pask.experiments.provenance import check_clean, write_result
    from pask.runtime.models import load_model

    check_clean(out, allow_dirty)
    if not config.is_file():
        raise PaskError(f"sweep config {config} does not exist")
    try:
        sizes = [int(x) for x in batch_sizes.split(",") if x.strip()]
    except ValueError:
        raise PaskError(f"--batch-sizes takes comma-separated integers, got {batch_sizes!r}") from None
    _threads(threads)
    lm = load_model(model, dtype=_dtype(dtype))
    t0 = time.perf_counter()
    samples = measure_timing(lm, config, sizes, steps, group, progress=lambda s: console.print(f"  {s}"))
    data = {"config": str(config), "batch_sizes": sizes, "steps": steps, "group": group,
            "threads": threads, "wall_s": round(time.perf_counter() - t0, 1), "samples": samples}  # fmt: skip
    json_path, _ = write_result(out, data, timing_markdown(data), command=_command(), allow_dirty=allow_dirty)
    console.print(f"results: {json_path}")


@meta_app.command("csr")
@user_errors
def meta_csr(
    predictor: Annotated[Path, typer.Option(help="the predictor file (`pask meta fit`)")],
    dev_config: Annotated[list[Path], typer.Option("--dev-config", help="sweep config of the dev cells")],
    test_config: Annotated[list[Path], typer.Option("--test-config", help="sweep config of the test cells")],
    out: Annotated[Path, typer.Option(help="result stem: writes .json, .md and .png")],
    model: ModelOpt = DEFAULT_MODEL,
    dtype: DtypeOpt = "bf16",
    threads: ThreadsOpt = None,
    allow_dirty: Annotated[
        bool, typer.Option(help="write into benchmarks/results/ even with uncommitted code changes")
    ] = False,
) -> None:
    """Constrained success rate over a grid of (latency, KV) limits: MetaKV, every static candidate,
    the best static one per limit (chosen on dev) and the oracle, on the candidates' test cells."""
    from pask.experiments.metakv import cell_observations, evaluate, grid_limits, heatmap, markdown
    from pask.experiments.provenance import check_clean, write_result
    from pask.meta.predictor import load as load_predictor
    from pask.runtime.models import load_model

    check_clean(out, allow_dirty)
    for c in (*dev_config, *test_config):
        if not c.is_file():
            raise PaskError(f"sweep config {c} does not exist")
    pred = load_predictor(predictor)
    _threads(threads)
    lm = load_model(model, dtype=_dtype(dtype))
    pred.check_model(lm.fingerprint)
    feats: dict = {}
    dev, test = [], []
    for c in dev_config:
        dev += cell_observations(c, lm.tokenizer, feats, only=pred.candidates)[1]
    for c in test_config:
        test += cell_observations(c, lm.tokenizer, feats, only=pred.candidates)[1]
    result = evaluate(pred, dev, test, grid_limits(pred, dev))
    md = markdown(pred.task, pred, result)
    data = {"task": pred.task, "predictor": str(predictor), "candidates": pred.names, "fit": pred.fit, **result}
    json_path, _ = write_result(out, data, md, command=_command(), allow_dirty=allow_dirty)
    heatmap(pred.task, result, Path(str(json_path)[: -len(".json")] + ".png"))
    print(md, end="")
    console.print(f"results: {json_path}")


def _serve_meta_args(policy, meta, max_latency_ms, max_kv_mb, candidates, budget, table, policy_config, ray):
    """`pask serve --policy meta`'s options, checked before the model loads: (predictor, default
    limits, offered candidates or None), or None for another policy."""
    if policy != "meta":
        if meta is not None or max_latency_ms is not None or max_kv_mb is not None or candidates is not None:
            raise PaskError("--meta, --max-latency-ms, --max-kv-mb and --meta-candidates are options of --policy meta")
        return None
    if ray is not None:
        raise PaskError("--policy meta runs in one process for now: drop --ray / --replicas")
    # served requests are tool calls / JSON: a bfcl predictor
    pred, defaults = _meta_options("bfcl", meta, max_latency_ms, max_kv_mb, budget, table, policy_config)
    allowed = None
    if candidates is not None:
        allowed = [c.strip() for c in candidates.split(",") if c.strip()]
        unknown = [c for c in allowed if c not in pred.names]
        if unknown or not allowed:
            raise PaskError(f"--meta-candidates: unknown {unknown or '(none given)'}; {meta} has {pred.names}")
    return pred, defaults, allowed


def _serving_model(model: str, dtype: str, weights: str | None = None):
    """The model as the server runs it (:func:`pask.serving.replicas.serving_model`)."""
    return serving_model(model, _dtype(dtype), _weights(weights))


def _weights(weights: str | None) -> str:
    """The weight format of ``--weights`` (None: ``$PASK_WEIGHTS`` or bf16), checked."""
    from pask.cpu.weights import configured

    return configured(weights)


@bench_app.command("serve")
@user_errors
def bench_serve_cmd(
    model: ModelOpt = DEFAULT_MODEL,
    policies: Annotated[str, typer.Option(help="comma-separated policies; full is the reference")] = "full,pask,snapkv",
    budget: Annotated[float, typer.Option(help="target KV budget B of the compressing policies")] = 0.33,
    concurrency: int = 8,
    input_len: int = 8192,
    output_len: int = 256,
    requests_per_client: Annotated[int, typer.Option(help="requests each client sends")] = 2,
    capacity_tokens: Annotated[int | None, typer.Option(help="logical KV capacity in Full-KV tokens")] = None,
    max_seconds: Annotated[float, typer.Option(help="per policy: no new request after this")] = 3600.0,
    sample_every: Annotated[
        float, typer.Option(help="seconds between RSS / KV-bytes samples (soak test: memory flat after warm-up)")
    ] = 0.0,
    reference: Annotated[bool, typer.Option(help="add Full KV as the reference run (off: a soak test)")] = True,
    table: Annotated[Path | None, typer.Option(help="frozen PASK table (for pask)")] = None,
    allow_transfer: TransferOpt = False,
    out: Annotated[Path, typer.Option(help="result stem: writes .json and .md")] = Path("benchmarks/results/serving"),
    prefill_store: Annotated[
        Path | None,
        typer.Option(
            help="prefill every input once into this store before the timed runs; every policy then loads "
            "its prompts from it (decode-bound TPOT; sets $PASK_PREFILL_STORE)"
        ),
    ] = None,
    dtype: str = "bf16",
    weights: WeightsOpt = None,
    threads: int | None = None,
    allow_dirty: Annotated[
        bool, typer.Option(help="write --out into benchmarks/results/ even with uncommitted code changes")
    ] = False,
    mix: Annotated[
        str,
        typer.Option(
            help="request mix KIND=FRACTION,... of valid, malformed (bad bodies: each must get a 4xx), cancel "
            "(streamed, closed after a few chunks or a short delay), disconnect (not streamed, closed before the "
            "answer); fractions >= 0 summing to 1, kinds left out get 0; e.g. "
            "valid=0.7,malformed=0.1,cancel=0.1,disconnect=0.1 (a hostile soak: each cancelled or disconnected "
            "request's KV must be freed, pass/fail per criterion; exit 1 if one fails)"
        ),
    ] = "valid=1",
    abort_within: Annotated[
        float, typer.Option(help="cancels and disconnects close their connection within this many seconds")
    ] = 2.0,
    rounds: Annotated[
        int,
        typer.Option(
            min=1,
            help="run the policy list this many times in turn (full, others, full, ...); rows give medians, "
            "speed-ups the medians of per-round ratios against the same round's Full KV (a noisy host)",
        ),
    ] = 1,
) -> None:
    """Loopback load test: TPOT, throughput, peak KV bytes per policy vs Full KV, with the bandwidth-model limit.

    A soak test: ``--no-reference --policies pask --concurrency 16 --requests-per-client 100000
    --max-seconds 600 --sample-every 5`` (memory flat after warm-up, zero 5xx, zero malformed);
    with ``--mix valid=0.7,malformed=0.1,cancel=0.1,disconnect=0.1`` a hostile one (docs/serving.md).
    """
    from pask.bench.serving import BenchConfig, bench_serve, markdown, parse_mix, write
    from pask.experiments.provenance import check_clean

    shares = parse_mix(mix)
    check_clean(out, allow_dirty)  # before the run, not after it
    names = [p.strip() for p in policies.split(",") if p.strip()]
    if reference and "full" not in names:
        names.insert(0, "full")
    if not names:
        raise PaskError("--policies needs at least one policy name")
    cfg = BenchConfig(
        concurrency,
        input_len,
        output_len,
        requests_per_client,
        capacity_tokens,
        max_seconds,
        sample_every=sample_every,
        mix=shares,
        abort_within=abort_within,
    )
    _threads(threads, prefill_store)
    lm = _serving_model(model, dtype, weights)
    factories = {
        n: serving_policy_factory(n, None if n == "full" else budget, None, table, lm.fingerprint, allow_transfer)
        for n in names
    }
    sent = [0]
    t0 = time.perf_counter()

    def on_request() -> None:
        sent[0] += 1
        if sent[0] % 10 == 0:
            console.print(f"  {sent[0]} requests sent, {time.perf_counter() - t0:.0f} s")

    command = _command()
    result = bench_serve(
        lm,
        factories,
        cfg,
        progress=lambda n: console.print(f"policy {n}..."),
        on_request=on_request,
        command=command,
        warm_prefills=prefill_store is not None,
        rounds=rounds,
    )
    json_path, _ = write(result, out, allow_dirty=allow_dirty)
    print(markdown(result), end="")
    console.print(f"results: {json_path}")
    failed = [r["policy"] for r in result["policies"] if r.get("mix") and not r["mix"]["passed"]]
    if failed:
        console.print(f"[bold red]hostile mix: a criterion failed for {', '.join(failed)}[/]")
        raise typer.Exit(1)


def _bench_policy_overhead(
    model: str, policy: str, budget: float, cases: int, batch_size: int, threads: int, table, out, allow_dirty=False
) -> None:
    from pask.bench.policy_overhead import bench_policy_overhead, overhead_markdown, write
    from pask.runtime.models import load_model
    from pask.tasks.function_calling import NON_LIVE, load_cases

    check_budget(budget, "--budget")
    if cases < 1 or batch_size < 1:
        raise PaskError("--cases and --batch-size must be >= 1")
    names = [p.strip() for p in policy.split(",") if p.strip()]
    if not names:
        raise PaskError("--policy needs at least one policy name")
    for n in names:  # validate every name before the model loads
        if n == "pask":
            if table is None:
                raise PaskError("--policy pask needs --table FILE (made by `pask calibrate`)")
        elif n != "full":
            make_policy(n, budget)
    _threads(threads)
    lm = load_model(model)
    test_cases = load_cases(list(NON_LIVE), split="test", limit=cases)
    result = bench_policy_overhead(lm, names, budget, test_cases, batch_size, table=table)
    command = _command()
    md = overhead_markdown(result, command)
    if out is not None:
        write(result, out, command, allow_dirty=allow_dirty)
    print(md)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
