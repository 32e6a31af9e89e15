"""Rollout collection: G attempts per task, agents acting in sandboxes, verifiers scoring them.

The loop is turn-synchronous: every live episode's next turn is generated in one batched engine
call, then the commands run concurrently in their sandboxes, then observations are appended and
the next turn starts. Terminal tasks run up to ``max_turns`` commands; code tasks (HumanEval) are
one turn whose program is verified in a sandbox. An episode that ends in ``infra_failure`` is
retried (a new attempt) up to ``max_infra_retries`` times; every attempt is stored.

The agent's budget is counted in turns and in the time its own commands took (``tool_s``), not
in wall clock shared with other episodes' generation, so a slow batch never costs the model.

Sandboxes: with a :class:`~infra.sandbox.pool.WarmPool`, the step's demand per image is declared
up front, terminal episodes' sandboxes are acquired while the first turn is being generated, and
code tasks' verification sandboxes come warm from the pool (started during generation).

Replay: every row stores the commands run (for code tasks, the one program verified) and the
image digest, so :func:`replay_episode` can re-run them and reproduce the verifier's result.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from envs.agent import FORMAT_REMINDER, initial_messages, observation, parse_action
from envs.task import Outcome, Task
from envs.verify import Verdict
from infra.rollout.chat_tokens import ChatTokens
from infra.rollout.engine import Sample, SampleRequest, VLLMEngine
from infra.rollout.scheduler import EpisodeJob
from infra.rollout.servers import EngineUnavailable
from infra.sandbox.base import Sandbox, SandboxBackend, SandboxInfraError
from infra.sandbox.pool import WarmPool

log = logging.getLogger(__name__)


@dataclass
class Episode:
    """Mutable state of one attempt while it runs (becomes one trajectory row)."""

    task: Task
    group_id: str
    sample_index: int
    attempt: int
    seed: int
    image: str
    image_digest: str
    episode_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    commands: list[str] = field(default_factory=list)
    last_reply: str = ""
    stop_reason: str = ""
    num_turns: int = 0
    agent_end: str = ""
    sandbox: Sandbox | None = None
    sandbox_id: str = ""
    sandbox_warm: bool = False
    engine_replica: str = ""
    verdict: Verdict | None = None
    infra_reason: str = ""
    created_s: float = field(default_factory=time.monotonic)
    queue_s: float = 0.0
    sandbox_acquire_s: float = 0.0
    generation_s: float = 0.0
    tool_s: float = 0.0
    verify_s: float = 0.0

    @property
    def done(self) -> bool:
        """The agent phase is over (by its own choice, its budget, or an infra failure)."""
        return bool(self.agent_end or self.infra_reason)

    def append(self, ids: list[int], sampled: Sample | None) -> None:
        """Append ids: sampled ones with their logprobs and version, or template/observation ids."""
        self.token_ids += ids
        if sampled is None:
            self.loss_mask += [0] * len(ids)
            self.logprobs += [0.0] * len(ids)
            self.versions += [-1] * len(ids)
        else:
            self.loss_mask += [1] * len(ids)
            self.logprobs += sampled.logprobs
            self.versions += [sampled.policy_version] * len(ids)


@dataclass(frozen=True)
class CollectSettings:
    """What the collector needs from the run config."""

    group_size: int
    temperature: float
    top_p: float
    max_tokens_per_turn: int
    max_turns: int
    seed: int
    max_infra_retries: int

    @classmethod
    def of(cls, r) -> CollectSettings:
        """From a ``RolloutConfig``."""
        return cls(r.group_size, r.temperature, r.top_p, r.max_tokens_per_turn, r.max_turns, r.seed,
                   r.max_infra_retries)


class Collector:
    """Runs groups of episodes against one engine and one sandbox backend."""

    def __init__(self, engine: VLLMEngine, backend: SandboxBackend, settings: CollectSettings,
                 code_image: str, max_workers: int = 8, pool: WarmPool | None = None):
        """Create a collector.

        ``code_image`` is the sandbox image code tasks are verified in (needs python3); ``pool``
        (optional) hands out already started sandboxes.
        """
        self.engine, self.backend, self.s, self.sandbox_pool = engine, backend, settings, pool
        self.chat = ChatTokens(engine.tokenizer)
        self.code_image = code_image
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="sandbox")

    def collect(self, run_id: str, step: int, tasks: list[Task], images: dict[str, tuple[str, str]],
                on_progress: Callable[[int, int], None] | None = None, first_group: int = 0) -> list[dict]:
        """Collect ``group_size`` attempts for each task; returns one row per attempt (retries included).

        Args:
            run_id: run identifier stored in every row.
            step: training step the rollouts are for.
            tasks: tasks of this step; each becomes one group.
            images: task id -> (image tag, image digest) for terminal tasks.
            on_progress: called with (finished, total) after each turn.
            first_group: index of ``tasks[0]``'s group in the step (seeds derive from it), for a step
                collected in parts (one group per fan-out worker).

        Returns:
            Rows matching :data:`infra.store.TRAJECTORY_SCHEMA`, grouped by task.
        """
        episodes = []
        for g, task in enumerate(tasks, start=first_group):
            image, digest = images.get(task.task_id, (self.code_image, ""))
            group_id = f"{run_id}/{step}/{task.task_id}"
            for i in range(self.s.group_size):
                seed = (self.s.seed * 1_000_003 + step * 10_007 + g * 101 + i) % (2**31)
                episodes.append(Episode(task, group_id, i, 0, seed, image, digest))
        if self.sandbox_pool is not None:
            demand: dict[tuple, int] = {}
            for e in episodes:
                key = (e.image, e.task.limits)
                demand[key] = demand.get(key, 0) + 1
            for (image, limits), n in demand.items():
                self.sandbox_pool.ensure(image, n, **limits.kwargs())
        finished: list[Episode] = []
        batch = episodes
        for attempt in range(self.s.max_infra_retries + 1):
            self._run(batch, on_progress, len(episodes))
            finished += batch
            retry = [e for e in batch if e.infra_reason]
            if not retry or attempt == self.s.max_infra_retries:
                break
            self.backend.wait_engine(60.0)  # after an engine restart, retry once it answers again
            batch = [Episode(e.task, e.group_id, e.sample_index, attempt + 1, e.seed + attempt + 1,
                             e.image, e.image_digest) for e in retry]
        if self.backend.sweep_leftovers() and self.backend.wait_engine(60.0):
            self.backend.sweep_leftovers()
        return [self._row(run_id, step, e) for e in sorted(finished, key=lambda e: (e.group_id, e.sample_index,
                                                                                        e.attempt))]

    # -- one episode at a time (the asynchronous collector's runner) -----------------------
    def bind(self, run_id: str, step: int, images: dict[str, tuple[str, str]]) -> None:
        """Set what rows of episodes launched from now on record: run id, step, task images."""
        self._bound = (run_id, step, images)

    def run(self, job: EpisodeJob) -> dict:
        """Run one attempt start to end (:class:`~infra.rollout.scheduler.EpisodeRunner`).

        Every turn is its own engine request routed by the episode id (the engines batch
        concurrent episodes continuously). ``job.cancel`` is checked between turns: a cancelled
        attempt ends as ``infra_failure/cancelled`` and its sandbox is released.
        """
        run_id, step, images = self._bound
        image, digest = images.get(job.task.task_id, (self.code_image, ""))
        e = Episode(job.task, job.group_id, job.sample_index, job.attempt, job.seed, image, digest)
        try:
            e.append(self.chat.prompt_ids(initial_messages(e.task)), None)
            e.prompt_tokens = len(e.token_ids)
            if e.task.acts_in_sandbox:
                self._acquire(e)
            while not e.done and not job.cancel.is_set():
                self._turn([e])
                self._act(e)
            if job.cancel.is_set() and not e.infra_reason:
                e.infra_reason = "cancelled"
            if not e.infra_reason:
                self._verify(e)
        finally:
            self._release(e)
            self.engine.finish(e.episode_id)
        return self._row(run_id, step, e)

    def failed_row(self, job: EpisodeJob, reason: str) -> dict:
        """Row for an attempt the scheduler ended (deadline, harness error): ``infra_failure/<reason>``."""
        run_id, step, images = self._bound
        image, digest = images.get(job.task.task_id, (self.code_image, ""))
        e = Episode(job.task, job.group_id, job.sample_index, job.attempt, job.seed, image, digest)
        e.infra_reason = reason
        return self._row(run_id, step, e)

    # -- the loop -------------------------------------------------------------------------
    def _run(self, episodes: list[Episode], on_progress, total: int) -> None:
        for e in episodes:
            e.append(self.chat.prompt_ids(initial_messages(e.task)), None)
            e.prompt_tokens = len(e.token_ids)
        # Sandboxes are acquired while the first turn is generated: a command needs one, a prompt does not.
        acquiring = [self.pool.submit(self._acquire, e) for e in episodes if e.task.acts_in_sandbox]
        try:
            while live := [e for e in episodes if not e.done]:
                self._turn(live)
                if acquiring:
                    wait(acquiring)
                    acquiring = []
                list(self.pool.map(self._act, live))
                if on_progress:
                    on_progress(sum(e.done for e in episodes), total)
            list(self.pool.map(self._verify, [e for e in episodes if not e.infra_reason]))
        finally:
            wait(acquiring)
            list(self.pool.map(self._release, episodes))

    def _start_sandbox(self, e: Episode, image: str) -> None:
        labels = {"agentrl.episode": e.episode_id}
        limits = e.task.limits.kwargs()
        if self.sandbox_pool is not None:
            e.sandbox, e.sandbox_warm = self.sandbox_pool.acquire(image, labels, **limits)
        else:
            e.sandbox, e.sandbox_warm = self.backend.start(image, labels, **limits), False
        e.sandbox_id = e.sandbox.sandbox_id

    def _acquire(self, e: Episode) -> None:
        start = time.monotonic()
        e.queue_s = start - e.created_s
        try:
            self._start_sandbox(e, e.image)
        except SandboxInfraError as err:
            e.infra_reason = err.reason
        except Exception:  # noqa: BLE001 - a harness bug must not leave the episode without a class
            log.exception("episode %s: sandbox acquire failed unexpectedly", e.episode_id)
            e.infra_reason = "harness_error"
        e.sandbox_acquire_s = time.monotonic() - start

    def _release(self, e: Episode) -> None:
        if e.sandbox is not None:
            e.sandbox.close()
            e.sandbox = None

    def _turn(self, live: list[Episode]) -> None:
        max_len = self.engine.max_model_len
        requests, ready = [], []
        for e in live:
            room = max_len - len(e.token_ids)
            if room < 8:
                e.agent_end = "context_full"
                continue
            requests.append(SampleRequest(e.token_ids, min(self.s.max_tokens_per_turn, room), self.s.temperature,
                                          self.s.top_p, e.seed + 7919 * e.num_turns))
            ready.append(e)
        if not requests:
            return
        start = time.monotonic()
        try:
            samples = self.engine.generate(requests, [e.episode_id for e in ready])
        except EngineUnavailable as err:
            log.warning("engine unavailable for %d episode(s): %s", len(ready), err)
            for e in ready:
                e.infra_reason = "engine_unreachable"
            return
        elapsed = time.monotonic() - start
        for e, sample in zip(ready, samples, strict=True):
            e.generation_s += elapsed
            e.append(sample.token_ids, sample)
            e.num_turns += 1
            e.stop_reason = sample.stop_reason
            e.last_reply = sample.text
            e.engine_replica = sample.replica or self.engine.replica

    def _act(self, e: Episode) -> None:
        """Run the command of the episode's last reply and append its observation."""
        if e.infra_reason:
            return
        if e.done or not e.task.acts_in_sandbox:
            e.agent_end = e.agent_end or "single_turn"
            return
        action = parse_action(e.last_reply)
        if action.command is None:
            obs = FORMAT_REMINDER
            if action.done:
                e.agent_end = "done"
                return
        else:
            e.commands.append(action.command)
            assert e.sandbox is not None
            try:
                result = e.sandbox.exec(action.command, timeout_s=e.task.command_timeout_s)
            except SandboxInfraError as err:
                self._sandbox_failed(e, err)
                return
            e.tool_s += result.duration_s
            obs = observation(result.exit_code, result.output, result.timed_out, e.task.command_timeout_s)
            if action.done:
                e.agent_end = "done"
                return
        if e.num_turns >= self.s.max_turns:
            e.agent_end = "max_turns"
        elif e.tool_s >= e.task.agent_timeout_s:
            e.agent_end = "agent_timeout"
        else:
            e.append(self.chat.continuation_ids(e.token_ids, obs), None)

    @staticmethod
    def _sandbox_failed(e: Episode, err: SandboxInfraError) -> None:
        """Classify a sandbox failure: the model's doing (it broke its own environment) or infra."""
        if err.reason == "environment_broken":
            e.agent_end = "environment_broken"
            e.verdict = Verdict(0.0, Outcome.MODEL_FAILURE, "environment_broken", str(err))
        else:
            e.infra_reason = err.reason

    def _verify(self, e: Episode) -> None:
        if e.verdict is not None:  # already decided (the model broke its environment)
            return
        start = time.monotonic()
        try:
            if e.task.acts_in_sandbox:
                if e.sandbox is None:
                    e.infra_reason = "sandbox_missing"
                    return
            else:  # the answer is verified in a fresh sandbox
                t0 = time.monotonic()
                self._start_sandbox(e, self.code_image)
                e.sandbox_acquire_s = time.monotonic() - t0
            e.commands = e.task.submitted_commands(e.last_reply) or e.commands
            e.verdict = e.task.verify(e.sandbox, e.last_reply)
        except SandboxInfraError as err:
            self._sandbox_failed(e, err)
        e.verify_s = time.monotonic() - start

    def _row(self, run_id: str, step: int, e: Episode) -> dict:
        if e.infra_reason:
            reward, outcome, reason = 0.0, Outcome.INFRA_FAILURE, e.infra_reason
        else:
            assert e.verdict is not None
            reward, outcome, reason = e.verdict.reward, e.verdict.outcome, e.verdict.reason
        sampled = [v for v, m in zip(e.versions, e.loss_mask, strict=True) if m]
        return {
            "run_id": run_id, "step": step, "episode_id": e.episode_id, "task_id": e.task.task_id,
            "group_id": e.group_id, "sample_index": e.sample_index, "attempt": e.attempt,
            "token_ids": e.token_ids, "loss_mask": e.loss_mask, "rollout_logprobs": e.logprobs,
            "policy_versions": e.versions,
            "min_policy_version": min(sampled) if sampled else -1,
            "max_policy_version": max(sampled) if sampled else -1,
            "prompt_tokens": e.prompt_tokens, "completion_tokens": sum(e.loss_mask),
            "reward": reward, "outcome": str(outcome), "reason": reason,
            "stop_reason": e.stop_reason, "agent_end": e.agent_end, "num_turns": e.num_turns,
            "commands": e.commands, "image": e.image, "image_digest": e.image_digest, "seed": e.seed,
            "temperature": self.s.temperature, "top_p": self.s.top_p, "max_tokens": self.s.max_tokens_per_turn,
            "queue_s": e.queue_s, "sandbox_acquire_s": e.sandbox_acquire_s, "generation_s": e.generation_s,
            "tool_s": e.tool_s, "verify_s": e.verify_s, "engine_replica": e.engine_replica or self.engine.replica,
            "sandbox_id": e.sandbox_id, "sandbox_warm": e.sandbox_warm,
        }


def replay_episode(row: dict, task: Task, backend: SandboxBackend, code_image: str) -> tuple[Verdict, bool]:
    """Re-run a stored episode's commands against the same image and verify it again.

    Terminal tasks: each stored command runs in order, with the task's per-command deadline, in
    a fresh sandbox started from the stored image digest; then the task's verifier runs. Code
    tasks: the stored program is verified in ``code_image``.

    Args:
        row: a trajectory row (``task_id``, ``commands``, ``image``, ``image_digest``, ``reward``, ``outcome``).
        task: the row's task.
        backend: sandbox backend.
        code_image: image code tasks are verified in.

    Returns:
        (verdict, reproduced): ``reproduced`` is True when reward and outcome equal the stored ones.

    Raises:
        ValueError: ``row`` is an ``infra_failure`` (nothing the model did to replay) or of another task.
        SandboxInfraError: the sandbox failed during the replay.
    """
    if row["task_id"] != task.task_id:
        raise ValueError(f"row of {row['task_id']} replayed against task {task.task_id}")
    if row["outcome"] == str(Outcome.INFRA_FAILURE):
        raise ValueError(f"episode {row['episode_id']} ended in infra_failure ({row['reason']}): nothing to replay")
    image = (row["image_digest"] or row["image"]) if task.acts_in_sandbox else code_image
    box = backend.start(image, {"agentrl.replay": row["episode_id"]}, **task.limits.kwargs())
    try:
        verdict = task.replay(box, row["commands"])
    finally:
        box.close()
    reproduced = abs(verdict.reward - row["reward"]) < 1e-6 and str(verdict.outcome) == row["outcome"]
    return verdict, reproduced
