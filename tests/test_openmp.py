"""pask.openmp: the calling thread's OpenMP pool ends on release_pool."""

import sys
import threading

import pytest
import torch

from pask import openmp

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

        def run() -> None:  # a fresh thread, so no pool from earlier tests is in the count
            _parallel_region()
            box["with_pool"] = openmp.thread_count()
            box["released"] = openmp.release_pool()
            box["after"] = openmp.thread_count()
            box["again"] = openmp.release_pool()  # nothing held: still fine
            _parallel_region()  # a new pool starts
            box["restarted"] = openmp.thread_count()

        t = threading.Thread(target=run)
        t.start()
        t.join()
    finally:
        torch.set_num_threads(old)
    assert box["released"] and box["again"]
    assert box["after"] == box["with_pool"] - 1  # two threads: one worker besides the caller
    assert box["restarted"] == box["with_pool"]


def test_release_pool_without_libgomp(monkeypatch):
    monkeypatch.setattr(openmp, "_libgomp", lambda: None)
    assert openmp.release_pool() is False


def test_thread_count_counts_a_new_thread():
    n = openmp.thread_count()
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert openmp.thread_count() == n + 1
    finally:
        stop.set()
        t.join()
