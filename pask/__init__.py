"""pask: Parser-Aware Structural KV persistence for grammar-constrained generation.

``pask.load`` and ``pask.generate`` (:mod:`pask.api`) and ``pask.kv_policy`` (:mod:`pask.hf`:
Hugging Face ``generate`` on the tiered cache) are imported on first use, so that ``import pask``
stays light and the layers below never import the API.
"""

from pask.version import __version__

__all__ = ["KVPolicy", "Result", "__version__", "generate", "kv_policy", "load"]


def __getattr__(name: str):
    if name in ("load", "generate", "Result"):
        from pask import api

        return getattr(api, name)
    if name in ("kv_policy", "KVPolicy"):
        from pask import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'pask' has no attribute {name!r}")
