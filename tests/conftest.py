"""Shared fixtures: the tiny model in fp32 for exactness tests, the default model for slow checks."""

from __future__ import annotations

import os

import pytest
import torch

# The CI machine's 2 cores: 2 threads in a plain run, 1 per worker under `pytest -n 2` (pytest-xdist,
# as `make test` runs it), unless the caller sets OMP_NUM_THREADS (e.g. 1 beside a running eval).
_DEFAULT_THREADS = "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2"
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", _DEFAULT_THREADS)))


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M-Instruct in fp32 (exactness tests)."""
    from pask.runtime.models import load_model

    return load_model("smollm2-135m", dtype=torch.float32)


@pytest.fixture(scope="session")
def qwen():
    """qwen2.5-coder-0.5b in bf16, as evaluated."""
    from pask.runtime.models import load_model

    return load_model("qwen2.5-coder-0.5b", dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The Qwen tokenizer only (converts the embedded model once if needed)."""
    from transformers import AutoTokenizer

    from pask.runtime.models import convert_embedded

    return AutoTokenizer.from_pretrained(convert_embedded("qwen2.5-coder-0.5b"))


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The SmolLM2-135M tokenizer only."""
    from transformers import AutoTokenizer

    from pask.runtime.models import convert_embedded

    return AutoTokenizer.from_pretrained(convert_embedded("smollm2-135m"))
