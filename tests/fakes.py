"""Service-free stand-ins for the rollout engine, the sandbox backend and the clock.

- :class:`ScriptedEngine` answers the collector's requests from a script, through a real tokenizer
  (reply text -> ids, EOS appended on ``stop``, truncated at ``max_tokens`` like vLLM), stamps the
  ``policy_version`` it serves at the call (set it to simulate a weight update), and records what
  it was asked (:class:`Received`).
- :class:`InMemoryBackend` starts :class:`InMemorySandbox` es whose ``exec`` and ``run_in_shell``
  answer from a callable ``exec_fn(box, command)`` (see :func:`scripted`), each recorded in order
  (``execs``; the shell's also in ``shell``); files live in a dict; starts and closes are counted.
- :class:`ManualClock`: monotonic time advanced by hand (``AsyncCollector(clock=...)``).

Only what the collector uses of each interface is implemented.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from infra.rollout.engine import Sample, SampleRequest
from infra.sandbox.base import ExecResult, SandboxInfraError

# -- engine ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """One scripted completion.

    ``stop_reason="stop"`` appends the tokenizer's EOS id to the reply's ids (vLLM returns it when
    generation stops on it); ``length`` does not. Either way the ids are cut at the request's
    ``max_tokens`` (then the stop reason is ``length``). ``logprobs``: one per id of the reply (EOS
    included); None: the engine's own distinct values (see :meth:`ScriptedEngine.default_logprob`).
    """

    text: str
    stop_reason: str = "stop"
    logprobs: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Received:
    """One request as the engine got it, with what it answered.

    ``episode``: ordinal of the trajectory id in order of first appearance; ``turn``: the request's
    index within that trajectory (0 = first turn).
    """

    trajectory_id: str
    episode: int
    turn: int
    request: SampleRequest
    sample: Sample


ScriptItem = str | Reply | BaseException
Script = Sequence[ScriptItem] | Callable[[int, int, SampleRequest], ScriptItem]


def per_episode(replies: Sequence[Sequence[ScriptItem]]) -> Callable[[int, int, SampleRequest], ScriptItem]:
    """A script answering episode ``e``'s turn ``t`` with ``replies[e][t]`` (episodes in order of first request)."""

    def answer(episode: int, turn: int, request: SampleRequest) -> ScriptItem:
        return replies[episode][turn]

    return answer


class ScriptedEngine:
    """The engine interface the collector uses, answered from a script.

    ``script``: a sequence (answered in order of requests received, across all trajectories) or a
    callable ``(episode, turn, request) -> item`` (:func:`per_episode`). An item is reply text, a
    :class:`Reply`, or an exception, raised from :meth:`generate` (e.g. ``EngineUnavailable``).

    Like :class:`~infra.rollout.engine.VLLMEngine`, a request whose prompt plus ``max_tokens``
    exceeds ``max_model_len`` raises ``ValueError``, and every sample of a call carries the
    ``policy_version`` served at that call.
    """

    replica = "scripted-0"

    def __init__(self, tokenizer, script: Script, max_model_len: int = 2048, policy_version: int = 0):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.policy_version = policy_version
        self._script = script
        self._lock = threading.Lock()
        self.received: list[Received] = []
        self.calls: list[int] = []  # requests per generate call
        self.episode_ids: list[str] = []  # trajectory ids in order of first request
        self.finished: list[str] = []

    @staticmethod
    def default_logprob(request_index: int, token_index: int) -> float:
        """Logprob of token ``token_index`` of the ``request_index``-th request: distinct per request and token."""
        return -0.01 * (request_index + 1) - 1e-4 * token_index

    def generate(self, requests: list[SampleRequest], trajectory_ids: list[str] | None = None) -> list[Sample]:
        """Answer each request from the script (one sample per request, in order)."""
        with self._lock:
            self.calls.append(len(requests))
            samples = []
            for i, r in enumerate(requests):
                if len(r.prompt_ids) + r.max_tokens > self.max_model_len:
                    raise ValueError(f"prompt {len(r.prompt_ids)} + max_tokens {r.max_tokens} > max_model_len "
                                     f"{self.max_model_len}")
                tid = trajectory_ids[i] if trajectory_ids is not None else f"anon-{len(self.received)}"
                if tid not in self.episode_ids:
                    self.episode_ids.append(tid)
                episode = self.episode_ids.index(tid)
                turn = sum(1 for x in self.received if x.trajectory_id == tid)
                if callable(self._script):
                    item = self._script(episode, turn, r)
                else:
                    item = self._script[len(self.received)]
                if isinstance(item, BaseException):
                    raise item
                sample = self._sample(item if isinstance(item, Reply) else Reply(item), r, len(self.received))
                # The collector passes its episode's live id list: keep the ids as they were sent.
                sent = dataclasses.replace(r, prompt_ids=list(r.prompt_ids))
                self.received.append(Received(tid, episode, turn, sent, sample))
                samples.append(sample)
            return samples

    def _sample(self, reply: Reply, r: SampleRequest, index: int) -> Sample:
        ids = self.tokenizer.encode(reply.text, add_special_tokens=False)
        if reply.stop_reason == "stop":
            ids.append(self.tokenizer.eos_token_id)
        if reply.logprobs is not None:
            if len(reply.logprobs) != len(ids):
                raise ValueError(f"reply {reply.text!r}: {len(reply.logprobs)} logprobs for {len(ids)} ids")
            lps = list(reply.logprobs)
        else:
            lps = [self.default_logprob(index, j) for j in range(len(ids))]
        stop = reply.stop_reason
        if len(ids) > r.max_tokens:
            ids, lps, stop = ids[:r.max_tokens], lps[:r.max_tokens], "length"
        return Sample(ids, lps, self.policy_version, stop, self.tokenizer.decode(ids, skip_special_tokens=True))

    def finish(self, trajectory_id: str) -> None:
        """Record that a trajectory ended."""
        with self._lock:
            self.finished.append(trajectory_id)

    def episode(self, ordinal: int) -> list[Received]:
        """The requests of the ``ordinal``-th trajectory, by turn."""
        return [x for x in self.received if x.episode == ordinal]


# -- sandbox ---------------------------------------------------------------------------------

Answer = ExecResult | tuple[int, str, float, bool] | BaseException
"""What ``exec`` returns: an ExecResult, ``(exit_code, output, duration_s, timed_out)``, or an exception to raise."""


def scripted(answers: Sequence[Answer]) -> Callable[[InMemorySandbox, str], Answer]:
    """An ``exec_fn`` answering each sandbox's ``k``-th exec with ``answers[k]``."""

    def exec_fn(box: InMemorySandbox, command: str) -> Answer:
        return answers[len(box.execs) - 1]

    return exec_fn


SHELL = "<shell>"
"""The workdir :class:`InMemorySandbox` records for a ``run_in_shell`` command in ``execs``."""


def junit_report(tests: int, failures: int = 0, skipped: int = 0) -> bytes:
    """A pytest JUnit XML report with these counts."""
    return (f'<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" '
            f'failures="{failures}" skipped="{skipped}" tests="{tests}"></testsuite></testsuites>').encode()


@dataclass
class InMemorySandbox:
    """A sandbox whose commands are answered by ``exec_fn(box, command)`` and whose files are a dict.

    ``exec`` and ``run_in_shell`` after ``close`` raise ``SandboxInfraError("container_vanished")``, like a
    removed container. Both are recorded in ``execs`` (a shell command with workdir :data:`SHELL`), the
    shell's also in ``shell`` as ``(command, timeout_s)``; the fake keeps no shell state of its own.
    """

    sandbox_id: str
    image: str
    labels: dict[str, str]
    limits: dict
    exec_fn: Callable[[InMemorySandbox, str], Answer]
    backend: InMemoryBackend | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    workdir: str = "/app"
    diff: list[tuple[str, str]] = field(default_factory=list)  # what changes() reports (docker diff)
    execs: list[tuple[str, float, str]] = field(default_factory=list)  # (command, timeout_s, workdir)
    shell: list[tuple[str, float]] = field(default_factory=list)  # run_in_shell's (command, timeout_s)
    stop_calls: int = 0
    closed: bool = False
    phase: str = "agent"
    egress: dict[str, dict] = field(default_factory=dict)  # what egress_record() reports

    def egress_record(self) -> dict[str, dict]:
        """The scripted egress record (``egress``)."""
        return self.egress

    def exec(self, command: str, timeout_s: float, workdir: str | None = None,
             env: dict[str, str] | None = None, output_limit_bytes: int = 16_384) -> ExecResult:
        """Answer ``command`` from ``exec_fn`` (which may raise ``SandboxInfraError``); no output limit."""
        if self.closed:
            raise SandboxInfraError("container_vanished", f"{self.sandbox_id} was removed")
        self.execs.append((command, timeout_s, workdir))
        return self._answer(command)

    def _answer(self, command: str) -> ExecResult:
        answer = self.exec_fn(self, command)
        if isinstance(answer, BaseException):
            raise answer
        if isinstance(answer, ExecResult):
            return answer
        exit_code, output, duration_s, timed_out = answer
        return ExecResult(exit_code, output, timed_out, duration_s)

    def run_in_shell(self, command: str, timeout_s: float) -> ExecResult:
        """Answer ``command`` from ``exec_fn``, recorded in ``shell`` and in ``execs`` (workdir :data:`SHELL`)."""
        if self.closed:
            raise SandboxInfraError("container_vanished", f"{self.sandbox_id} was removed")
        self.shell.append((command, timeout_s))
        self.execs.append((command, timeout_s, SHELL))
        return self._answer(command)

    def changes(self) -> list[tuple[str, str]]:
        return list(self.diff)

    def stop_agent_processes(self) -> int:
        """Count the call; no processes to kill."""
        self.stop_calls += 1
        return 0

    def put_dir(self, local_dir: Path, dest: str) -> None:
        """Replace everything under ``dest`` with the files of ``local_dir``."""
        dest = dest.rstrip("/")
        for key in [k for k in self.files if k.startswith(dest + "/")]:
            del self.files[key]
        for p in sorted(Path(local_dir).rglob("*")):
            if p.is_file():
                self.files[f"{dest}/{p.relative_to(local_dir).as_posix()}"] = p.read_bytes()

    def put_file(self, data: bytes, dest: str) -> None:
        """Store ``data`` at ``dest``."""
        self.files[dest] = bytes(data)

    def get_file(self, path: str) -> bytes | None:
        """The bytes stored at ``path``, None when absent."""
        return self.files.get(path)

    def get_link(self, path: str) -> str | None:
        """No symlinks here."""
        return None

    def close(self) -> None:
        """Mark closed (counted once by the backend)."""
        if not self.closed:
            self.closed = True
            if self.backend is not None:
                self.backend.closes += 1


def _no_command(box: InMemorySandbox, command: str) -> Answer:
    return (127, f"bash: {command}: command not found\n", 0.0, False)


class InMemoryBackend:
    """Starts :class:`InMemorySandbox` es, all answering through ``exec_fn``.

    ``start_failures``: errors raised by the next starts, in order (None: that start succeeds).
    """

    def __init__(self, exec_fn: Callable[[InMemorySandbox, str], Answer] = _no_command,
                 start_failures: Sequence[SandboxInfraError | None] = ()):
        self.exec_fn = exec_fn
        self._start_failures = list(start_failures)
        self._lock = threading.Lock()
        self.sandboxes: list[InMemorySandbox] = []
        self.start_attempts = 0
        self.closes = 0
        self.wait_engine_calls = 0
        self.sweeps = 0

    @property
    def starts(self) -> int:
        """Sandboxes started (failed starts not counted)."""
        return len(self.sandboxes)

    def start(self, image: str, labels: dict[str, str], cpus: float | None = None, memory_mb: int | None = None,
              network: bool = False, disk_mb: int | None = None,
              egress_hosts: tuple[str, ...] | None = None) -> InMemorySandbox:
        """A new in-memory sandbox, or the next scripted start failure."""
        with self._lock:
            self.start_attempts += 1
            failure = self._start_failures.pop(0) if self._start_failures else None
            if failure is not None:
                raise failure
            box = InMemorySandbox(f"mem-{len(self.sandboxes)}", image, dict(labels),
                                  {"cpus": cpus, "memory_mb": memory_mb, "network": network, "disk_mb": disk_mb},
                                  self.exec_fn, self)
            self.sandboxes.append(box)
            return box

    def by_label(self, key: str, value: str) -> list[InMemorySandbox]:
        """Sandboxes started with label ``key=value``."""
        return [b for b in self.sandboxes if b.labels.get(key) == value]

    def wait_engine(self, timeout_s: float = 60.0) -> bool:
        """Count the call; the in-memory engine always answers."""
        self.wait_engine_calls += 1
        return True

    def sweep_leftovers(self) -> int:
        """Count the call; nothing is ever left over."""
        self.sweeps += 1
        return 0


# -- clock -----------------------------------------------------------------------------------


class ManualClock:
    """Monotonic seconds that move only when :meth:`advance` is called (thread-safe).

    Starts at 1000 s, not 0: ``EpisodeJob.launched_s == 0`` means "not launched yet" to the scheduler,
    so an attempt launched at a clock reading of 0 would never meet its deadline.
    """

    def __init__(self, start: float = 1000.0):
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        """Move time forward by ``seconds`` (>= 0); returns the new time."""
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back ({seconds} s)")
        with self._lock:
            self._now += seconds
            return self._now

