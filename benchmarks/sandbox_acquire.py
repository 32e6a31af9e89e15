"""Sandbox acquire latency: cold start against the warm pool, measured in one run on one engine.

Acquire latency is the time from asking for a sandbox until commands can run in it. Cold: create
and start a container, then the first exec (what ``DockerBackend.start`` does). Warm: take an
already started one from :class:`infra.sandbox.pool.WarmPool` (one liveness check). Episodes come
in bursts of ``--burst`` (one step's demand per image); between bursts the pool refills, as it does
while the trainer runs. Percentiles use the nearest-rank method.

``python -m benchmarks.sandbox_acquire --episodes 48 --burst 8`` (``make bench-sandbox``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

from infra.environments import BASE_IMAGE
from infra.sandbox.docker_backend import DockerBackend
from infra.sandbox.pool import WarmPool


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def cold(backend: DockerBackend, image: str, episodes: int) -> list[float]:
    """Seconds per cold acquire (sandbox removal not timed)."""
    out = []
    for _ in range(episodes):
        t0 = time.perf_counter()
        box = backend.start(image, {"agentrl.bench": "cold"})
        out.append(time.perf_counter() - t0)
        box.close()
    return out


def warm(backend: DockerBackend, image: str, episodes: int, burst: int, refill: bool) -> tuple[list[float], int]:
    """Seconds per pool acquire, and how many acquires found the pool empty (cold fallbacks)."""
    pool = WarmPool(backend, max_idle_per_image=burst)
    out, boxes = [], []
    try:
        pool.ensure(image, burst)
        pool.wait_ready(120)
        for i in range(episodes):
            t0 = time.perf_counter()
            box, _ = pool.acquire(image, {"agentrl.bench": "warm"})
            out.append(time.perf_counter() - t0)
            boxes.append(box)
            if (i + 1) % burst == 0:
                for b in boxes:
                    b.close()
                boxes = []
                if refill:
                    pool.wait_ready(120)
        return out, pool.stats["cold"]
    finally:
        for b in boxes:
            b.close()
        pool.close()


def main(argv: list[str] | None = None) -> int:
    """Measure and print the three modes; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default=BASE_IMAGE)
    parser.add_argument("--episodes", type=int, default=48)
    parser.add_argument("--burst", type=int, default=8)
    args = parser.parse_args(argv)
    backend = DockerBackend()
    cold(backend, args.image, 2)  # warm-up: image layers in the page cache
    results = {"cold start": (cold(backend, args.image, args.episodes), args.episodes)}
    results["warm pool"] = warm(backend, args.image, args.episodes, args.burst, refill=True)
    results["warm pool, no refill time"] = warm(backend, args.image, args.episodes, args.burst, refill=False)
    base = statistics.median(results["cold start"][0])
    print(f"sandbox acquire latency, {args.episodes} episodes in bursts of {args.burst}, image {args.image}")
    print(f"{'mode':28s} {'p50 ms':>9s} {'p99 ms':>9s} {'mean ms':>9s} {'cold starts':>12s} {'p50 vs cold':>12s}")
    for name, (lat, n_cold) in results.items():
        p50 = statistics.median(lat)
        print(f"{name:28s} {p50 * 1e3:9.1f} {percentile(lat, 99) * 1e3:9.1f} {statistics.mean(lat) * 1e3:9.1f} "
              f"{n_cold:12d} {base / p50:11.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
