"""Building the native CPU kernels: one C++ source -> one shared library loaded with ctypes.

A source is compiled on first use with the system C++ compiler (``$CXX``, default ``g++``) into
``<cache root>/native/<key>/`` where the key hashes the source, flags, compiler version and CPU
flags (``-march=native`` code is only reused on the CPU it was built for); concurrent processes
serialise on a lock file.

Environment:

* ``PASK_NATIVE=0`` disables every native kernel deliberately (their modules check :func:`disabled`):
  the PyTorch paths run, silently.
* A kernel that is wanted but cannot be built (no compiler, a source missing from a broken
  install, a compile error), loaded or probed (results that disagree with the reference) raises
  :class:`NativeKernelError` (a :class:`~pask.errors.PaskError`) with the reason, instead of
  running a slower path unnoticed. ``PASK_ALLOW_FALLBACK=1`` turns that into a warning and the
  PyTorch path (:func:`unavailable`). Where a kernel does not apply (a dtype or shape it does not
  serve) the PyTorch path runs without a probe and without an error.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import re
import shutil
import subprocess
import warnings
from collections.abc import Callable
from pathlib import Path

from pask.errors import PaskError

COMMON_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-std=c++20", "-shared", "-fPIC"]


ALLOW_FALLBACK_ENV = "PASK_ALLOW_FALLBACK"


class NativeKernelError(PaskError):
    """A native kernel was wanted but could not be built, loaded or probed."""


def disabled() -> bool:
    """Whether ``PASK_NATIVE=0`` turns the native kernels off."""
    return os.environ.get("PASK_NATIVE", "1") == "0"


def allow_fallback() -> bool:
    """Whether ``PASK_ALLOW_FALLBACK=1`` lets a kernel that failed fall back to PyTorch with a warning."""
    return os.environ.get(ALLOW_FALLBACK_ENV, "0") == "1"


def unavailable(kernel: str, state: str, fallback: str, warn: bool = True) -> None:
    """Report that ``kernel`` was wanted but is ``state`` (why it could not be built, loaded or probed).

    Raises :class:`NativeKernelError` naming the reason and the ways out; with
    ``PASK_ALLOW_FALLBACK=1`` warns instead (when ``warn``) and returns: the caller then runs ``fallback``.
    """
    if allow_fallback():
        if warn:
            warnings.warn(f"pask {kernel} {state}; using {fallback} ({ALLOW_FALLBACK_ENV}=1)", stacklevel=4)
        return
    raise NativeKernelError(
        f"pask {kernel} {state}. Install a C++ compiler with OpenMP (g++, or set $CXX), reinstall pask if "
        f"its C++ sources are missing, or opt out: PASK_NATIVE=0 turns the native kernels off, "
        f"{ALLOW_FALLBACK_ENV}=1 runs {fallback} with a warning"
    )


class Probe:
    """A native kernel's state, probed once per process: ``"ok"``, ``"probing"`` (while the probe
    runs), ``"disabled by PASK_NATIVE=0"`` or why it could not be built, loaded or probed.

    ``probe()`` builds, loads and checks the kernel and returns that state (never raises). The
    kernel modules expose :meth:`available` and :meth:`status` as their own functions.
    """

    def __init__(self, kernel: str, fallback: str, probe: Callable[[], str]) -> None:
        self.kernel, self.fallback, self._probe = kernel, fallback, probe
        self.state: str | None = None  # None: not tried yet (tests set it back to None to probe again)
        self.warned = False  # the fallback warning (PASK_ALLOW_FALLBACK=1) was given for this probe

    def status(self) -> str:
        """``"ok"`` or why the kernel is not used (probes on first use; never raises)."""
        if self.state is None:
            self.state, self.warned = "probing", False
            self.state = self._probe()
        return self.state

    def available(self) -> bool:
        """Whether the kernel is built, loaded and agrees with its reference (cached per process).

        False with ``PASK_NATIVE=0``. A kernel that could not be built, loaded or probed raises
        :class:`NativeKernelError`, or with ``PASK_ALLOW_FALLBACK=1`` warns (once) and gives False.
        """
        state = self.status()
        if state in ("ok", "probing"):
            return True
        if not state.startswith("disabled"):
            unavailable(self.kernel, state, self.fallback, warn=not self.warned)
            self.warned = True
        return False


def try_load(loader: Callable[[], object]) -> tuple[object | None, str | None]:
    """A probe's first step: ``(library, None)`` from ``loader``, or ``(None, why)`` when
    ``PASK_NATIVE=0`` or the library cannot be built or loaded."""
    if disabled():
        return None, "disabled by PASK_NATIVE=0"
    try:
        return loader(), None
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, f"unavailable: {e}"


def compiler() -> str | None:
    """The C++ compiler to use, or None."""
    return shutil.which(os.environ.get("CXX", "g++"))


def cpu_flags() -> str:
    """The CPU's feature flags (``/proc/cpuinfo``), else the processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def local_includes(source: Path) -> list[Path]:
    """The files ``source`` includes with ``#include "..."`` (relative to it, one level)."""
    names = re.findall(r'^\s*#\s*include\s+"([^"]+)"', source.read_text(), flags=re.MULTILINE)
    return [(source.parent / n).resolve() for n in names]


def build_key(cxx: str, source: Path, flags: list[str]) -> str:
    """Hash of what the library depends on: source and its local headers, flags, compiler version, CPU flags."""
    version = subprocess.run([cxx, "-dumpfullversion", "-dumpversion"], capture_output=True, text=True).stdout
    h = hashlib.sha256()
    headers = [f.read_bytes() for f in local_includes(source)]
    for part in (source.read_bytes(), *headers, " ".join(flags).encode(), version.encode(), cpu_flags().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def build(source: Path, flags: list[str], cxx: str | None = None) -> Path:
    """Path of the compiled library of ``source`` (built if missing).

    Raises RuntimeError without a compiler or when compilation fails (with the compiler's output).
    """
    from pask.paths import cache_root

    cxx = cxx or compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX or g++)")
    out_dir = cache_root() / "native" / build_key(cxx, source, flags)
    lib = out_dir / f"lib{source.stem}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib.exists():
            tmp = out_dir / f".build-{os.getpid()}.so"
            proc = subprocess.run([cxx, *flags, str(source), "-o", str(tmp)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"compiling {source.name} failed:\n{proc.stderr[-2000:]}")
            tmp.replace(lib)
    return lib
