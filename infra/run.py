"""The run as an object: the composition root of one post-training run in this process.

``with Run.open(config) as run:`` checks the run's inputs once (:func:`infra.preflight.preflight`)
and connects to storage; what the stages share is built on first use: the sandbox backend, the
warm pool, the rollout engine (in-process vLLM or vLLM servers, by the type of ``config.engine``),
the trainer and the asynchronous collector. Leaving the block closes every one of them, also when
the flow fails (and at process exit if the block was never left). The run owns the served
:class:`Policy`; :meth:`Run.serve` is its one writer and the one path by which weights reach the
engine during a run. No Prefect here.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import assert_never

from envs.task import Task
from infra.config import AsyncScheduler, InprocEngine, RemoteEngine, RunConfig, ServersEngine
from infra.environments import BASE_IMAGE, Catalog, load_run_tasks
from infra.layout import TRAINER_STATE_COMPLETE, RunLayout, resolve_path
from infra.lineage import ModelAsset
from infra.preflight import preflight

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Policy:
    """The policy the engine serves: its ``version`` and a local HF folder with exactly its weights.

    ``weights_dir`` is ``""`` when the weights reached the engine without one (from the trainer's
    memory, or pulled by remote servers).
    """

    version: int
    weights_dir: str


class Run:
    """Live resources of one run in this process; build with :meth:`open`, close with ``with`` or :meth:`close`."""

    def __init__(self, config: RunConfig, fs) -> None:
        """Wrap ``config`` and an S3 filesystem; nothing is started but the process's watchdog (``infra.reaper``)."""
        from infra.reaper import ensure_watchdog

        ensure_watchdog()  # whatever this process starts is removed when it dies, SIGKILL included
        self.config = config
        self.layout = RunLayout(config.storage.bucket, config.storage.prefix, config.run_id)
        self.fs = fs
        self._policy = Policy(0, "")
        self._backend = None
        self._pool = None
        self._engine = None
        self._trainer = None
        self._ray_ranks = None  # ranks 1.. as Ray actors (train.launch = "ray")
        self._collector = None
        self._episode_workers = None  # the collector's episodes on Ray actors (rollout.fan_out = "ray", async)
        self._tasks: dict[str, Task] | None = None
        self._catalog: Catalog | None = None
        self._trainer_state: tuple[Path, str] | None = None  # (folder, tag) to restore when the trainer starts
        self.trainer_restored = ""  # the tag restored, if any
        self._base_model: ModelAsset | None = None
        self.resumed_version = 0  # the newest published version when this process resumed the run (resume())
        atexit.register(self.close)  # a process that never leaves the block still removes its sandboxes

    @classmethod
    def open(cls, config: RunConfig, *, docker: bool = True, model: bool = True, tasks: bool = True) -> Run:
        """Check the run's inputs (keywords as :func:`infra.preflight.preflight`), then connect storage.

        Raises:
            RunInputError: an input cannot be used (named in the message); nothing was written.
        """
        return cls(config, preflight(config, docker=docker, model=model, tasks=tasks))

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the policy ---------------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        """The policy served now."""
        return self._policy

    def serve(self, policy: Policy, apply: Callable[[], float]) -> float:
        """Make ``policy`` the served one; returns the apply pause in s.

        ``apply()`` puts its weights into the engine (stamping ``policy.version`` on the tokens it
        samples from then on) and returns its pause. With the asynchronous collector running, its
        ``update_policy`` (finish, pause or abort in-flight episodes) governs the switch.
        """
        if self._collector is None:
            pause = apply()
        else:
            pauses: list[float] = []
            self._collector.update_weights(lambda: pauses.append(apply()), policy.version)
            pause = pauses[0]
        self._policy = policy
        return pause

    def serve_folder(self, policy: Policy) -> float:
        """Serve ``policy`` from its local HF folder (:meth:`serve` with the engine's ``load_weights``).

        Remote servers (``engine.kind = "remote"``) cannot read this machine's folders: they fetch the
        run's published checkpoint of that version from S3 instead (:meth:`stage_published`).

        Raises:
            CheckpointError: remote servers, and ``policy`` is not a published checkpoint (the base model).
        """
        if isinstance(self.config.engine, RemoteEngine):
            if policy.version == 0:
                from infra.checkpoint import CheckpointError

                raise CheckpointError(f"run {self.config.run_id}: remote servers cannot load the base model from "
                                      "this machine; they serve it when started from model.path")
            _, apply = self.stage_published(self.layout.checkpoint(policy.version))
            return self.serve(Policy(policy.version, ""), apply)
        return self.serve(policy, lambda: self.engine.load_weights(policy.weights_dir, policy.version))

    def stage_published(self, uri: str) -> tuple[float, Callable[[], float]]:
        """Have the engine's servers fetch checkpoint ``uri`` from S3 themselves and verify it, while serving.

        Each server gets presigned GET URLs (on ``publish.endpoint`` when set, the S3 endpoint as the
        servers reach it), so no shared filesystem and no S3 keys are needed on the engine machines.

        Returns:
            ``(transfer_s, apply)``: the seconds the fetch took, and a callable that drains, applies the
            staged version on every live server and returns the apply pause (for :meth:`serve`).

        Raises:
            CheckpointError: no complete manifest, or a server could not fetch or verify a file (nothing applied).
        """
        version, files, urls = self.presigned_checkpoint(uri)
        transfer_s = self.engine.stage_direct(uri, files, version, urls=urls)
        return transfer_s, lambda: self.engine.apply_staged(version)

    def presigned_checkpoint(self, uri: str) -> tuple[int, dict[str, dict], dict[str, str]]:
        """Checkpoint ``uri``'s version, manifest ``files`` and presigned GET URLs (on ``publish.endpoint``).

        Raises:
            CheckpointError: no complete manifest.
        """
        from infra.checkpoint import presigned_urls, read_manifest

        manifest = read_manifest(self.fs, uri)
        files = manifest["files"]
        urls = presigned_urls(self.fs, uri, files, endpoint=getattr(self.config.publish, "endpoint", ""))
        return int(manifest["version"]), files, urls

    def serve_published(self, version: int | None = None) -> Policy:
        """Serve checkpoint ``version`` of the run (default: the newest; ``model.path`` when none is published).

        The checkpoint is fetched into the run's work folder and verified against its manifest; an
        engine already running loads it (under the update policy), otherwise it starts from it.

        Raises:
            ValueError: ``version`` is not published.
            CheckpointError: the checkpoint fails verification (nothing is served from it).
        """
        from infra.checkpoint import fetch, published_versions
        from infra.model import resolve_model

        versions = published_versions(self.fs, self.layout)
        if version is not None and version not in versions:
            raise ValueError(f"run {self.config.run_id}: checkpoint version {version} not published (have {versions})")
        if versions:
            version = versions[-1] if version is None else version
            local = self.layout.work / f"v{version}"
            shutil.rmtree(local, ignore_errors=True)
            fetch(self.fs, self.layout.checkpoint(version), local)
            policy = Policy(version, str(local))
        else:
            policy = Policy(0, str(resolve_model(self.config.model.path)))
        if self._engine is not None and self._engine.policy_version != policy.version:
            self.serve_folder(policy)
        else:  # no engine yet (it starts from this folder), or it serves these weights already
            self.serve(policy, lambda: 0.0)
        return policy

    def resume(self) -> int:
        """Serve the run's newest published checkpoint (:meth:`serve_published`); returns the next step.

        Step ``s`` is committed when ``v{s+1}`` has a complete manifest, so the next step is the number of
        published versions. A trainer state saved with that version on this machine (or, with
        ``train.state_storage = "s3"``, on S3) is restored when the trainer starts (``train.save_optimizer_state``).
        """
        policy = self.serve_published()
        self.resumed_version = policy.version
        state = self.trainer_state_dir / f"v{policy.version}"
        if policy.version and self._trainer is None and self.config.train.save_optimizer_state:
            if not state.is_dir() and self.config.train.state_storage == "s3":
                self._fetch_trainer_state(policy.version, state)
            if state.is_dir():
                self._trainer_state = (state.parent, state.name)
        return policy.version

    def _fetch_trainer_state(self, version: int, local: Path) -> None:
        """Download the complete trainer state ``v{version}`` from S3 into ``local`` (absent or partial: nothing)."""
        uri = self.layout.trainer_state(version)
        if not self.fs.exists(f"{uri}/{TRAINER_STATE_COMPLETE}"):
            log.info("no complete trainer state v%d on S3 (%s); the optimizer starts fresh", version, uri)
            return
        partial = local.with_name(local.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        for path in self.fs.find(uri):
            rel = path.split(uri.removeprefix("s3://").rstrip("/") + "/", 1)[1]
            if rel != TRAINER_STATE_COMPLETE:
                (partial / rel).parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(path, str(partial / rel))
        partial.rename(local)
        log.info("trainer state v%d fetched from %s", version, uri)

    @property
    def base_model(self) -> ModelAsset:
        """The weights of the run's version 0 as an asset (:func:`infra.lineage.model_asset`).

        For ``model.path`` = a checkpoint of another run (``s3://…/checkpoints/vN``) it is that checkpoint,
        so the lineage crosses runs. Computed once (a digest of the weight files).
        """
        if self._base_model is None:
            from infra.lineage import model_asset
            from infra.model import resolve_model

            path = self.config.model.path
            if path.startswith("s3://"):
                self._base_model = ModelAsset(path.rstrip("/"), {"kind": "checkpoint"})
            else:
                self._base_model = model_asset(resolve_model(path), name=Path(path).name)
        return self._base_model

    def policy_asset(self, version: int) -> str:
        """The asset key of the weights of policy ``version``: checkpoint ``v{version}``, or the base model for 0."""
        return self.layout.checkpoint(version) if version > 0 else self.base_model.key

    # -- live resources, built on first use ---------------------------------------------------
    @property
    def backend(self):
        """The Docker sandbox backend (connects on first use; removes containers of crashed runs)."""
        if self._backend is None:
            self._backend = sandbox_backend(self.config)
            reaped = self._backend.reap_orphans()
            if reaped:
                log.warning("removed %d sandbox containers left by crashed runs", reaped)
        return self._backend

    @property
    def pool(self):
        """The warm sandbox pool (None when ``rollout.warm_pool`` is off)."""
        if self._pool is None and self.config.rollout.warm_pool:
            from infra.sandbox.pool import WarmPool

            self._pool = WarmPool(self.backend, max_idle_per_image=self.config.rollout.warm_pool_max_idle)
        return self._pool

    @property
    def engine(self):
        """The rollout engine, serving :attr:`policy` in ``model.serving_dtype``."""
        return self.engine_in(self.config.model.serving_dtype)

    @property
    def engine_started(self) -> bool:
        """Whether the engine runs (evaluation loads a version into it rather than starting one)."""
        return self._engine is not None

    def engine_in(self, dtype: str):
        """The engine; started in ``dtype`` if none runs yet (an engine already running keeps its dtype).

        Raises:
            RuntimeError: no local folder holds the served policy's weights to start from.
        """
        if self._engine is None:
            m, seed = self.config.model, self.config.rollout.seed
            if not self._policy.weights_dir:
                raise RuntimeError(f"run {self.config.run_id}: no weights folder to start the engine from "
                                   "(call resume() first)")
            match self.config.engine:
                case ServersEngine() as e:
                    from transformers import AutoTokenizer

                    from infra.rollout.servers import ServerEngine, start_servers

                    servers = start_servers(self._policy.weights_dir, e.count, self.layout.work / "vllm-logs",
                                            dtype=dtype, max_model_len=m.max_model_len, kv_cache_gib=m.kv_cache_gib,
                                            seed=seed, threads=e.threads, host=e.host,
                                            advertise=e.advertise or None, policy_version=self._policy.version)
                    self._engine = ServerEngine(servers, AutoTokenizer.from_pretrained(self._policy.weights_dir),
                                                e.routing, policy_version=self._policy.version, owns_servers=True)
                case RemoteEngine() as e:
                    from transformers import AutoTokenizer

                    from infra.rollout.servers import ServerEngine, connect_remote

                    handles = connect_remote(e.urls, os.environ.get(e.token_env, ""), dtype, e.token_env)
                    self._engine = ServerEngine(handles, AutoTokenizer.from_pretrained(self._policy.weights_dir),
                                                e.routing, policy_version=0)
                    if self._policy.version:  # a resumed run: the servers started from model.path
                        _, apply = self.stage_published(self.layout.checkpoint(self._policy.version))
                        apply()
                case InprocEngine() as e:
                    from infra.rollout.engine import VLLMEngine

                    self._engine = VLLMEngine(self._policy.weights_dir, dtype=dtype, max_model_len=m.max_model_len,
                                              kv_cache_gib=m.kv_cache_gib, seed=seed,
                                              policy_version=self._policy.version, threads=e.threads,
                                              realtime_priority=e.realtime_priority)
                case other:
                    assert_never(other)
        return self._engine

    @property
    def trainer_state_dir(self) -> Path:
        """Local folder of the run's saved trainer states."""
        return self.layout.work / "trainer-state"

    @property
    def trainer(self):
        """The DeepSpeed GRPO trainer, started from the policy served when it is first used."""
        if self._trainer is None:
            from infra.train.trainer import GRPOTrainer

            t = self.config.train
            if t.world_size > 1 and t.launch == "ray":
                from infra.train.ranks import RayRanks

                self._ray_ranks = RayRanks(t.world_size, t.master, t.ranks_timeout_s, t.ray_address)
            self._trainer = GRPOTrainer(self._policy.weights_dir, lr=t.lr, zero_stage=t.zero_stage,
                                        grad_clip=t.grad_clip, micro_batch_rows=t.micro_batch_rows,
                                        tis_cap=t.tis_cap, temperature=self.config.rollout.temperature,
                                        top_p=self.config.rollout.top_p, top_k=self.config.rollout.top_k,
                                        scale_by_std=t.scale_by_std, mask_truncated=t.mask_truncated,
                                        max_seq_len=t.max_seq_len, tis_level=t.tis_level,
                                        mask_ratio_low=t.mask_ratio_low, mask_ratio_high=t.mask_ratio_high,
                                        forward_dtype=t.forward_dtype, baseline=t.baseline,
                                        divergence_threshold=t.divergence_threshold,
                                        divergence_estimator=t.divergence_estimator,
                                        divergence_action=t.divergence_action, world_size=t.world_size,
                                        master=t.master, ranks_timeout_s=t.ranks_timeout_s)
            if self._trainer_state:  # a resumed run: weights and AdamW moments as they were after that step
                folder, tag = self._trainer_state
                try:
                    self._trainer.load_state(folder, tag)
                    self.trainer_restored = tag
                    log.info("trainer state %s restored from %s", tag, folder)
                except Exception as e:  # e.g. saved with another zero_stage: weights stay the checkpoint's
                    log.warning("trainer state %s in %s not restored (%s: %s); the optimizer starts fresh",
                                tag, folder, type(e).__name__, e)
        return self._trainer

    def episode_runner(self, settings=None):
        """A :class:`~infra.rollout.collector.Collector` on the run's engine, backend and pool.

        ``settings``: a ``CollectSettings`` (default: the rollout config's).
        """
        from infra.config import build_harness
        from infra.rollout.collector import Collector

        return Collector(self.engine, self.backend, settings or self.collect_settings(), code_image=BASE_IMAGE,
                         pool=self.pool, harness=build_harness(self.config.rollout.harness))

    def collect_settings(self):
        """The rollout config's ``CollectSettings``."""
        from infra.rollout.collector import CollectSettings

        return CollectSettings.of(self.config.rollout)

    @property
    def collector(self):
        """The asynchronous collector (one per run; groups carry across steps in it).

        Raises:
            RuntimeError: ``rollout.scheduler`` is not ``kind = "async"``.
        """
        if self._collector is None:
            from infra.rollout.scheduler import AsyncCollector

            r, s = self.config.rollout, self.config.rollout.scheduler
            if not isinstance(s, AsyncScheduler):
                raise RuntimeError(f"run {self.config.run_id}: rollout.scheduler.kind = {s.kind!r} has no "
                                   "asynchronous collector")
            runner = self.episode_runner() if r.fan_out == "local" else self._ray_episode_runner()
            self._collector = AsyncCollector(
                runner, group_size=r.group_size,
                max_groups_in_flight=math.ceil(r.tasks_per_step * s.overprovision),
                max_concurrent_episodes=s.max_concurrent_episodes, max_policy_lag=s.max_policy_lag,
                episode_deadline_s=s.episode_deadline_s, infra_policy=s.infra_policy,
                max_infra_retries=r.max_infra_retries, update_policy=s.update_policy, prefetch=s.prefetch,
                policy_version=self._policy.version, seed=r.seed, retry_backoff_s=s.retry_backoff_s,
                dynamic_sampling=s.dynamic_sampling, max_extra_groups=s.max_extra_groups,
                max_mean_token_lag=s.max_mean_token_lag, partial_group_min_samples=s.partial_group_min_samples)
        return self._collector

    def ray_handoff(self) -> tuple[list[dict], str | None, dict[str, tuple[str, str]]]:
        """What Ray workers on other nodes need: ``(servers, token, shipped)``.

        ``servers``: the run's engines as ``RemoteServer`` fields without their token (the servers start here on
        first use); ``token``: theirs (one per run), for the workers' environment, never a parameter Prefect or Ray
        stores; ``shipped``: the task images and the base image staged on S3 by image id
        (``infra.sandbox.image_ship.stage_images``), for a node whose engine lacks one.
        """
        from infra.rollout.servers import RemoteServer
        from infra.sandbox.image_ship import stage_images

        handles = [s if isinstance(s, RemoteServer) else RemoteServer.of(s) for s in self.engine.servers.values()]
        token = next((h.token for h in handles if h.token), None)  # one per run: every server has it
        shipped = stage_images(self.fs, self.backend.client,
                               {tag for tag, _ in self.catalog.images().values()} | {BASE_IMAGE},
                               self.layout.images_dir)
        return [{**vars(h), "token": None} for h in handles], token, shipped

    def _ray_episode_runner(self):
        """Episode workers on the Ray cluster (``infra.rollout.ray_episodes``)."""
        from infra.rollout.ray_episodes import RayEpisodeRunner

        servers, token, shipped = self.ray_handoff()
        self._episode_workers = RayEpisodeRunner(
            self.config, servers, token, self._policy.version, shipped, self.episode_runner(), self.engine.tokenizer,
            self.config.rollout.ray_address,
            max_concurrent_episodes=self.config.rollout.scheduler.max_concurrent_episodes)
        return self._episode_workers

    # -- tasks and the catalog -----------------------------------------------------------------
    @property
    def tasks(self) -> dict[str, Task]:
        """Every task the config names, by id (loaded once)."""
        if self._tasks is None:
            self._tasks, _, _ = load_run_tasks(self.config.tasks)
        return self._tasks

    @property
    def catalog(self) -> Catalog:
        """The run's stored catalog (``envs.json``, read once).

        Raises:
            FileNotFoundError: the run has no catalog yet (run ``build_envs`` first).
        """
        if self._catalog is None:
            self.fs.invalidate_cache()
            self._catalog = Catalog.from_json(json.loads(self.fs.cat_file(self.layout.catalog)), self.layout.catalog)
        return self._catalog

    def store_catalog(self, catalog: Catalog) -> str:
        """Write ``envs.json`` and make it this run's catalog; returns its URI."""
        self.fs.pipe_file(self.layout.catalog, json.dumps(catalog.to_json(), indent=1).encode())
        self._catalog = catalog
        return self.layout.catalog

    # -- the end -------------------------------------------------------------------------------
    def close(self) -> None:
        """Close what was started: collector, engine, trainer, idle warm sandboxes, egress proxy. Idempotent."""
        atexit.unregister(self.close)
        collector, self._collector = self._collector, None
        workers, self._episode_workers = self._episode_workers, None
        engine, self._engine = self._engine, None
        trainer, self._trainer = self._trainer, None
        ranks, self._ray_ranks = self._ray_ranks, None
        pool, self._pool = self._pool, None
        egress = self._backend.egress if self._backend is not None else None
        for what, thing in (("collector", collector), ("episode workers", workers), ("engine", engine),
                            ("trainer", trainer),
                            ("trainer ranks", ranks), ("warm pool", pool), ("egress proxy", egress)):
            if thing is None:
                continue
            try:
                thing.close()
            except Exception:  # noqa: BLE001 - closing the rest matters more than this one's error
                log.exception("run %s: closing the %s failed", self.config.run_id, what)


def sandbox_backend(config: RunConfig):
    """A Docker sandbox backend with the run's limits, CA bundle, egress proxy and agent mounts.

    On this process's engine (``DOCKER_HOST`` or the local socket): the run's, or a Ray node's episode worker's.
    """
    from infra.config import build_harness
    from infra.sandbox.docker_backend import DockerBackend

    t = config.tasks
    egress = None
    if t.egress.enabled:
        from infra.egress.proxy import EGRESS_GATEWAY, EgressProxy

        egress = EgressProxy(EGRESS_GATEWAY, t.egress.settings())  # started on its first session
    harness = build_harness(config.rollout.harness)
    installed = getattr(harness, "gateway_channel", False)  # an agent that runs inside the sandbox
    return DockerBackend(
        mem_limit=f"{t.default_memory_mb}m" if t.default_memory_mb else None,
        nano_cpus=int(t.default_cpus * 1e9) or None,
        ca_bundle=resolve_path(t.extra_ca_bundle) if t.extra_ca_bundle else None, egress=egress,
        agent_mounts=harness.mounts() if installed else None, agent_channel=installed)
