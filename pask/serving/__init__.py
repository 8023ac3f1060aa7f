"""Serving: continuous batching over the tiered KV cache and an OpenAI-compatible HTTP server.

* :mod:`pask.runtime.capacity`: the KV-capacity admission rule (a fixed logical capacity in tokens).
* :mod:`pask.runtime.scheduler`: continuous batching; requests join and leave the running batch
  at step boundaries, each with its own grammar, tagger, policy instance and cache row.
* :mod:`pask.serving.worker`: the background thread that owns the model and drives the scheduler.
* :mod:`pask.serving.protocol`: OpenAI chat-completion requests -> engine requests, and responses.
* :mod:`pask.serving.metrics`: counters and gauges, rendered as Prometheus text.
* :mod:`pask.serving.server`: the FastAPI app (``pask serve``).
* :mod:`pask.serving.replicas`: N replicas of that app on Ray Serve (``pask serve --replicas N --ray ...``).
* :mod:`pask.bench.serving`: the loopback serving benchmark (``pask bench serve``).
"""
