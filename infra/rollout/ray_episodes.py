"""The asynchronous collector's episodes on Ray actors: one :class:`EpisodeWorker` per node, its Docker engine.

The scheduler (:class:`~infra.rollout.scheduler.AsyncCollector`: ready bank, policy lag, retries,
deadlines, partial groups) stays in the flow's process; only the episodes move. :class:`RayEpisodeRunner`
is its :class:`~infra.rollout.scheduler.EpisodeRunner`: each ``run(job)`` is one call on the least busy
actor, the scheduler's worker thread waiting on it, and ``job.cancel`` is forwarded to the actor, whose
:class:`~infra.rollout.collector.Collector` checks it between turns as it does in-process.

Per-token policy versions stay exact across processes because the vLLM servers stamp them
(:mod:`infra.rollout.version_gate`): an update pauses the server for every client, and each response
names the weights it was sampled with. An actor that dies (its node lost) ends its episodes as
``infra_failure/episode_worker_lost``, retried by the scheduler on the actors left.

Placement: one actor on every live node that offers CPUs to the cluster (a head started with
``--num-cpus 0`` runs none); actors take no CPU of their own (episodes wait on engines and sandboxes),
so trainer ranks placed by CPU are not crowded out. Each actor starts a watchdog of its own
(:func:`infra.reaper.ensure_watchdog`), which removes its sandboxes when the actor's process ends.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from infra.rollout.scheduler import EpisodeJob

log = logging.getLogger(__name__)
WORKER_LOST = "episode_worker_lost"


class EpisodeWorker:
    """A Ray actor body: one node's episode runner (its Docker engine, warm pool, engine client)."""

    def __init__(self, config, servers: list[dict], policy_version: int,
                 shipped: dict[str, tuple[str, str]] | None, tokenizer) -> None:
        """Connect to the run's engines and this node's dockerd, load the shipped images it lacks.

        ``servers``: ``RemoteServer`` fields; their token in ``$AGENTRL_ENGINE_TOKEN`` (the actor's runtime env).
        ``tokenizer``: the flow's (shipped with the actor: a node needs no model folder).

        Raises:
            RuntimeError: a server does not stamp its samples' versions (``ServerEngine.require_version_gate``).
        """
        from infra.config import build_harness
        from infra.environments import BASE_IMAGE
        from infra.reaper import ensure_watchdog
        from infra.rollout.collector import Collector, CollectSettings
        from infra.rollout.engine_auth import TOKEN_ENV
        from infra.rollout.servers import RemoteServer, ServerEngine
        from infra.run import sandbox_backend

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        ensure_watchdog()  # no run's watchdog covers a process on another node
        token = os.environ.get(TOKEN_ENV)
        handles = RemoteServer.all_of(servers, token)
        self.engine = ServerEngine(handles, tokenizer, config.engine.routing, policy_version=policy_version,
                                   declare_version=False)
        self.engine.require_version_gate()
        self.backend = sandbox_backend(config)
        self.loaded: list[str] = []
        if shipped:
            from infra.sandbox.image_ship import ensure_images
            from infra.storage import s3_filesystem

            self.loaded = ensure_images(s3_filesystem(config.storage.bucket), self.backend.client, shipped)
        self.pool = None
        if config.rollout.warm_pool:
            from infra.sandbox.pool import WarmPool

            self.pool = WarmPool(self.backend, max_idle_per_image=config.rollout.warm_pool_max_idle)
        self.collector = Collector(self.engine, self.backend, CollectSettings.of(config.rollout), code_image=BASE_IMAGE,
                                   pool=self.pool, harness=build_harness(config.rollout.harness))
        self._cancels: dict[str, threading.Event] = {}
        self._cancelled_early: set[str] = set()
        self._lock = threading.Lock()

    def describe(self) -> dict:
        """``{"host", "pid", "docker_host", "images_loaded"}`` of this actor."""
        import socket

        return {"host": socket.gethostname(), "pid": os.getpid(), "docker_host": os.environ.get("DOCKER_HOST", ""),
                "images_loaded": self.loaded}

    def engine_counters(self) -> tuple[int, float]:
        """This actor's engine client: ``(tokens sampled, seconds with a request in flight)`` so far."""
        return self.engine.generated_tokens, self.engine.busy_s

    def bind(self, run_id: str, step: int, images: dict[str, tuple[str, str]]) -> None:
        """:meth:`Collector.bind` on this node."""
        self.collector.bind(run_id, step, images)

    def reserve_sandboxes(self, tasks: list) -> None:
        """:meth:`Collector.reserve_sandboxes` on this node's warm pool."""
        self.collector.reserve_sandboxes(tasks)

    def run(self, key: str, group_id: str, task, sample_index: int, attempt: int, seed: int,
            launch_index: int) -> dict:
        """Run one attempt (:meth:`Collector.run`); :meth:`cancel` with the same ``key`` stops it between turns."""
        job = EpisodeJob(group_id, task, sample_index, attempt, seed, launch_index)
        with self._lock:
            self._cancels[key] = job.cancel
            if key in self._cancelled_early:  # the cancel overtook this call (a threaded actor keeps no order)
                self._cancelled_early.discard(key)
                job.cancel.set()
        try:
            return self.collector.run(job)
        finally:
            with self._lock:
                self._cancels.pop(key, None)

    def cancel(self, key: str) -> bool:
        """Cancel the attempt ``key``; False when it is not running here yet (it is cancelled as it starts)."""
        with self._lock:
            event = self._cancels.get(key)
            if event is None:
                self._cancelled_early.add(key)
        if event is not None:
            event.set()
        return event is not None

    def close(self) -> None:
        """Stop the gateway, the warm pool's idle sandboxes and the engine client."""
        for what, fn in (("collector", self.collector.close), ("warm pool", getattr(self.pool, "close", None)),
                         ("engine client", self.engine.close)):
            if fn is None:
                continue
            try:
                fn()
            except Exception:  # noqa: BLE001 - closing the rest matters more
                log.exception("episode worker: closing the %s failed", what)


class RayEpisodeRunner:
    """The :class:`~infra.rollout.scheduler.EpisodeRunner` whose episodes run on :class:`EpisodeWorker` actors."""

    def __init__(self, config, servers: list[dict], token: str | None, policy_version: int,
                 shipped: dict[str, tuple[str, str]] | None, local, tokenizer=None, address: str = "",
                 max_concurrent_episodes: int = 16, start_timeout_s: float = 300.0, node_wait_s: float = 60.0,
                 worker_cls=EpisodeWorker) -> None:
        """Start one actor per node with CPUs on the Ray cluster at ``address`` (empty: a local instance).

        ``local``: a :class:`~infra.rollout.collector.Collector` of the flow's process, used only to build
        the rows of attempts the scheduler ended (:meth:`failed_row`). ``tokenizer``: the engines' (sent to the
        actors). ``token``: the engines' bearer token, handed to the actors in their runtime environment
        (Ray's state API shows those to whoever reaches the cluster; it is not stored with Prefect's parameters).
        ``worker_cls``: the actor body (:class:`EpisodeWorker`; another with its methods in unit tests).

        Raises:
            RuntimeError: the cluster has no live node with CPUs within ``node_wait_s``, or an actor did not
                start within ``start_timeout_s`` (its error).
        """
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from infra.rollout.engine_auth import TOKEN_ENV

        if not ray.is_initialized():
            local_opts = {} if address else {"include_dashboard": False, "object_store_memory": 256 * 1024**2}
            # "local": a new instance even when this machine runs a cluster (`ray start`), which ray.init() would join
            ray.init(address=address or "local", log_to_driver=False, **local_opts)
        deadline = time.monotonic() + node_wait_s
        while not (nodes := [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= 1]):
            if time.monotonic() > deadline:  # a node may still be joining: wait a little first
                raise RuntimeError(f"rollout.fan_out = \"ray\": the Ray cluster {address or '(local)'} has no live "
                                   f"node with CPUs to run episodes on (waited {node_wait_s:.0f} s)")
            time.sleep(1.0)
        runtime = {"env_vars": {TOKEN_ENV: token}} if token else None
        actor_cls = ray.remote(num_cpus=0, max_concurrency=max_concurrent_episodes + 8, max_restarts=0)(worker_cls)
        self.local, self._ray = local, ray
        self.actors = [actor_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
                                         runtime_env=runtime).remote(config, servers, policy_version, shipped,
                                                                     tokenizer)
                       for n in nodes]
        try:
            self.workers = ray.get([a.describe.remote() for a in self.actors], timeout=start_timeout_s)
        except Exception as e:
            self.close()
            raise RuntimeError(f"rollout.fan_out = \"ray\": an episode worker did not start: {type(e).__name__}: "
                               f"{e}") from e
        self._busy = [0] * len(self.actors)
        self._counters: list[tuple[int, float]] = [(0, 0.0)] * len(self.actors)
        self._lost: set[int] = set()
        self._closing = False
        self._lock = threading.Lock()
        self.counters = {"episodes": 0, "workers_lost": 0}
        log.info("episode workers: %s", self.workers)

    def engine_counters(self) -> list[tuple[int, float]]:
        """Per actor, its engine client's ``(tokens sampled, busy seconds)`` so far (a lost actor's last known).

        Differences of two calls give a batch's tokens (summed) and a lower bound of the engines' busy time
        (the longest of any actor's; exact with one node), as ``ServerEngine.generated_tokens``/``busy_s``.
        """
        ray, live = self._ray, self._live()
        refs = {i: self.actors[i].engine_counters.remote() for i in live}
        for i, ref in refs.items():
            try:
                self._counters[i] = tuple(ray.get(ref, timeout=30))
            except Exception as e:  # noqa: BLE001 - lost or stuck: its last figures stand
                log.warning("episode worker %s: no engine counters: %s", self.workers[i], e)
        return list(self._counters)

    def bind(self, run_id: str, step: int, images: dict[str, tuple[str, str]]) -> None:
        """Bind every live actor and the local rows' collector (:meth:`Collector.bind`)."""
        self.local.bind(run_id, step, images)
        self._each(lambda a: a.bind.remote(run_id, step, images))

    def reserve_sandboxes(self, tasks: list) -> None:
        """Share the sandbox demand over the live actors' warm pools (tasks dealt in turn)."""
        live = self._live()
        if live:
            parts = {i: tasks[k::len(live)] for k, i in enumerate(live)}
            self._each(lambda a, i: a.reserve_sandboxes.remote(parts[i]), with_index=True)

    def run(self, job: EpisodeJob) -> dict:
        """Run ``job`` on the least busy live actor and return its row (see the module docstring)."""
        ray = self._ray
        with self._lock:
            live = self._live()
            if not live:
                return self.failed_row(job, WORKER_LOST)
            i = min(live, key=lambda k: self._busy[k])
            self._busy[i] += 1
            self.counters["episodes"] += 1
        actor, key = self.actors[i], f"{job.group_id}/{job.sample_index}/{job.attempt}/{id(job)}"
        try:
            ref = actor.run.remote(key, job.group_id, job.task, job.sample_index, job.attempt, job.seed,
                                   job.launch_index)
            cancelled = False
            while True:
                ready, _ = ray.wait([ref], timeout=0.25)
                if ready:
                    return ray.get(ref)
                if job.cancel.is_set() and not cancelled:
                    actor.cancel.remote(key)
                    cancelled = True
        except ray.exceptions.ActorUnavailableError as e:  # transient (a network blip): the actor is kept
            log.warning("episode worker %s unreachable running %s: %s", self.workers[i], key, e)
            return self.failed_row(job, WORKER_LOST)
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as e:
            if self._closing:  # ended by close(): not a lost node
                return self.failed_row(job, "cancelled")
            self._mark_lost(i, f"running {key}: {e}")
            return self.failed_row(job, WORKER_LOST)
        finally:
            with self._lock:
                self._busy[i] -= 1

    def failed_row(self, job: EpisodeJob, reason: str) -> dict:
        """The row of an attempt the scheduler ended, or whose actor was lost (built in this process)."""
        return self.local.failed_row(job, reason)

    def close(self, timeout_s: float = 30.0) -> None:
        """Close every actor (bounded wait), then end them. The Ray connection stays (trainer ranks may share it)."""
        ray = self._ray
        self._closing = True
        try:
            ray.wait([a.close.remote() for a in self.actors], num_returns=len(self.actors), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a lost actor cannot close; it is killed below either way
            log.exception("episode workers: close failed")
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001
                log.exception("episode workers: kill failed")
        self.local.close()

    def _live(self) -> list[int]:
        return [i for i in range(len(self.actors)) if i not in self._lost]

    def _each(self, call, with_index: bool = False, timeout_s: float = 300.0) -> None:
        """Call every live actor, wait for all; an actor that died meanwhile is marked lost."""
        ray = self._ray
        live = self._live()
        refs = [(i, call(self.actors[i], i) if with_index else call(self.actors[i])) for i in live]
        deadline = time.monotonic() + timeout_s
        for i, ref in refs:
            try:
                ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                    ray.exceptions.GetTimeoutError) as e:  # dead, or stuck past the timeout: no more episodes there
                self._mark_lost(i, f"{type(e).__name__}: {e}")

    def _mark_lost(self, i: int, why: str) -> None:
        with self._lock:
            if i in self._lost:
                return
            self._lost.add(i)
            self.counters["workers_lost"] += 1
        log.warning("episode worker %s lost (%s); %d left", self.workers[i], why, len(self._live()))
