"""OpenMP thread pools: give back the calling thread's pool before another thread decodes.

libgomp (one copy per process, shared by PyTorch and pask's native kernels) keeps a pool of worker
threads for every thread that has started a parallel region. Once the pools together hold more
threads than the process has CPUs, libgomp cuts spin-waiting between regions to ~100 spins, so a
region's workers are asleep when it starts and each region pays a futex wake-up. The server decodes
in its own thread (:mod:`pask.serving.worker`); a pool the main thread keeps from loading the model
or probing the native kernels put every short region of the decode thread in that state: at batch
16, one 4864 x 896 bf16 GEMV took ~300 us in a second thread against ~205 us in the main thread, or
in a second thread after :func:`release_pool` (``python benchmarks/decode_thread.py``).

:func:`release_pool` calls OpenMP 5.0's ``omp_pause_resource_all`` (soft pause): the calling
thread's pool threads end and stop counting; a later region in that thread starts a new pool.
"""

from __future__ import annotations

import ctypes
import os
import threading
from functools import lru_cache

OMP_PAUSE_SOFT = 1


@lru_cache(maxsize=1)
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp already in the process (PyTorch's), or None if none is loaded or it lacks the call."""
    import torch  # noqa: F401  (loads PyTorch's libgomp first, so the soname resolves to it)

    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
    except OSError:
        return None
    if not hasattr(lib, "omp_pause_resource_all"):
        return None
    lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
    lib.omp_pause_resource_all.restype = ctypes.c_int
    return lib


def release_pool() -> bool:
    """End the OpenMP worker threads the calling thread holds (if any); True if libgomp did it.

    Call it in the thread that loaded the model, before another thread starts decoding. Harmless
    where nothing is held; False where libgomp is not loaded or has no ``omp_pause_resource_all``.
    """
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


def thread_ids() -> set[int]:
    """Native ids of this process's threads (``/proc/self/task``; the Python threads' ids elsewhere)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return {t.native_id for t in threading.enumerate() if t.native_id is not None}
