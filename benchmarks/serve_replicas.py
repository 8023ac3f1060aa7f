"""Replicas on Ray Serve: 2 replicas x 1 thread against 1 replica x 2 threads, the same total cores.

    .venv/bin/python benchmarks/serve_replicas.py [--model qwen2.5-coder-0.5b] [--dtype bf16] \
        [--arms 2x1,1x2] [--concurrency 8] [--input-len 1024] [--output-len 64] [--requests-per-client 3] \
        [--out STEM] [--allow-dirty]

Each arm (``RxT``: R replicas of T torch threads) runs ``pask serve``'s Ray Serve application
(:mod:`pask.serving.replicas`) on a fresh local Ray instance of as many CPUs as the largest arm
uses (the same total cores for every arm), Full KV, no deadline. ``--concurrency`` closed-loop
clients send BFCL-built chat completions (``pask bench serve``'s inputs,
:func:`pask.bench.serving.build_bodies`: real tool sets and questions after a history, about
``--input-len`` prompt tokens, ``tool_choice`` required, ``max_tokens`` ``--output-len``) through
the one HTTP address, ``--requests-per-client`` each, after an untimed warm-up of two short
requests per replica. Reported per arm: requests/s and generated tokens/s of wall time, mean TPOT
(server side), p50 / p95 request latency (client side), errors and malformed tool calls, the
requests each replica served (its ``X-Pask-Replica`` header), the time the application took to
start, and the resident memory of the replica processes (each holds its own model). Results:
``benchmarks/results/serving/replicas-*.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from pask.bench.serving import BenchConfig, _malformed, build_bodies
from pask.experiments.provenance import add_allow_dirty, check_clean, write_result
from pask.serving.replicas import ReplicaSpec, serve_replicas
from pask.serving.server import Limits

ROOT = Path(__file__).resolve().parent.parent


def parse_arms(text: str) -> list[tuple[int, int]]:
    """``2x1,1x2`` -> [(2, 1), (1, 2)] (replicas, threads each)."""
    arms = []
    for part in text.split(","):
        r, _, t = part.strip().partition("x")
        arms.append((int(r), int(t)))
    if not arms or any(r < 1 or t < 1 for r, t in arms):
        raise SystemExit(f"--arms: RxT pairs with R, T >= 1, got {text!r}")
    return arms


def replica_rss_mib() -> list[float]:
    """Resident memory of the Serve replica processes on this machine (Ray titles them ``ray::ServeReplica:...``)."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and b"ServeReplica" in (proc / "cmdline").read_bytes():
                rss = next(x for x in (proc / "status").read_text().splitlines() if x.startswith("VmRSS:"))
                out.append(int(rss.split()[1]) / 1024)
        except (OSError, StopIteration):  # gone meanwhile, or not ours to read
            continue
    return sorted(out)


def drive(url: str, bodies: list[dict], concurrency: int, per_client: int) -> dict:
    """``concurrency`` closed-loop clients, ``per_client`` requests each; what they saw."""
    import httpx2 as httpx

    lock = threading.Lock()
    rows: list[dict] = []

    def client(k: int) -> None:
        with httpx.Client(timeout=None) as c:
            for j in range(per_client):
                body = bodies[(k * per_client + j) % len(bodies)]
                t0 = time.perf_counter()
                try:
                    r = c.post(f"{url}/v1/chat/completions", json=body)
                    status, replica = r.status_code, r.headers.get("x-pask-replica")
                    out = r.json() if status == 200 else None
                except httpx.HTTPError:
                    status, replica, out = 0, None, None
                row = {"status": status, "latency_s": time.perf_counter() - t0, "replica": replica}
                if out is not None:
                    row |= {"tokens": out["usage"]["completion_tokens"], "tpot_ms": out["pask"]["tpot_ms"],
                            "malformed": _malformed(body, out)}  # fmt: skip
                with lock:
                    rows.append(row)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in rows if r["status"] == 200]
    lat = sorted(r["latency_s"] for r in ok)
    tokens = sum(r["tokens"] for r in ok)
    return {
        "requests": len(rows),
        "ok": len(ok),
        "errors_5xx": sum(r["status"] >= 500 for r in rows),
        "errors_other": sum(r["status"] != 200 and r["status"] < 500 for r in rows),
        "malformed": sum(r["malformed"] for r in ok),
        "wall_s": wall,
        "requests_per_s": len(ok) / wall,
        "tokens_per_s": tokens / wall,
        "completion_tokens": tokens,
        "tpot_ms_mean": statistics.fmean(r["tpot_ms"] for r in ok) if ok else None,
        "latency_p50_s": lat[len(lat) // 2] if lat else None,
        "latency_p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else None,
        "per_replica": dict(Counter(r["replica"] for r in ok)),
    }


def run_arm(args, replicas: int, threads: int, cores: int, bodies: list[dict]) -> dict:
    """One arm on a fresh local Ray instance of ``cores`` CPUs."""
    spec = ReplicaSpec(
        args.model,
        args.dtype,
        max_tokens=args.output_len,
        limits=Limits(request_timeout=None, max_queue=max(64, 2 * args.concurrency)),
        threads=threads,
    )
    t0 = time.perf_counter()
    with serve_replicas(spec, replicas, "local", num_cpus=cores) as url:
        startup = time.perf_counter() - t0
        print(f"  up in {startup:.1f} s at {url}; warming up", flush=True)
        warm = {**bodies[0], "max_tokens": 2, "messages": bodies[0]["messages"][-1:]}
        drive(url, [warm], 2 * replicas, 1)  # untimed: grammar kernels, first allocations, on every replica
        rss = replica_rss_mib()
        res = drive(url, bodies, args.concurrency, args.requests_per_client)
    return {"replicas": replicas, "threads": threads, "cores": cores, "startup_s": startup,
            "replica_rss_mib": rss, **res}  # fmt: skip


def markdown(result: dict, command: str) -> str:
    a = result["arms"]
    cfg = result["config"]
    lines = [
        "# Replicas on Ray Serve: throughput at the same total cores",
        "",
        f"Command: `{command}`",
        "",
        f"{cfg['model']} ({cfg['dtype']}), Full KV, {cfg['concurrency']} closed-loop clients x "
        f"{cfg['requests_per_client']} requests, BFCL-built inputs of ~{cfg['input_len']} tokens, "
        f"max_tokens {cfg['output_len']}; each arm on a fresh local Ray instance of {cfg['cores']} CPUs.",
        "",
        "| arm | req/s | gen tok/s | mean TPOT ms | p50 s | p95 s | 5xx | other | malformed | per replica "
        "| startup s | replica RSS MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]

    def f(x, fmt: str) -> str:
        return "–" if x is None else format(x, fmt)

    for r in a:
        per = ", ".join(str(n) for n in sorted(r["per_replica"].values(), reverse=True))
        rss = ", ".join(f"{x:.0f}" for x in r["replica_rss_mib"]) or "–"
        lines.append(
            f"| {r['replicas']} x {r['threads']} | {r['requests_per_s']:.3f} | {r['tokens_per_s']:.2f} | "
            f"{f(r['tpot_ms_mean'], '.1f')} | {f(r['latency_p50_s'], '.1f')} | {f(r['latency_p95_s'], '.1f')} | "
            f"{r['errors_5xx']} | {r['errors_other']} | {r['malformed']} | {per} | {r['startup_s']:.1f} | {rss} |"
        )
    if len(a) >= 2 and a[1]["requests_per_s"] and a[1]["tokens_per_s"]:
        first, second = a[0], a[1]
        mem = sum(first["replica_rss_mib"]) / sum(second["replica_rss_mib"]) if second["replica_rss_mib"] else None
        lines += [
            "",
            f"{first['replicas']} x {first['threads']} over {second['replicas']} x {second['threads']}: "
            f"requests/s x{first['requests_per_s'] / second['requests_per_s']:.2f}, generated tokens/s "
            f"x{first['tokens_per_s'] / second['tokens_per_s']:.2f}, memory of the replicas x{f(mem, '.2f')}.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--arms", default="2x1,1x2", help="RxT pairs: R replicas of T threads each")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="result stem (default benchmarks/results/serving/...)")
    add_allow_dirty(ap)
    args = ap.parse_args()
    arms = parse_arms(args.arms)
    cores = max(r * t for r, t in arms)
    stem = f"replicas-{args.model}-c{args.concurrency}-in{args.input_len}-out{args.output_len}"
    out = args.out or ROOT / "benchmarks" / "results" / "serving" / stem
    command = "python benchmarks/serve_replicas.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    check_clean(out, args.allow_dirty)  # before the run, not after it

    from transformers import AutoTokenizer

    from pask.runtime.models import resolve_model_dir

    path, name = resolve_model_dir(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = BenchConfig(args.concurrency, args.input_len, args.output_len, args.requests_per_client)
    bodies = build_bodies(tok, name, args.concurrency * args.requests_per_client, cfg)
    results = []
    for replicas, threads in arms:
        print(f"arm {replicas} x {threads} ({cores} Ray CPUs)...", flush=True)
        results.append(run_arm(args, replicas, threads, cores, bodies))
        r = results[-1]
        print(f"  {r['requests_per_s']:.3f} req/s, {r['tokens_per_s']:.2f} tok/s, {r['errors_5xx']} 5xx", flush=True)
    keys = ("dtype", "concurrency", "input_len", "output_len", "requests_per_client")
    config = {"model": name, **{k: getattr(args, k) for k in keys}, "cores": cores}
    result = {"config": config, "arms": results}
    md = markdown(result, command)
    json_path, _ = write_result(out, result, md, command=command, allow_dirty=args.allow_dirty)
    print(md, end="")
    print(f"results: {json_path}")


if __name__ == "__main__":
    main()
