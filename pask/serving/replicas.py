"""Serving replicas on Ray Serve (``pask serve --replicas N --ray local|auto|ADDRESS``).

N replicas of one Ray Serve deployment answer behind Serve's HTTP proxy: one address, the
OpenAI-compatible API of ``pask serve``. Every replica builds its own
:class:`~pask.serving.server.Service` from a :class:`ReplicaSpec` (its own model, KV pool,
scheduler and decode thread, ``threads`` torch threads on as many Ray CPUs) and serves the app of
:func:`~pask.serving.server.create_app` unchanged: the same routes, limits, error bodies and event
streams. Each response names its replica in an ``X-Pask-Replica`` header.

* Routing is Serve's default: of two replicas drawn at random, the one with fewer requests in
  flight. The proxy does not read bodies, so routing by prompt prefix would need a second hop
  that parses each request; prefill reuse (a prefill store, :mod:`pask.runtime.prefill_store`)
  is a directory, which every replica on one host or a shared file system reads.
* ``GET /metrics`` on any replica shows all of them: each replica publishes its
  :meth:`~pask.serving.metrics.Metrics.state` to a named actor (:class:`MetricsHub`) every
  :data:`PUBLISH_S`; the answering replica adds its own fresh state and renders the sums, with each
  replica's gauges beside them (label ``replica``). A replica silent for :data:`STALE_S` (dead)
  leaves the gauges and its counters join a ``retired`` sum, so the counters never go down.
* Serve calls :meth:`Replica.check_health` periodically; a replica whose decode thread died fails
  it and Serve replaces it. A replica that dies takes its requests in flight with it (the proxy
  answers them with a 5xx, a stream is cut); the other replicas' requests go on.

:func:`serving_model` and :func:`serving_policy_factory` build the model and the policies of any
server process, one (``pask serve``) or a replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pask.errors import PaskError

if TYPE_CHECKING:
    import torch

    from pask.runtime.models import LoadedModel
    from pask.serving.server import Limits

log = logging.getLogger("pask.serve")

APP_NAME = "pask"  # the Serve application (and deployment) name
HUB_NAMESPACE = "pask"
PUBLISH_S = 0.5  # how often a replica publishes its metrics
STALE_S = 10.0  # a replica silent this long is gone: its counters retire, its gauges go
HEALTH_PERIOD_S = 5.0
HUB_TIMEOUT_S = 5.0
_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}


# -- what a server process builds --------------------------------------------------------------
def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of ``bf16`` / ``fp32`` (PaskError otherwise)."""
    import torch

    if name not in _DTYPES:
        raise PaskError(f"unknown dtype '{name}'; choose bf16 or fp32")
    return getattr(torch, _DTYPES[name])


def serving_model(model: str, dtype: torch.dtype, weights: str | None = None) -> LoadedModel:
    """The model as the server runs it: decode GEMVs on the native bf16 kernel where
    :func:`pask.cpu.bf16_matmul.serving_mode` says so; ``weights``: the linear layers' format
    (:mod:`pask.cpu.weights`)."""
    import gc

    from pask.cpu import bf16_matmul
    from pask.runtime.models import load_model

    lm = load_model(model, dtype=dtype, weights=weights)
    lm.model.pask_bf16_gemv_linears = bf16_matmul.apply_gemv(lm.model, bf16_matmul.serving_mode())
    gc.collect()
    gc.freeze()  # the model's objects leave the collector's generations: no full collection walks them mid-step
    return lm


def serving_policy_factory(
    name: str,
    budget: float | None,
    config: str | None = None,
    table: Path | str | None = None,
    fingerprint: str | None = None,
    allow_transfer: bool = False,
) -> Callable:
    """A callable building one policy instance per served request (``full``: FullPolicy, all H).

    Built once here so that a bad name, budget, configuration or table fails before serving
    (``fingerprint`` None: the table is not checked against a model yet).
    """
    from pask.policies import FullPolicy
    from pask.policies.factory import make_policy

    if name == "pask":  # served requests are tool calls / JSON: a function-calling (bfcl) table
        from pask.policies.pask import check_task, make_pask_policy
        from pask.policies.table import load

        if table is None:
            raise PaskError("--policy pask needs --table FILE (made by `pask calibrate --task bfcl`)")
        frozen = load(table, fingerprint=fingerprint, allow_transfer=allow_transfer)
        check_task(frozen, "bfcl")  # served requests are tool calls: no transfer across tasks here
        make_pask_policy(frozen, budget)
        return lambda: make_pask_policy(frozen, budget)
    if make_policy(name, budget, config) is None:
        return FullPolicy
    return lambda: make_policy(name, budget, config)


@dataclass
class ReplicaSpec:
    """Everything a replica needs to build its :class:`~pask.serving.server.Service` (picklable;
    checked when made, so that bad values fail before Ray starts). ``limits``: a
    :class:`~pask.serving.server.Limits` (None: the defaults); ``threads``: torch threads and Ray
    CPUs of each replica; paths are made absolute."""

    model: str
    dtype: str = "bf16"
    weights: str | None = None
    policy: str = "full"
    budget: float | None = None
    policy_config: str | None = None
    table: str | None = None
    allow_transfer: bool = False
    capacity_tokens: int | None = None
    max_batch: int | None = None
    max_tokens: int = 256
    limits: Limits | None = None
    threads: int = 1
    prefill_store: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise PaskError(f"unknown dtype '{self.dtype}'; choose bf16 or fp32")
        from pask.cpu.weights import configured

        self.weights = configured(self.weights)  # the driver's $PASK_WEIGHTS travels in the spec
        for name, value in (("--capacity-tokens", self.capacity_tokens), ("--max-batch", self.max_batch)):
            if value is not None and value < 1:
                raise PaskError(f"{name} must be >= 1, got {value}")
        if self.max_tokens < 1 or self.threads < 1:
            raise PaskError(f"--max-tokens and --threads must be >= 1, got {self.max_tokens} and {self.threads}")
        if self.budget is not None:
            from pask.kv.budget import check_budget

            check_budget(self.budget, "--budget")
        self.table = str(Path(self.table).resolve()) if self.table else None
        self.prefill_store = str(Path(self.prefill_store).resolve()) if self.prefill_store else None
        serving_policy_factory(self.policy, self.budget, self.policy_config, self.table, None, self.allow_transfer)

    def max_ongoing(self) -> int:
        """Requests Serve lets one replica hold: its queue limit plus a full running batch."""
        from pask.serving.server import MAX_QUEUE

        limit = self.limits.max_queue if self.limits is not None else MAX_QUEUE
        return limit + (self.max_batch or MAX_QUEUE)


# -- metrics across replicas -------------------------------------------------------------------
class MetricsHub:  # its module imports no torch: the hub's process stays small
    """A named Ray actor holding the last :meth:`~pask.serving.metrics.Metrics.state` of each
    replica; a replica silent for :data:`STALE_S` (or gone) retires: its counters join one sum."""

    def __init__(self) -> None:
        self._live: dict[str, tuple[float, dict]] = {}
        self._retired: dict | None = None

    def put(self, replica: str, state: dict) -> None:
        self._live[replica] = (time.monotonic(), state)

    def drop(self, replica: str) -> None:
        """``replica`` is shutting down: retire it now."""
        if replica in self._live:
            self._retire(replica)

    def reset(self) -> None:
        self._live, self._retired = {}, None

    def collect(self) -> tuple[dict[str, dict], dict | None]:
        """The live replicas' states and the retired counters (None: nobody retired)."""
        now = time.monotonic()
        for r in [r for r, (t, _) in self._live.items() if now - t > STALE_S]:
            self._retire(r)
        return {r: s for r, (_, s) in self._live.items()}, self._retired

    def _retire(self, replica: str) -> None:
        from pask.serving.metrics import merge, retired

        state = retired(self._live.pop(replica)[1])
        self._retired = state if self._retired is None else merge([self._retired, state])


def _hub_name(app_name: str) -> str:
    return f"pask-metrics-{app_name}"


def metrics_hub(app_name: str = APP_NAME, create: bool = False):
    """The hub actor of an application (``create``: start it if it is not there; detached, no CPUs)."""
    import ray

    if create:
        remote = ray.remote(MetricsHub).options(
            name=_hub_name(app_name), namespace=HUB_NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0
        )
        return remote.remote()
    return ray.get_actor(_hub_name(app_name), namespace=HUB_NAMESPACE)


# -- the replica -------------------------------------------------------------------------------
class Replica:
    """One serving replica, the class of the Serve deployment (see the module docstring)."""

    def __init__(self, spec: ReplicaSpec, app_name: str = APP_NAME) -> None:
        import torch
        from ray import serve

        from pask.runtime.prefill_store import ENV
        from pask.serving.server import Limits, Service

        self._hub, self._warned = None, False
        self._stop = threading.Event()
        torch.set_num_threads(spec.threads)
        if spec.prefill_store:
            os.environ[ENV] = spec.prefill_store
        self.id = serve.get_replica_context().replica_tag
        self.app_name = app_name
        lm = serving_model(spec.model, torch_dtype(spec.dtype), spec.weights)
        factory = serving_policy_factory(
            spec.policy, spec.budget, spec.policy_config, spec.table, lm.fingerprint, spec.allow_transfer
        )
        self.service = Service.build(
            lm,
            factory,
            spec.capacity_tokens,
            max_batch=spec.max_batch,
            default_max_tokens=spec.max_tokens,
            limits=spec.limits or Limits(),
        )
        self._publisher = threading.Thread(target=self._publish_loop, name="pask-metrics", daemon=True)
        self._publisher.start()

    def __serve_build_asgi_app__(self):
        """The ASGI app of this replica (Serve calls it after the constructor, then runs its lifespan)."""
        from pask.serving.server import create_app

        return _ReplicaApp(create_app(self.service), self)

    def check_health(self) -> None:
        """Serve's periodic check: a replica whose decode thread is not running is replaced."""
        if not self.service.worker.alive:
            raise RuntimeError(f"replica {self.id}: the decode thread is not running")

    def __del__(self) -> None:  # called by Serve's ingress wrapper at shutdown, after the app's lifespan
        if not hasattr(self, "_stop"):  # the constructor failed early
            return
        self._stop.set()
        hub = self.hub()
        if hub is not None:
            with contextlib.suppress(Exception):
                hub.drop.remote(self.id)

    def hub(self):
        """The metrics hub, or None where it cannot be reached now (asked again next time)."""
        if self._hub is None:
            try:
                self._hub = metrics_hub(self.app_name)
            except Exception:  # not there (yet, or any more)
                return None
        return self._hub

    def _publish_loop(self) -> None:
        import ray

        while not self._stop.wait(PUBLISH_S):
            hub = self.hub()
            if hub is None:
                continue
            try:
                ray.get(hub.put.remote(self.id, self.service.metrics.state()), timeout=HUB_TIMEOUT_S)
                self._warned = False
            except Exception as e:  # the hub died or is slow: try again next time (say so once)
                if not self._warned:
                    log.warning("replica %s: metrics not published: %s", self.id, e)
                self._hub, self._warned = None, True

    async def metrics_text(self) -> str:
        """Prometheus text of every live replica (this one's state fresh) plus the retired counters."""
        from pask.serving.metrics import merge, render

        live, gone = {}, None
        hub = self.hub()
        if hub is not None:
            try:
                live, gone = await asyncio.wait_for(_awaited(hub.collect.remote()), HUB_TIMEOUT_S)
            except Exception as e:
                log.warning("replica %s: metrics of the other replicas unavailable: %s", self.id, e)
                self._hub = None
        live[self.id] = self.service.metrics.state()
        return render(merge([*live.values(), *([gone] if gone else [])]), live)


async def _awaited(ref) -> Any:
    return await ref


class _ReplicaApp:
    """ASGI: the server's app, with ``GET /metrics`` answered for all replicas and an
    ``X-Pask-Replica`` header on every response."""

    def __init__(self, app, replica: Replica) -> None:
        self.app, self.replica = app, replica
        self._header = (b"x-pask-replica", replica.id.encode())

    def add_exception_handler(self, exc, handler) -> None:  # Serve registers its own on the app
        self.app.add_exception_handler(exc, handler)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan: the app's, which starts and stops the decode thread
            await self.app(scope, receive, send)
            return

        async def tagged(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self._header]}
            await send(message)

        if scope["method"] == "GET" and scope["path"] == "/metrics":
            from fastapi.responses import PlainTextResponse

            text = await self.replica.metrics_text()
            await PlainTextResponse(text, media_type="text/plain; version=0.0.4")(scope, receive, tagged)
            return
        await self.app(scope, receive, tagged)


# -- running the application -------------------------------------------------------------------
def connect(address: str, num_cpus: int | None = None, log_to_driver: bool = True) -> bool:
    """Join (``auto`` / an address) or start (``local``, with ``num_cpus`` CPUs) a Ray cluster;
    True if this call started Ray."""
    try:
        import ray
        from ray import serve  # noqa: F401  (Serve's extras: ray[serve])
    except ImportError:
        raise PaskError("--ray needs the optional dependency ray[serve]: pip install 'pask[ray]'") from None
    if ray.is_initialized():
        return False
    try:
        if address == "local":
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=log_to_driver)
        else:
            ray.init(address=address, log_to_driver=log_to_driver)
    except ConnectionError as e:
        raise PaskError(f"cannot reach a Ray cluster at '{address}': {e} (use --ray local to start one)") from None
    return True


def application(spec: ReplicaSpec, replicas: int, app_name: str = APP_NAME):
    """The Serve application: ``replicas`` replicas of :class:`Replica` with ``spec.threads`` CPUs each."""
    from ray import serve

    deployment = serve.deployment(
        serve.ingress()(Replica),
        name=app_name,
        num_replicas=replicas,
        ray_actor_options={"num_cpus": spec.threads},
        max_ongoing_requests=spec.max_ongoing(),
        health_check_period_s=HEALTH_PERIOD_S,
        graceful_shutdown_timeout_s=5,
        max_constructor_retry_count=replicas + 1,
    )
    return deployment.bind(spec, app_name)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_replicas(
    spec: ReplicaSpec,
    replicas: int = 2,
    address: str = "local",
    host: str = "127.0.0.1",
    port: int | None = None,
    num_cpus: int | None = None,
    app_name: str = APP_NAME,
    log_to_driver: bool = False,
) -> Iterator[str]:
    """The application on Ray Serve for the block; yields its base URL (``http://HOST:PORT``).

    ``address``: ``local`` starts Ray here (``num_cpus``: its CPUs; default all), ``auto`` or an
    address joins a cluster. On the way out the application and its metrics hub are deleted, and
    Serve and Ray shut down if this call started Ray. ``port`` None: a free one.
    """
    if replicas < 1:
        raise PaskError(f"--replicas must be >= 1, got {replicas}")
    if address == "local":  # the replicas load from this machine's cache: fill it once, here
        from pask.runtime.models import resolve_model_dir

        resolve_model_dir(spec.model)
    port = port or _free_port(host)
    started = connect(address, num_cpus, log_to_driver)
    import ray
    from ray import serve

    hub = None
    try:
        serve.start(http_options={"host": host, "port": port})
        hub = metrics_hub(app_name, create=True)
        ray.get(hub.reset.remote())
        try:
            serve.run(application(spec, replicas, app_name), name=app_name, route_prefix="/")
        except Exception as e:
            lines = [x for x in str(e).strip().splitlines() if x.strip()]
            raise PaskError(f"the replicas did not start: {lines[-1] if lines else type(e).__name__}") from None
        shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        yield f"http://{shown}:{port}"
    finally:
        with contextlib.suppress(Exception):
            serve.delete(app_name)
        if hub is not None:
            with contextlib.suppress(Exception):
                ray.kill(hub)
        if started:
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()


def deploy(
    spec: ReplicaSpec,
    replicas: int,
    address: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve ``replicas`` replicas on Ray Serve at ``host:port`` until interrupted (Ctrl-C, or SIGTERM
    once serving: the application is deleted, and Ray stopped if this call started it)."""

    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    serving = serve_replicas(spec, replicas, address, host, port, log_to_driver=True)
    with contextlib.suppress(KeyboardInterrupt), serving as url:
        # after ray.init, whose handler of SIGTERM would end the process without the teardown
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, interrupt) if main else None
        try:
            if on_ready is not None:
                on_ready(url)
            while True:
                time.sleep(3600)
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous)
