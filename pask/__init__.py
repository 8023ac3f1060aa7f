"""pask: Parser-Aware Structural KV persistence for grammar-constrained generation.

``pask.load`` and ``pask.generate`` (:mod:`pask.api`) are imported on first use, so that
``import pask`` stays light and the layers below never import the API.
"""

from pask.version import __version__

__all__ = ["Result", "__version__", "generate", "load"]


def __getattr__(name: str):
    if name in ("load", "generate", "Result"):
        from pask import api

        return getattr(api, name)
    raise AttributeError(f"module 'pask' has no attribute {name!r}")
