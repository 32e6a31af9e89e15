"""Process-wide live resources of a run: storage, Docker backend, task catalog, engine, trainer.

Prefect tasks pass URIs between them; the heavy objects that must live across stages (the vLLM
engine holding the policy, the DeepSpeed engine holding the optimizer state) stay here, one set
per run id, created on first use.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from envs.task import Task
from infra.config import RunConfig

_RUNTIMES: dict[str, Runtime] = {}


def repo_root() -> Path:
    """The project's root folder (relative config paths resolve against it)."""
    return Path(__file__).resolve().parent.parent


def work_dir(run_id: str) -> Path:
    """Local scratch for a run (exported and fetched checkpoints): ``$AGENTRL_STATE/work/{run_id}``."""
    state = Path(os.environ.get("AGENTRL_STATE", repo_root() / ".state"))
    path = state / "work" / run_id
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_uri(config: RunConfig) -> str:
    """``s3://bucket/prefix/run_id``."""
    return f"s3://{config.storage.bucket}/{config.storage.prefix}/{config.run_id}"


@dataclass
class Runtime:
    """Live resources of one run in this process."""

    config: RunConfig
    fs: object
    policy_dir: str = ""
    policy_version: int = 0
    tasks: dict[str, Task] = field(default_factory=dict)
    catalog: dict = field(default_factory=dict)
    _backend: object = None
    _sandbox_pool: object = None
    _engine: object = None
    _trainer: object = None
    _scheduler: object = None
    _owns_servers: bool = False
    trainer_state: tuple = ()  # (folder, tag) of a saved trainer state to restore when the trainer starts
    trainer_restored: str = ""  # the tag restored, if any

    @property
    def backend(self):
        """The Docker sandbox backend (connects on first use)."""
        if self._backend is None:
            from infra.sandbox.docker_backend import DockerBackend

            self._backend = DockerBackend()
            reaped = self._backend.reap_orphans()
            if reaped:
                logging.getLogger(__name__).warning("removed %d sandbox containers left by crashed runs", reaped)
        return self._backend

    @property
    def sandbox_pool(self):
        """The warm sandbox pool (None when ``rollout.warm_pool`` is off)."""
        if self._sandbox_pool is None and self.config.rollout.warm_pool:
            from infra.sandbox.pool import WarmPool

            self._sandbox_pool = WarmPool(self.backend, max_idle_per_image=self.config.rollout.warm_pool_max_idle)
            # idle warm sandboxes die with the process (the CLI, a deployment's run): without this they ran on
            # until the next run's reaper removed them (16 after every quickstart)
            atexit.register(self._sandbox_pool.close)
        return self._sandbox_pool

    @property
    def engine(self):
        """The vLLM rollout engine serving ``policy_dir`` at ``policy_version``, in ``model.serving_dtype``."""
        return self.engine_in(self.config.model.serving_dtype)

    def engine_in(self, dtype: str):
        """The engine; started in ``dtype`` if none runs yet (an evaluation in a non-serving precision).

        An engine already running keeps its dtype: callers compare ``engine.dtype`` with what they need.
        """
        if self._engine is None:
            m, r = self.config.model, self.config.rollout
            if r.engine == "servers":
                from transformers import AutoTokenizer

                from infra.rollout.servers import ServerEngine, start_servers

                servers = start_servers(self.policy_dir, r.servers, work_dir(self.config.run_id) / "vllm-logs",
                                        dtype=dtype, max_model_len=m.max_model_len, kv_cache_gib=m.kv_cache_gib,
                                        seed=r.seed, threads=r.server_threads)
                self._engine = ServerEngine(servers, AutoTokenizer.from_pretrained(self.policy_dir), r.routing,
                                            policy_version=self.policy_version)
                self._owns_servers = True
                atexit.register(self._engine.close, stop_servers=True)  # the CLI's process ends: stop them
            else:
                from infra.rollout.engine import VLLMEngine

                self._engine = VLLMEngine(self.policy_dir, dtype=dtype, max_model_len=m.max_model_len,
                                          kv_cache_gib=m.kv_cache_gib, seed=r.seed,
                                          policy_version=self.policy_version)
        return self._engine

    @property
    def trainer(self):
        """The DeepSpeed GRPO trainer, started from ``policy_dir``."""
        if self._trainer is None:
            from infra.train.trainer import GRPOTrainer

            t = self.config.train
            self._trainer = GRPOTrainer(self.policy_dir, lr=t.lr, zero_stage=t.zero_stage, grad_clip=t.grad_clip,
                                        micro_batch_rows=t.micro_batch_rows, tis_cap=t.tis_cap,
                                        temperature=self.config.rollout.temperature, scale_by_std=t.scale_by_std,
                                        mask_truncated=t.mask_truncated, max_seq_len=t.max_seq_len,
                                        tis_level=t.tis_level, mask_ratio_low=t.mask_ratio_low,
                                        mask_ratio_high=t.mask_ratio_high, forward_dtype=t.forward_dtype,
                                        baseline=t.baseline, divergence_threshold=t.divergence_threshold,
                                        divergence_estimator=t.divergence_estimator,
                                        divergence_action=t.divergence_action)
            if self.trainer_state:  # a resumed run: weights and AdamW moments as they were after that step
                folder, tag = self.trainer_state
                try:
                    self._trainer.load_state(Path(folder), tag)
                    self.trainer_restored = tag
                    logging.getLogger(__name__).info("trainer state %s restored from %s", tag, folder)
                except Exception as e:  # e.g. saved with another zero_stage: weights stay the checkpoint's
                    logging.getLogger(__name__).warning("trainer state %s in %s not restored (%s: %s); the "
                                                        "optimizer starts fresh", tag, folder, type(e).__name__, e)
        return self._trainer

    @property
    def scheduler(self):
        """The asynchronous collector (one per run in this process; groups carry across steps in it)."""
        if self._scheduler is None:
            import math

            from infra.environments import BASE_IMAGE
            from infra.rollout.collector import Collector, CollectSettings
            from infra.rollout.scheduler import AsyncCollector

            r = self.config.rollout
            settings = CollectSettings(r.group_size, r.temperature, r.top_p, r.max_tokens_per_turn, r.max_turns,
                                       r.seed, r.max_infra_retries)
            runner = Collector(self.engine, self.backend, settings, code_image=BASE_IMAGE, pool=self.sandbox_pool)
            self._scheduler = AsyncCollector(
                runner, group_size=r.group_size, max_groups_in_flight=math.ceil(r.tasks_per_step * r.overprovision),
                max_concurrent_episodes=r.max_concurrent_episodes, max_policy_lag=r.max_policy_lag,
                episode_deadline_s=r.episode_deadline_s, infra_policy=r.infra_policy,
                max_infra_retries=r.max_infra_retries, update_policy=r.update_policy, prefetch=r.prefetch,
                policy_version=self.policy_version, seed=r.seed)
        return self._scheduler

    def load_weights(self, hf_dir: str, version: int) -> float:
        """Load new weights from an HF folder into the engine; returns the apply pause in s."""
        return self.apply_weights(lambda: self.engine.load_weights(hf_dir, version), version)

    def apply_weights(self, apply, version: int) -> float:
        """Run ``apply()`` (loads ``version`` into the engine, returns its pause in s) under the update policy.

        With the async collector running, its ``update_policy`` (finish, pause or abort in-flight
        episodes) governs the switch; otherwise ``apply`` runs directly.
        """
        if self._scheduler is None:
            return apply()
        pause: list[float] = []
        self._scheduler.update_weights(lambda: pause.append(apply()), version)
        return pause[0]

    def load_catalog(self, catalog_uri: str) -> dict:
        """Read ``envs.json`` (once) and load the task objects it names."""
        if not self.catalog:
            self.fs.invalidate_cache()
            self.catalog = json.loads(self.fs.cat_file(catalog_uri))
            self.tasks, _, _ = load_run_tasks(self.config)
        return self.catalog


def artifact_key(run_id: str, suffix: str) -> str:
    """A Prefect artifact key for a run (keys allow only lowercase letters, digits and dashes)."""
    return "".join(c if c.isalnum() else "-" for c in run_id.lower()) + f"-{suffix}"


def resolve_path(path: str) -> Path | None:
    """A config path: absolute, or relative to the repo root; None for an empty string."""
    if not path:
        return None
    p = Path(path)
    return p if p.is_absolute() else repo_root() / p


def load_run_tasks(config: RunConfig):
    """Every task the config names: ``(tasks by id, split by id, load errors)`` (see ``load_tasks``)."""
    from infra.environments import load_tasks

    t = config.tasks
    return load_tasks(resolve_path(t.terminal_dir), t.terminal_eval_ids, t.humaneval_train, t.humaneval_eval,
                      resolve_path(t.code_file), [resolve_path(p) for p in t.task_sets if p])


def runtime(config: RunConfig) -> Runtime:
    """The run's runtime in this process (created with its storage connection on first call).

    Raises:
        StorageError: the S3 endpoint is unset or unreachable, or the bucket is missing.
    """
    rt = _RUNTIMES.get(config.run_id)
    if rt is None or rt.config != config:
        from infra.storage import s3_filesystem

        rt = Runtime(config, s3_filesystem(config.storage.bucket))
        _RUNTIMES[config.run_id] = rt
    return rt


def close_runtime(run_id: str) -> None:
    """Drop a run's live resources (engine, trainer) from this process; idle warm sandboxes are removed."""
    rt = _RUNTIMES.pop(run_id, None)
    if rt is not None and rt._sandbox_pool is not None:
        rt._sandbox_pool.close()
    if rt is not None and rt._owns_servers:
        rt._engine.close(stop_servers=True)
