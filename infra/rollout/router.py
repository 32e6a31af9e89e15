"""Routing trajectories to engine replicas.

A multi-turn trajectory re-sends its whole history every turn; the replica that served its last
turn holds that history in its prefix cache. :class:`Router` keeps a trajectory on that replica
(sticky by trajectory id) and places new trajectories on the least-loaded live replica (fewest
requests in flight, ties broken by fewest trajectories assigned). ``policy="round_robin"`` is the
naive baseline: every request goes to the next replica in turn, regardless of history.

When a replica dies, :meth:`Router.mark_dead` removes it: its trajectories lose their affinity
and the caller classifies their in-flight requests as ``infra_failure/engine_unreachable``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

RoutingPolicy = Literal["affinity", "round_robin"]


class NoLiveReplica(RuntimeError):
    """Every replica is marked dead."""


class Router:
    """Chooses a replica per request; thread-safe."""

    def __init__(self, replicas: list[str], policy: RoutingPolicy = "affinity"):
        """Args: replicas: replica names (e.g. base URLs); policy: ``affinity`` or ``round_robin``.

        Raises:
            ValueError: no replicas, duplicates, or an unknown policy.
        """
        if not replicas or len(set(replicas)) != len(replicas):
            raise ValueError(f"replicas must be a non-empty list of distinct names, got {replicas}")
        if policy not in ("affinity", "round_robin"):
            raise ValueError(f"routing policy must be 'affinity' or 'round_robin', got {policy!r}")
        self.replicas, self.policy = list(replicas), policy
        self.dead: set[str] = set()
        self.in_flight: Counter = Counter()
        self.assigned: Counter = Counter()
        self._affinity: dict[str, str] = {}
        self._rr = itertools.cycle(self.replicas)
        self._lock = threading.Lock()
        self.sticky_hits = 0
        self.requests = 0
        self.busy_s: Counter = Counter()  # seconds each replica had at least one request in flight
        self._busy_since: dict[str, float] = {}

    @property
    def live(self) -> list[str]:
        """Replicas not marked dead, in configured order."""
        return [r for r in self.replicas if r not in self.dead]

    def pick(self, trajectory_id: str) -> str:
        """Replica for the next request of ``trajectory_id`` (does not count it in flight).

        Raises:
            NoLiveReplica: every replica is dead.
        """
        with self._lock:
            return self._pick(trajectory_id)

    def _pick(self, trajectory_id: str) -> str:
        live = self.live
        if not live:
            raise NoLiveReplica(f"all {len(self.replicas)} replicas are dead")
        self.requests += 1
        if self.policy == "round_robin":
            while (r := next(self._rr)) in self.dead:
                pass
            return r
        r = self._affinity.get(trajectory_id)
        if r is not None and r not in self.dead:
            self.sticky_hits += 1
            return r
        r = min(live, key=lambda x: (self.in_flight[x], self.assigned[x], self.replicas.index(x)))
        self._affinity[trajectory_id] = r
        self.assigned[r] += 1
        return r

    @contextmanager
    def route(self, trajectory_id: str) -> Iterator[str]:
        """Pick a replica and count the request in flight on it until the block exits."""
        with self._lock:
            r = self._pick(trajectory_id)
            self.in_flight[r] += 1
            if self.in_flight[r] == 1:
                self._busy_since[r] = time.monotonic()
        try:
            yield r
        finally:
            with self._lock:
                self.in_flight[r] -= 1
                if self.in_flight[r] == 0:
                    self.busy_s[r] += time.monotonic() - self._busy_since.pop(r)

    def busy_seconds(self) -> dict[str, float]:
        """Seconds each replica had a request in flight so far (idle time = wall time minus this)."""
        with self._lock:
            now = time.monotonic()
            return {r: self.busy_s[r] + (now - self._busy_since[r] if r in self._busy_since else 0.0)
                    for r in self.replicas}

    def finish(self, trajectory_id: str) -> None:
        """Forget a finished trajectory (its replica's assignment count drops)."""
        with self._lock:
            r = self._affinity.pop(trajectory_id, None)
            if r is not None:
                self.assigned[r] -= 1

    def mark_dead(self, replica: str) -> list[str]:
        """Take a replica out of rotation; returns the trajectories that were assigned to it."""
        with self._lock:
            self.dead.add(replica)
            lost = [t for t, r in self._affinity.items() if r == replica]
            for t in lost:
                del self._affinity[t]
            self.assigned[replica] = 0
            return lost

    def revive(self, replica: str) -> None:
        """Put a replica back in rotation (after a restart)."""
        with self._lock:
            self.dead.discard(replica)
