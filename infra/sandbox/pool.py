"""Warm sandbox pool: started containers kept ready per image, sized to demand, plus snapshots.

``acquire`` hands out an idle, already started sandbox of the right image and limits when one is
ready (a warm acquire: one liveness check), else starts one (a cold acquire: container create,
start and the first exec). After every acquire the pool tops itself back up to the demand last
declared for that image (``ensure``), in background threads bounded by ``max_parallel_starts``,
so the next episode finds a container ready. A warm container is used by one episode only: it is
never returned to the pool. Its persistent shell (``run_in_shell``) is started lazily by the first
agent command, so it is the episode's own: never started ahead, never shared with another episode.

Snapshots: for a task whose environment needs an expensive set-up command at run time,
``snapshot(image, setup_command)`` runs it once in a sandbox and commits the result
(``docker commit``, cached by image digest and command); attempts then start from the snapshot.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor

import docker.errors

from infra.sandbox.base import SandboxInfraError
from infra.sandbox.docker_backend import DockerBackend, DockerSandbox

PoolKey = tuple[str, float | None, int | None, bool, int | None]


class WarmPool:
    """Per-(image, limits) queues of started sandboxes over a :class:`DockerBackend`."""

    def __init__(self, backend: DockerBackend, max_idle_per_image: int = 16, max_parallel_starts: int = 2):
        """Create an empty pool.

        Args:
            backend: the Docker backend that starts containers.
            max_idle_per_image: cap on ready containers per key, whatever the demand.
            max_parallel_starts: background starts at once (they share the CPU with the engine).
        """
        self.backend = backend
        self.max_idle = max_idle_per_image
        self._idle: dict[PoolKey, deque[DockerSandbox]] = defaultdict(deque)
        self._target: dict[PoolKey, int] = {}
        self._pending: dict[PoolKey, int] = defaultdict(int)
        self._lock = threading.Lock()
        self._starter = ThreadPoolExecutor(max_workers=max_parallel_starts, thread_name_prefix="warm-pool")
        self._closed = False
        self.stats = {"warm": 0, "cold": 0, "stale": 0, "start_failures": 0}

    @staticmethod
    def _key(image: str, cpus: float | None, memory_mb: int | None, network: bool,
             disk_mb: int | None = None, egress_hosts: tuple[str, ...] | None = None) -> PoolKey:
        return (image, cpus, memory_mb, network, disk_mb, egress_hosts)

    def ensure(self, image: str, n: int, cpus: float | None = None, memory_mb: int | None = None,
               network: bool = False, disk_mb: int | None = None, services=None,
               egress_hosts: tuple[str, ...] | None = None) -> None:
        """Declare demand: keep ``n`` (capped at ``max_idle_per_image``) ready sandboxes of this kind.

        A multi-service task's (``services``) is not kept warm: each start is a compose project.
        """
        if services is not None:
            return
        key = self._key(image, cpus, memory_mb, network, disk_mb, egress_hosts)
        with self._lock:
            self._target[key] = min(n, self.max_idle)
        self._refill(key)

    def _refill(self, key: PoolKey) -> None:
        with self._lock:
            if self._closed:
                return
            missing = self._target.get(key, 0) - len(self._idle[key]) - self._pending[key]
            self._pending[key] += max(0, missing)
        for _ in range(max(0, missing)):
            self._starter.submit(self._start_one, key)

    def _start_one(self, key: PoolKey) -> None:
        image, cpus, memory_mb, network, disk_mb, egress_hosts = key
        try:
            box = self.backend.start(image, {"agentrl.pool": "warm"}, cpus=cpus, memory_mb=memory_mb,
                                     network=network, disk_mb=disk_mb, egress_hosts=egress_hosts)
        except SandboxInfraError:
            with self._lock:
                self._pending[key] -= 1
                self.stats["start_failures"] += 1
            return
        with self._lock:
            self._pending[key] -= 1
            if self._closed:
                box.close()
                return
            self._idle[key].append(box)

    def acquire(self, image: str, labels: dict[str, str] | None = None, cpus: float | None = None,
                memory_mb: int | None = None, network: bool = False,
                disk_mb: int | None = None, services=None,
                egress_hosts: tuple[str, ...] | None = None) -> tuple[DockerSandbox, bool]:
        """A started sandbox of ``image`` with these limits (a multi-service task's: always a cold start).

        Returns:
            (sandbox, warm): ``warm`` True when it came from the pool.

        Raises:
            SandboxInfraError: a cold start failed (``sandbox_start_failed``).
        """
        if services is not None:
            box = self.backend.start(image, {"agentrl.pool": "cold", **(labels or {})}, cpus=cpus,
                                     memory_mb=memory_mb, network=network, disk_mb=disk_mb, services=services)
            with self._lock:
                self.stats["cold"] += 1
            return box, False
        key = self._key(image, cpus, memory_mb, network, disk_mb, egress_hosts)
        box = None
        while True:
            with self._lock:
                box = self._idle[key].popleft() if self._idle[key] else None
            if box is None:
                break
            try:
                if box.alive():
                    break
            except SandboxInfraError:
                pass
            with self._lock:
                self.stats["stale"] += 1  # died while idle (dockerd restart, OOM): never handed out
            box.close()
        warm = box is not None
        if box is None:
            box = self.backend.start(image, {"agentrl.pool": "cold", **(labels or {})}, cpus=cpus,
                                     memory_mb=memory_mb, network=network, disk_mb=disk_mb, egress_hosts=egress_hosts)
        with self._lock:
            self.stats["warm" if warm else "cold"] += 1
        self._refill(key)
        return box, warm

    def idle(self, image: str, cpus: float | None = None, memory_mb: int | None = None,
             network: bool = False) -> int:
        """Ready sandboxes of this kind now."""
        with self._lock:
            return len(self._idle[self._key(image, cpus, memory_mb, network)])

    def wait_ready(self, timeout_s: float = 60.0) -> bool:
        """Block until every declared demand is met (or ``timeout_s``); True when met."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if all(len(self._idle[k]) >= t for k, t in self._target.items()):
                    return True
            time.sleep(0.05)
        return False

    def snapshot(self, image: str, setup_command: str, timeout_s: float = 600.0) -> str:
        """An image holding ``image`` after ``setup_command`` ran (committed once, then reused).

        Returns:
            The snapshot's ``repository:tag`` (tag: hash of the image digest and the command).

        Raises:
            SandboxInfraError: the set-up sandbox failed, or the command exited non-zero or timed out.
        """
        digest = self.backend.image_digest(image)
        tag = hashlib.sha256(f"{digest}\0{setup_command}".encode()).hexdigest()[:16]
        repository = "agentrl-snapshot-" + image.split(":")[0].replace("/", "-")
        ref = f"{repository}:{tag}"
        try:
            self.backend.image_digest(ref)
            return ref
        except docker.errors.ImageNotFound:
            pass
        box = self.backend.start(image, {"agentrl.pool": "snapshot"})
        try:
            r = box.exec(setup_command, timeout_s=timeout_s)
            if r.exit_code != 0:
                raise SandboxInfraError("snapshot_setup_failed",
                                        f"{image}: set-up exited {r.exit_code}: {r.output[-500:]}")
            return self.backend.snapshot(box, repository, tag)
        finally:
            box.close()

    def close(self) -> None:
        """Stop background starts and remove every idle sandbox."""
        with self._lock:
            self._closed = True
            boxes = [b for q in self._idle.values() for b in q]
            self._idle.clear()
        self._starter.shutdown(wait=True, cancel_futures=True)
        # In parallel (one removal can take seconds on the btrfs data root), on plain threads: this also runs
        # at interpreter exit (atexit), where concurrent.futures refuses new work.
        for i in range(0, len(boxes), 8):
            threads = [threading.Thread(target=b.close, name="pool-close") for b in boxes[i:i + 8]]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
