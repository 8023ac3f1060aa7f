"""Provenance of every result pask writes: command, code version, machine, ``PASK_*`` environment.

:func:`provenance` is the record: the command line, the code version (:func:`code_version`: git
commit and whether the code had uncommitted changes), the machine (:func:`machine`: CPU model and
the flags that matter, cores, torch threads, BF16 arithmetic, AMX, the bf16 matmul mode, the native
kernels and their instruction set), every ``PASK_*`` environment variable, the Python / torch /
transformers versions and a UTC timestamp. :func:`write_result` is the one writer of benchmark
results: ``STEM.json`` (the data plus a ``"provenance"`` key) and ``STEM.md`` (the markdown plus a
short provenance footer). It refuses (:class:`PaskError`) to write into the repository's committed
results (``benchmarks/results/``) from a code tree with uncommitted code changes unless
``allow_dirty`` (``--allow-dirty``), so that a committed number names the commit that made it. The
sweep (:mod:`pask.experiments.sweep`) records the same fields for every run of a cell in its
``cell.json``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from pask.errors import PaskError

CODE_PATHS = ("pask", "data")  # the sweep's key: the package (incl. tuned configs) and bundled data
# what "dirty" means: uncommitted changes (or new files) here; results, docs and configs do not count
DIRTY_PATHS = ("pask", "data", ":(glob)benchmarks/*.py", "pyproject.toml")
RESULTS_DIR = Path("benchmarks", "results")  # the committed results, under the source root
CPU_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)  # the ones pask's kernels, torch's CPU capability or the bf16 matmul mode depend on
MAX_DIRTY_FILES = 20  # listed in a record (the count is always there)


def source_root() -> Path:
    """The source tree pask runs from (the directory holding ``pask/``)."""
    return Path(__file__).resolve().parents[2]


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- code version ---------------------------------------------------------------------------------
def code_version(root: Path | None = None) -> dict:
    """The code a result was made with: git commit + dirty flag of the source tree pask runs from.

    ``key`` (what the sweep compares cells by): the git tree hashes of :data:`CODE_PATHS` at HEAD
    plus ``+dirty`` for uncommitted changes under them, so committing results (or docs) does not
    invalidate finished cells but a code change does. ``dirty``: uncommitted changes or new files
    in the code (:data:`DIRTY_PATHS`: the package, bundled data, the benchmark scripts,
    ``pyproject.toml``; results, docs and configs do not count), ``dirty_files`` the first
    :data:`MAX_DIRTY_FILES` of them. ``describe`` is ``git describe --dirty`` (its ``-dirty`` counts
    any tracked file). Outside a git checkout: the package version.
    """
    from pask.version import __version__

    root = (root or source_root()).resolve()

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=30
        ).stdout.rstrip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            raise ValueError("pask is not at the top of this git tree")
        commit = git("rev-parse", "HEAD")
        describe = git("describe", "--always", "--dirty", "--abbrev=12")
        paths = [p for p in CODE_PATHS if (root / p).exists()]
        trees = git("rev-parse", *[f"HEAD:{p}" for p in paths])
        code_dirty = bool(git("status", "--porcelain", "--untracked-files=all", "--", *paths))
        changed = git("status", "--porcelain", "--untracked-files=all", "--", *DIRTY_PATHS).splitlines()
    except (OSError, subprocess.SubprocessError, ValueError):
        return {"key": f"pask-{__version__}", "package": __version__}
    key = hashlib.sha256(trees.encode()).hexdigest()[:16] + ("+dirty" if code_dirty else "")
    files = [line[3:] for line in changed if line.strip()]
    out = {"key": key, "commit": commit, "describe": describe, "dirty": bool(files)}
    if files:
        out["dirty_files"] = files[:MAX_DIRTY_FILES]
        out["n_dirty_files"] = len(files)
    return out


# -- machine --------------------------------------------------------------------------------------
def cpu_info(cpuinfo: str | None = None) -> dict:
    """CPU model name and which of :data:`CPU_FLAGS` it has (``/proc/cpuinfo``; None where unreadable)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = None, None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if model is None and key == "model name":
            model = value.strip()
        elif flags is None and key == "flags":
            flags = set(value.split())
    return {
        "model": model or platform.processor() or platform.machine() or None,
        "flags": None if flags is None else [f for f in CPU_FLAGS if f in flags],
    }


def torch_cpu_capability() -> str:
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def machine() -> dict:
    """What a run's timings and bf16 numerics depend on: CPU (model, flags, cores), torch threads,
    BF16 arithmetic and AMX, the bf16 matmul mode and the native kernels (status, instruction set)."""
    import torch

    from pask.cpu import bf16_matmul, native_gemv, native_norm
    from pask.kv import native_attention
    from pask.runtime import prefill_store

    info = cpu_info()
    try:
        matmul = bf16_matmul.mode()
        resolved = bf16_matmul.resolved(matmul)
        matmul = matmul if resolved == matmul else f"{matmul} ({resolved})"  # what auto means on this CPU
    except PaskError:
        matmul = f"invalid: {os.environ.get('PASK_BF16_MATMUL')!r}"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": info["model"],
        "cpu_flags": info["flags"],
        "cores": os.cpu_count(),
        "cores_usable": usable,
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch_cpu_capability(),
        "cpu_bf16": bf16_matmul.cpu_has_bf16(),
        "amx": None if info["flags"] is None else "amx_tile" in info["flags"],
        "bf16_matmul": matmul,
        "native_attention": native_attention.status(),
        "native_attention_isa": native_attention.isa(),
        "native_gemv": native_gemv.status(),
        "native_gemv_isa": native_gemv.isa(),
        "quant_kernel": native_gemv.quant_kernel() if native_gemv.status() == "ok" else None,
        "native_norm": native_norm.status() if native_norm.enabled() else f"off ({native_norm.ENV}=0)",
        "prefill_store": bool(os.environ.get(prefill_store.ENV, "").strip()),  # prefills reused across runs
    }


def machine_line(m: dict | str | None) -> str:
    """A machine record in one line (for markdown footers)."""
    if not isinstance(m, dict):
        return str(m or "unknown")

    def yn(v) -> str:
        return "?" if v is None else ("yes" if v else "no")

    def kernel(status, isa) -> str:
        return f"{status} ({isa})" if isa else str(status)

    flags = m.get("cpu_flags")
    parts = [
        m.get("cpu_model") or m.get("cpu") or "unknown CPU",
        f"{m.get('cores_usable', '?')}/{m.get('cores', '?')} cores",
        " ".join(flags) if flags else "flags unknown",
        f"BF16 arithmetic {yn(m.get('cpu_bf16'))}",
        f"AMX {yn(m.get('amx'))}",
        f"torch {m.get('torch_cpu_capability', '?')} with {m.get('torch_threads', '?')} threads",
        f"bf16 matmul {m.get('bf16_matmul', '?')}",
        f"native attention {kernel(m.get('native_attention'), m.get('native_attention_isa'))}",
        f"native GEMV {kernel(m.get('native_gemv'), m.get('native_gemv_isa'))}",
    ]
    if m.get("quant_kernel"):  # records before the AVX2 int8 kernel have none
        parts.append(f"quantised-weight decode kernel {m['quant_kernel']}")
    if m.get("native_norm") is not None:  # records before the native RMSNorm have none
        parts.append(f"native RMSNorm {m['native_norm']}")
    return ", ".join(parts)


# -- the record -----------------------------------------------------------------------------------
def pask_env(environ: dict | None = None) -> dict[str, str]:
    """Every ``PASK_*`` environment variable and its value."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env) if k.startswith("PASK_")}


def versions() -> dict[str, str | None]:
    """Python, pask, torch and transformers versions (None: not installed)."""
    from pask.version import __version__

    def dist(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "pask": __version__,
        "torch": dist("torch"),
        "transformers": dist("transformers"),
    }


def _interpreter_module(orig_argv: list[str]) -> str | None:
    """``MOD`` when the interpreter ran ``python [options] -m MOD ...``."""
    args = iter(orig_argv[1:])
    for a in args:
        if a == "-m":
            return next(args, None)
        if a in ("-X", "-W"):  # options with an argument
            next(args, None)
        elif not a.startswith("-") or a == "-c":
            return None
    return None


def default_command(argv: list[str] | None = None, orig_argv: list[str] | None = None) -> str:
    """A command line as the user would type it: ``pask ...`` for the console script, ``python
    benchmarks/x.py ...`` for a script, ``python -m mod ...`` for a module (default: this process's)."""
    if argv is None:
        argv, orig_argv = sys.argv, getattr(sys, "orig_argv", None)
    prog, args = (argv[0] if argv else ""), list(argv[1:])
    module = _interpreter_module(list(orig_argv or []))
    if module:
        head = ["python", "-m", module]
    elif prog.endswith(".py"):
        p = Path(prog)
        if p.is_absolute() and p.is_relative_to(Path.cwd()):
            p = p.relative_to(Path.cwd())
        head = ["python", str(p)]
    elif prog in ("", "-c"):
        head = ["python", *(["-c"] if prog == "-c" else [])]
    else:
        head = [Path(prog).name]  # a console script (pask, pytest): its name
    return shlex.join(head + args)


def provenance(command: str | None = None, *, version: dict | None = None) -> dict:
    """The provenance record of a result made by this process now (``version``: an already computed
    :func:`code_version`)."""
    return {
        "command": default_command() if command is None else command,
        "code_version": code_version() if version is None else version,
        "machine": machine(),
        "env": pask_env(),
        "versions": versions(),
        "time": _now(),
    }


# -- writing results ------------------------------------------------------------------------------
def committed_results(path: Path | str, root: Path | None = None) -> bool:
    """Whether ``path`` lies in the repository's committed results (``<root>/benchmarks/results/``)."""
    results = ((root or source_root()) / RESULTS_DIR).resolve()
    p = Path(path).expanduser().resolve()
    return p == results or results in p.parents


def check_clean(path: Path | str, allow_dirty: bool = False, version: dict | None = None) -> dict:
    """Refuse (:class:`PaskError`) to write ``path`` into the committed results from a code tree with
    uncommitted code changes, unless ``allow_dirty``; returns the code version (``version`` if given).

    Call it before a long run too, so that the refusal comes before the work."""
    version = code_version() if version is None else version
    if allow_dirty or not version.get("dirty") or not committed_results(path):
        return version
    files = version.get("dirty_files", [])
    n = version.get("n_dirty_files", len(files))
    shown = ", ".join(files[:5]) + (f" and {n - 5} more" if n > 5 else "")
    raise PaskError(
        f"refusing to write {path} into the committed results from a code tree with uncommitted changes "
        f"({shown}): commit them first (the result then names its commit), write elsewhere, or pass "
        "--allow-dirty (the provenance then says the code was dirty)"
    )


def footer(prov: dict) -> str:
    """The markdown provenance footer: command, commit and dirty flag, machine, ``PASK_*`` env."""
    v = prov.get("code_version") or {}
    if v.get("commit"):
        code = f"commit {v['commit'][:12]}"
        if v.get("dirty"):
            code += f", with uncommitted code changes ({v.get('n_dirty_files', len(v.get('dirty_files', [])))} files)"
            code += ", written with --allow-dirty" if prov.get("allow_dirty") else ""
        else:
            code += ", clean"
    else:
        code = f"not a git checkout ({v.get('key', 'unknown')})"
    env = prov.get("env") or {}
    ver = prov.get("versions") or {}
    lines = [
        "---",
        "",
        "Provenance:",
        "",
        f"- command: `{prov.get('command') or 'unknown'}`",
        f"- code: {code}",
        f"- machine: {machine_line(prov.get('machine'))}",
        "- env: " + (", ".join(f"`{k}={val}`" for k, val in env.items()) if env else "no PASK_* variables"),
        f"- written {prov.get('time', '?')}; Python {ver.get('python', '?')}, torch {ver.get('torch', '?')}, "
        f"transformers {ver.get('transformers', '?')}",
    ]
    return "\n".join(lines) + "\n"


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_result(
    stem: Path | str,
    data: dict,
    markdown: str | None = None,
    *,
    command: str | None = None,
    allow_dirty: bool = False,
    indent: int | None = 2,
) -> tuple[Path, Path | None]:
    """Write ``stem.json`` (``data`` plus a ``"provenance"`` key) and, given ``markdown``, ``stem.md``
    (the markdown plus :func:`footer`); returns both paths (the second None without markdown).

    A ``.json`` / ``.md`` suffix on ``stem`` is dropped. Refuses to write into the committed results
    from a dirty code tree unless ``allow_dirty`` (:func:`check_clean`)."""
    stem = Path(stem)
    if stem.suffix in (".json", ".md"):
        stem = stem.with_suffix("")
    version = check_clean(stem, allow_dirty)
    prov = provenance(command, version=version)
    if allow_dirty and version.get("dirty"):
        prov["allow_dirty"] = True
    stem.parent.mkdir(parents=True, exist_ok=True)
    js = stem.with_name(stem.name + ".json")
    _write_text(js, json.dumps({**data, "provenance": prov}, indent=indent) + "\n")
    md = None
    if markdown is not None:
        md = stem.with_name(stem.name + ".md")
        _write_text(md, markdown.rstrip("\n") + "\n\n" + footer(prov))
    return js, md


def add_allow_dirty(parser) -> None:
    """The ``--allow-dirty`` flag of a benchmark script (an ``argparse`` parser)."""
    parser.add_argument(
        "--allow-dirty",
        action="store_true",
        help="write into benchmarks/results/ even with uncommitted code changes (the provenance says so)",
    )
