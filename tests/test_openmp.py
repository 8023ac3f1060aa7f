"""pask.cpu.openmp: the calling thread's OpenMP pool ends on release_pool."""

import sys
import threading
import time

import pytest
import torch

from pask.cpu import openmp

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="libgomp and /proc/self/task are Linux's")


def _parallel_region() -> None:
    """A PyTorch op big enough to run on every thread (starts this thread's pool)."""
    a = torch.randn(1 << 20)
    for _ in range(3):
        a.add_(1.0)


def test_release_pool_ends_the_callers_workers():
    if openmp._libgomp() is None:
        pytest.skip("PyTorch here has no libgomp with omp_pause_resource_all")
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        box = {}

        def run() -> None:  # a fresh thread, so its pool is the one the region starts
            before = openmp.thread_ids()
            _parallel_region()
            box["workers"] = openmp.thread_ids() - before
            box["released"] = openmp.release_pool()
            box["after"] = openmp.thread_ids()
            box["again"] = openmp.release_pool()  # nothing held: still fine
            _parallel_region()  # a new pool starts
            box["restarted"] = openmp.thread_ids() - box["after"]

        t = threading.Thread(target=run)
        t.start()
        t.join()
    finally:
        torch.set_num_threads(old)
    assert box["released"] and box["again"]
    assert box["workers"], "the parallel region started no worker thread"
    assert box["workers"] - box["after"], "release_pool left the region's workers running"
    assert box["restarted"]


def test_release_pool_without_libgomp(monkeypatch):
    monkeypatch.setattr(openmp, "_libgomp", lambda: None)
    assert openmp.release_pool() is False


def test_thread_ids_hold_a_new_thread():
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert t.native_id in openmp.thread_ids()
    finally:
        stop.set()
        t.join()
    # join() returns once Python is done with the thread; the OS thread may
    # still be in its exit path for a moment, so /proc/self/task can lag.
    deadline = time.monotonic() + 10.0
    while t.native_id in openmp.thread_ids() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert t.native_id not in openmp.thread_ids()
