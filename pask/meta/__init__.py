"""MetaKV: choose a KV configuration per request under latency and memory limits.

- :mod:`pask.meta.features`: what is known of a request before decoding (prompt length, label mix).
- :mod:`pask.meta.candidates`: the declared configurations a request may get.
- :mod:`pask.meta.predictor`: per candidate, predicted output length, latency, KV bytes and P(correct).
- :mod:`pask.meta.selection`: the constraints and the selection rule.
"""
