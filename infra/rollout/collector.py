"""The episode runner: G attempts per task, a harness acting in each sandbox, the task's verifier scoring it.

One loop for every mode: :meth:`Collector.run` runs one attempt (sandbox, harness, verification,
classification, row), driven by the asynchronous collector in training and, through a one-shot
scheduler, by :meth:`Collector.collect` (sync mode, evaluation, a fan-out worker's group). Seeds come
from the scheduler's jobs and infra retries are the scheduler's. The harness (``envs.harness``;
default the bash-fence agent) asks for turns through the runner, which records every sampled id
with its logprob and policy version; terminal tasks act in their sandbox over turns, code tasks
answer once and are verified in a fresh sandbox.

The agent's commands run in its sandbox's persistent shell (``Sandbox.run_in_shell``: one tmux
session per sandbox, so per episode; ``cd``, variables and jobs persist across turns, as in
Terminal-Bench), or, for a gateway harness that asks (``"shell": false``: Terminus-2 driving its
own tmux session), each under its own ``bash -c``; verification and the runner's own checks use
``exec``. The agent's budget is
counted in turns and in the time its own commands took (``tool_s``), not in wall clock shared with
other episodes' generation, so a slow batch never costs the model.

Sandboxes: with a :class:`~infra.sandbox.pool.WarmPool`, the batch's demand per image is declared
up front, so sandboxes come warm from the pool.

Replay: every row stores the commands run (for code tasks, the one program verified) and the
image digest, so :func:`replay_episode` can re-run them and reproduce the verifier's result. Not for
Terminus-2's rows: its commands are tmux keystrokes whose effect depends on the waits between them.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from envs.harness import BashFenceHarness, Harness
from envs.task import Outcome, Task
from envs.verify import Verdict
from infra.rollout.chat_tokens import ChatTokens
from infra.rollout.engine import RolloutEngine, Sample, SampleRequest
from infra.rollout.scheduler import AsyncCollector, EpisodeJob
from infra.rollout.servers import EngineUnavailable
from infra.sandbox.base import ExecResult, Sandbox, SandboxBackend, SandboxInfraError
from infra.sandbox.pool import WarmPool
from infra.store import Trajectory, egress_columns

log = logging.getLogger(__name__)

RAW_EXEC_OUTPUT_LIMIT_BYTES = 8 * 2**20
"""Output kept of a gateway harness's ``"shell": false`` command. Harbor's environments keep all of it, and
Terminus-2 reads its whole tmux scrollback each turn (``capture-pane -S -``): 16 KiB, the shell's cap, would
freeze what it sees once the pane holds more. 8 MiB, under the sandbox's 32 MiB output tmpfs."""


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
    engine_queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    tool_s: float = 0.0
    verify_s: float = 0.0
    segment_starts: list[int] = field(default_factory=lambda: [0])
    egress: dict[str, dict] = field(default_factory=dict)  # the sandbox's egress record by phase, at release
    side_calls: int = 0  # gateway calls answered but not trained on (token counts, model lists, side models)

    @property
    def done(self) -> bool:
        """The agent phase is over (by its own choice, its budget, or an infra failure)."""
        return bool(self.agent_end or self.infra_reason)

    def truncate(self, n_tokens: int, n_segments: int, prompt_tokens: int) -> None:
        """Back to the first ``n_tokens`` ids and ``n_segments`` segments (a call that sampled nothing)."""
        for name in ("token_ids", "loss_mask", "logprobs", "versions"):
            del getattr(self, name)[n_tokens:]
        del self.segment_starts[n_segments:]
        self.prompt_tokens = prompt_tokens

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
    top_k: int = 0  # 0: off (vLLM's value); last so positional callers keep their meaning

    @classmethod
    def of(cls, r) -> CollectSettings:
        """From a ``RolloutConfig``."""
        return cls(r.group_size, r.temperature, r.top_p, r.max_tokens_per_turn, r.max_turns, r.seed,
                   r.max_infra_retries, top_k=r.top_k)


class _EpisodeIO:
    """The runner's side of :class:`envs.harness.EpisodeIO` for one episode (token bookkeeping, sandbox, budget).

    Also the gateway's :class:`~infra.rollout.gateway.GatewayEpisode` for a harness that speaks the
    OpenAI API (:meth:`open_gateway`): the same bookkeeping, budgets and classification.
    """

    def __init__(self, runner: Collector, e: Episode, cancel):
        self.runner, self.e, self.cancel, self.task = runner, e, cancel, e.task
        self.max_turns = runner.s.max_turns
        self.max_model_len = runner.engine.max_model_len
        self.model_name = "policy"

    @property
    def ended(self) -> str:
        """Why the episode ended ("" while it runs): the harness's end, the runner's, or an infra failure."""
        return self.e.agent_end or self.e.infra_reason or ("cancelled" if self.cancel.is_set() else "")

    @property
    def num_turns(self) -> int:
        return self.e.num_turns

    @property
    def tool_s(self) -> float:
        return self.e.tool_s

    @property
    def last_stop_reason(self) -> str | None:
        """Why the last sampled turn stopped (``stop``, ``length``); None before the first."""
        return self.e.stop_reason if self.e.num_turns else None

    def start(self, messages: list[dict[str, str]]) -> None:
        """Open the transcript; a task that acts in a sandbox gets it now (a failed start ends the episode)."""
        self.e.append(self.runner.chat.prompt_ids(messages), None)
        self.e.prompt_tokens = len(self.e.token_ids)
        self.acquire()

    @property
    def workdir(self) -> str | None:
        """The sandbox's working directory, starting the sandbox first (see ``envs.harness.EpisodeIO.workdir``)."""
        self.acquire()
        return self.e.sandbox.workdir if self.e.sandbox is not None else None

    def acquire(self) -> None:
        """Get the episode's sandbox, for a task that acts in one (a failed start ends the episode)."""
        if self.task.acts_in_sandbox and self.e.sandbox is None and not self.e.done:
            self.runner._acquire(self.e)

    def open_gateway(self):
        """This episode's gateway endpoint (``infra.rollout.gateway.Endpoint``); close with :meth:`close_gateway`."""
        return self.runner.gateway().open(self)

    def close_gateway(self, endpoint) -> None:
        self.runner.gateway().close(endpoint.key)

    def fail(self, reason: str) -> None:
        """The harness failed on its own (``harness_error``): an infra failure, retried and excluded."""
        if not self.e.done:
            self.e.infra_reason = reason

    def sample_ids(self, prompt_ids: list[int], extends: bool, max_tokens: int | None,
                   stop: tuple[str, ...]) -> Sample | str:
        """One gateway call: record ``prompt_ids`` (extending the segment, or opening a new one) and sample.

        Returns the sample, or why the episode refused: it had ended, ``max_turns`` or ``context_full``
        (these end it now). ``max_tokens`` is capped by the run's per-turn budget and the room left.
        """
        e, s = self.e, self.runner.s
        if (why := self.ended):
            return why
        if e.num_turns >= self.max_turns:
            e.agent_end = "max_turns"
            return e.agent_end
        room = self.max_model_len - len(prompt_ids)
        if room < 8:
            e.agent_end = "context_full"
            return e.agent_end
        before = (len(e.token_ids), len(e.segment_starts), e.prompt_tokens)
        if extends:
            if prompt_ids[:len(e.token_ids) - self._segment_start] != e.token_ids[self._segment_start:]:
                raise AssertionError("an extending call's prompt does not start with the episode's segment")
            e.append(prompt_ids[len(e.token_ids) - self._segment_start:], None)
        else:
            if e.token_ids:
                e.segment_starts.append(len(e.token_ids))
            e.append(prompt_ids, None)
            if len(e.segment_starts) == 1:
                e.prompt_tokens = len(prompt_ids)
        sample = None
        try:
            sample = self._sample(min(max_tokens or s.max_tokens_per_turn, s.max_tokens_per_turn, room), stop)
        finally:
            if sample is None:  # nothing sampled: the call leaves no trace in the row
                e.truncate(*before)
        return sample or self.ended

    def sample_side(self, prompt_ids: list[int], max_tokens: int | None, stop: tuple[str, ...]) -> Sample | str:
        """A side call's sample (an agent's small-model call): the policy samples it, the row never holds it.

        Returns the sample, or why it was refused (the episode ended, ``context_full`` for this prompt alone,
        ``engine_unreachable``); a refusal never ends the episode. Its engine time counts in ``generation_s``.
        """
        e, s = self.e, self.runner.s
        if (why := self.ended):
            return why
        room = self.max_model_len - len(prompt_ids)
        if room < 8:
            return "context_full"
        request = SampleRequest(prompt_ids, min(max_tokens or s.max_tokens_per_turn, s.max_tokens_per_turn, room),
                                s.temperature, s.top_p, e.seed + 104729 * (e.side_calls + 1), top_k=s.top_k,
                                stop=stop)
        start = time.monotonic()
        try:
            (sample,) = self.runner.engine.generate([request], [f"{e.episode_id}-side"])
        except EngineUnavailable as err:
            log.warning("engine unavailable for a side call of episode %s: %s", e.episode_id, err)
            return "engine_unreachable"
        e.generation_s += time.monotonic() - start
        return sample

    def side_call(self, kind: str) -> None:
        """Count one side call (any kind) in the row's ``side_calls``."""
        self.e.side_calls += 1

    @property
    def _segment_start(self) -> int:
        return self.e.segment_starts[-1]

    def exec_command(self, command: str, timeout_s: float | None, shell: bool = True) -> dict | str:
        """A gateway harness's command in the sandbox: its shell, or ``bash -c`` when not ``shell``.

        The task's per-command deadline caps ``timeout_s``.

        The task's tool-time budget ends the episode (``agent_timeout``) once spent.
        """
        if (why := self.ended):
            return why
        if self.e.sandbox is None:
            self.acquire()
            if (why := self.ended):
                return why
        result = self.execute(command, timeout_s, shell)
        if result is None:
            return self.ended or "sandbox_failed"
        if self.e.tool_s >= self.task.agent_timeout_s:
            self.e.agent_end = "agent_timeout"
        return {"output": result.output, "exit_code": result.exit_code, "timed_out": result.timed_out,
                "duration_s": result.duration_s}

    def sample(self) -> str | None:
        e, s = self.e, self.runner.s
        if e.done:
            return None
        if self.cancel.is_set():
            e.infra_reason = "cancelled"
            return None
        room = self.runner.engine.max_model_len - len(e.token_ids)
        if room < 8:
            e.agent_end = "context_full"
            return None
        sample = self._sample(min(s.max_tokens_per_turn, room), ())
        return None if sample is None else sample.text

    def _sample(self, max_tokens: int, stop: tuple[str, ...]) -> Sample | None:
        """Sample on the current segment; record the ids, logprobs and version (None: the engine was unreachable)."""
        e, s = self.e, self.runner.s
        request = SampleRequest(e.token_ids[self._segment_start:], max_tokens, s.temperature, s.top_p,
                                e.seed + 7919 * e.num_turns, top_k=s.top_k, stop=stop)
        start = time.monotonic()
        try:
            (sample,) = self.runner.engine.generate([request], [e.episode_id])
        except EngineUnavailable as err:
            log.warning("engine unavailable for episode %s: %s", e.episode_id, err)
            e.infra_reason = "engine_unreachable"
            return None
        e.generation_s += time.monotonic() - start
        e.engine_queue_s += sample.queue_s
        e.prefill_s += sample.prefill_s
        e.decode_s += sample.decode_s
        e.append(sample.token_ids, sample)
        e.num_turns += 1
        e.stop_reason = sample.stop_reason
        e.last_reply = sample.text
        e.engine_replica = sample.replica or self.runner.engine.replica
        return sample

    def execute(self, command: str, timeout_s: float | None = None, shell: bool = True):
        e = self.e
        if e.done:
            return None
        e.commands.append(command)
        assert e.sandbox is not None, "a terminal episode acts in its sandbox"
        deadline = e.task.command_timeout_s if timeout_s is None else min(timeout_s, e.task.command_timeout_s)
        try:
            result = (e.sandbox.run_in_shell(command, timeout_s=deadline) if shell
                      else e.sandbox.exec(command, timeout_s=deadline, output_limit_bytes=RAW_EXEC_OUTPUT_LIMIT_BYTES))
        except SandboxInfraError as err:
            Collector._sandbox_failed(e, err)
            return None
        e.tool_s += result.duration_s
        return result

    def run_agent(self, command: str, env: dict[str, str], timeout_s: float,
                  output_limit_bytes: int = 64 * 1024) -> ExecResult | None:
        """Run an installed agent's process (``bash -c command``) in the sandbox until it exits.

        The process is killed (with everything it started) when the episode ends on the runner's side
        meanwhile (``max_turns``, ``context_full``, cancellation); ``timeout_s`` is its wall-clock cap
        (then ``agent_timeout``). Its time is not tool time: its commands run inside it, unseen.

        Returns:
            Its exit code and output (its first ``output_limit_bytes``), or None: the episode ended
            (by the runner, the deadline, or a sandbox failure, classified as :meth:`execute` does).
        """
        e = self.e
        if e.done or e.sandbox is None:
            return None
        box, out = e.sandbox, {}

        def run() -> None:
            try:
                out["result"] = box.exec(command, timeout_s=timeout_s, env=env, output_limit_bytes=output_limit_bytes)
            except SandboxInfraError as err:
                out["error"] = err

        thread = threading.Thread(target=run, name=f"agent-{e.episode_id}", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(timeout=0.1)
            if self.ended and thread.is_alive():
                try:
                    box.stop_agent_processes()  # its exec then returns
                except SandboxInfraError as err:
                    out["error"] = err
                thread.join()
        if "error" in out and not self.ended:
            Collector._sandbox_failed(e, out["error"])
        if self.ended:
            return None
        result = out.get("result")
        if result is not None and result.timed_out:
            e.agent_end = "agent_timeout"
            return None
        return result

    def observe(self, text: str) -> None:
        self.e.append(self.runner.chat.continuation_ids(self.e.token_ids, text), None)

    def end(self, agent_end: str) -> None:
        self.e.agent_end = self.e.agent_end or agent_end


class Collector:
    """The episode runner: one attempt at a time, a harness acting in its sandbox, the task's verifier after.

    :meth:`run` is the :class:`~infra.rollout.scheduler.EpisodeRunner` the asynchronous collector
    drives; :meth:`collect` (sync mode, evaluation, one fan-out worker's group) drives the same runner
    through a one-shot :class:`~infra.rollout.scheduler.AsyncCollector`, so seeds come from the job and
    infra retries from the scheduler, in every mode.
    """

    def __init__(self, engine: RolloutEngine, backend: SandboxBackend, settings: CollectSettings,
                 code_image: str, pool: WarmPool | None = None, harness: Harness | None = None,
                 retry_backoff_s: float = 2.0, max_concurrent_episodes: int = 16):
        """Create a runner.

        ``code_image`` is the sandbox image code tasks are verified in (needs python3); ``pool``
        (optional) hands out already started sandboxes; ``harness`` acts in each episode (default:
        :class:`~envs.harness.BashFenceHarness`); ``retry_backoff_s``: :meth:`collect`'s backoff before an
        infra retry (2 s, then 4 s, ...: a sandbox engine restarting answers pings while it refuses starts);
        ``max_concurrent_episodes``: episodes :meth:`collect` runs at once (the async default).
        """
        self.engine, self.backend, self.s, self.sandbox_pool = engine, backend, settings, pool
        self.chat = ChatTokens(engine.tokenizer)
        self.code_image = code_image
        self.harness = harness or BashFenceHarness()
        self.retry_backoff_s = retry_backoff_s
        self.max_concurrent_episodes = max_concurrent_episodes
        self._gateway = None
        self._gateway_lock = threading.Lock()

    def gateway(self):
        """The run's token-exact gateway (``infra.rollout.gateway.Gateway``), started on first use."""
        with self._gateway_lock:
            if self._gateway is None:
                from infra.rollout.gateway import Gateway

                channel = None
                if getattr(self.harness, "gateway_channel", False):  # an agent installed in the sandbox
                    from infra.egress.proxy import EGRESS_GATEWAY

                    channel = EGRESS_GATEWAY
                self._gateway = Gateway(self.engine.tokenizer, tool_parser=getattr(self.harness, "tool_parser", ""),
                                        channel_host=channel,
                                        side_models=tuple(getattr(self.harness, "side_models", ())))
            return self._gateway

    def close(self) -> None:
        """Stop the gateway, if one was started."""
        if self._gateway is not None:
            self._gateway.shutdown()
            self._gateway = None

    def collect(self, run_id: str, step: int, tasks: list[Task], images: dict[str, tuple[str, str]],
                on_progress: Callable[[int, int], None] | None = None, first_group: int = 0) -> list[dict]:
        """Run ``group_size`` attempts for each task to their end; returns one row per attempt (retries included).

        Up to ``max_concurrent_episodes`` episodes run at once, each on its own worker (the engines batch
        their turns); an attempt ending in ``infra_failure`` is retried up to ``max_infra_retries`` times,
        after ``retry_backoff_s`` (doubling), and a member out of retries keeps its failed row while its
        siblings run on. No deadline, no carry-over: exactly these groups, every attempt's row.

        Args:
            run_id: run identifier stored in every row.
            step: training step the rollouts are for (seeds derive from it).
            tasks: each becomes one group ``{run_id}/{step}/{task_id}``.
            images: task id -> (image tag, image digest).
            on_progress: called with (groups finished, groups) as groups finish.
            first_group: index of ``tasks[0]``'s group in the step (seeds derive from it), for a step
                collected in parts (one group per fan-out worker).

        Returns:
            Rows matching :data:`infra.store.TRAJECTORY_SCHEMA`, by group, sample index and attempt.
        """
        if not tasks:
            return []
        self.bind(run_id, step, images)
        self.reserve_sandboxes(tasks)
        sched = AsyncCollector(self, group_size=self.s.group_size, max_groups_in_flight=len(tasks),
                               max_concurrent_episodes=min(len(tasks) * self.s.group_size,
                                                           self.max_concurrent_episodes),
                               max_policy_lag=2**31 - 1, episode_deadline_s=float("inf"), infra_policy="retry",
                               max_infra_retries=self.s.max_infra_retries, prefetch=False,
                               policy_version=self.engine.policy_version,
                               seed=(self.s.seed * 7919 + step * 10_007) % (2**31), first_launch_index=first_group,
                               retry_backoff_s=self.retry_backoff_s, keep_failed_members=True)
        try:
            sched.submit([(f"{run_id}/{step}/{t.task_id}", t) for t in tasks])
            batch = sched.run_all(on_progress)
        finally:
            sched.close()
        if self.backend.sweep_leftovers() and self.backend.wait_engine(60.0):
            self.backend.sweep_leftovers()
        return sorted(batch.rows, key=lambda r: (r["group_id"], r["sample_index"], r["attempt"]))

    def bind(self, run_id: str, step: int, images: dict[str, tuple[str, str]]) -> None:
        """Set what rows of episodes launched from now on record: run id, step, task images."""
        self._bound = (run_id, step, images)

    def reserve_sandboxes(self, tasks: list[Task]) -> None:
        """Declare to the warm pool the sandboxes of one group per task (``group_size`` each), by image and limits.

        Images are the bound ones (:meth:`bind`); a code task is verified in ``code_image``. No pool: nothing.
        """
        if self.sandbox_pool is None:
            return
        images = self._bound[2]
        demand: dict[tuple, int] = {}
        for t in tasks:
            key = (images.get(t.task_id, (self.code_image, ""))[0], t.limits)
            demand[key] = demand.get(key, 0) + self.s.group_size
        for (image, limits), n in demand.items():
            self.sandbox_pool.ensure(image, n, **limits.kwargs())

    def run(self, job: EpisodeJob) -> dict:
        """Run one attempt start to end (:class:`~infra.rollout.scheduler.EpisodeRunner`).

        The harness acts (its episode's sandbox is acquired when it opens the transcript, for terminal
        tasks), then the task verifies. Every turn is
        its own engine request routed by the episode id (the engines batch concurrent episodes).
        ``job.cancel`` is checked between turns: a cancelled attempt ends as ``infra_failure/cancelled``.
        A retried attempt first waits (up to 60 s) for the sandbox engine to answer (after a restart).
        """
        run_id, step, images = self._bound
        image, digest = images.get(job.task.task_id, (self.code_image, ""))
        e = Episode(job.task, job.group_id, job.sample_index, job.attempt, job.seed, image, digest)
        try:
            if job.attempt:
                self.backend.wait_engine(60.0)
            self.harness.act(_EpisodeIO(self, e, job.cancel), self.s.max_turns)
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

    # -- sandboxes and verification ------------------------------------------------------
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
            e.egress = e.sandbox.egress_record()
            e.sandbox.close()
            e.sandbox = None

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
        return Trajectory(
            run_id=run_id, step=step, episode_id=e.episode_id, task_id=e.task.task_id, group_id=e.group_id,
            sample_index=e.sample_index, attempt=e.attempt, token_ids=list(e.token_ids), loss_mask=list(e.loss_mask),
            rollout_logprobs=list(e.logprobs), policy_versions=list(e.versions),
            min_policy_version=min(sampled) if sampled else -1, max_policy_version=max(sampled) if sampled else -1,
            prompt_tokens=e.prompt_tokens, completion_tokens=sum(e.loss_mask), reward=reward, outcome=str(outcome),
            reason=reason, stop_reason=e.stop_reason, agent_end=e.agent_end, num_turns=e.num_turns,
            commands=e.commands, image=e.image, image_digest=e.image_digest, seed=e.seed,
            temperature=self.s.temperature, top_p=self.s.top_p, max_tokens=self.s.max_tokens_per_turn,
            queue_s=e.queue_s, sandbox_acquire_s=e.sandbox_acquire_s, generation_s=e.generation_s, tool_s=e.tool_s,
            verify_s=e.verify_s, engine_replica=e.engine_replica or self.engine.replica, sandbox_id=e.sandbox_id,
            sandbox_warm=e.sandbox_warm, segment_starts=list(e.segment_starts),
            episode_s=time.monotonic() - e.created_s, engine_queue_s=e.engine_queue_s,
            prefill_s=e.prefill_s, decode_s=e.decode_s, side_calls=e.side_calls, **egress_columns(e.egress),
        ).row()


def replay_episode(row: dict, task: Task, backend: SandboxBackend, code_image: str) -> tuple[Verdict, bool]:
    """Re-run a stored episode's commands against the same image and verify it again.

    Terminal tasks: each stored command runs in order, with the task's per-command deadline, in
    the persistent shell of a fresh sandbox started from the stored image digest (as the episode
    ran them); then the task's verifier runs. Code
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
