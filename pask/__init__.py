"""pask: Parser-Aware Structural KV persistence for grammar-constrained generation."""

__version__ = "0.1.0"
