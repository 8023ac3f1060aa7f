"""Shared fixtures: the tiny model in fp32 for exactness tests, the default model for slow checks."""

from __future__ import annotations

import os

import pytest
import torch

# 2 threads (the CI machine's cores) unless the caller limits them, e.g. OMP_NUM_THREADS=1 beside a running eval
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))


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
