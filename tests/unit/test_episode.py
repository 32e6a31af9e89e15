"""The episode state machine, driven through ``Collector.run`` (per episode) and ``Collector.collect`` (sync).

No services: a scripted engine answers each turn, in-memory sandboxes answer each command (see
``world``), and the real tiny tokenizer (ChatML template) does the token bookkeeping. Expected
token ids are derived from the ChatML template by hand (``chatml``), not from ``ChatTokens``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from envs.agent import FORMAT_REMINDER, SYSTEM_PROMPT, system_prompt
from envs.harbor import HarborTask
from envs.humaneval import CodeTask
from envs.task import Task
from envs.terminal_bench import TerminalBenchTask
from envs.verify import HARBOR_TEST_COMMAND
from infra.rollout.collector import Collector, CollectSettings, replay_episode
from infra.rollout.scheduler import EpisodeJob
from infra.rollout.servers import EngineUnavailable
from infra.sandbox.base import SandboxInfraError
from infra.store import validate_rows
from tests.fakes import SHELL, InMemoryBackend, InMemorySandbox, Reply, ScriptedEngine, junit_report, per_episode

CODE_IMAGE = "agentrl-base:bookworm"
IMAGE, DIGEST = "agentrl-task/hello:abc123", "sha256:feedface"
SEED = 1234

HELLO = "```bash\necho hello > /app/hello.txt\n```"  # makes the hidden test pass
LS = "```bash\nls /app\n```"
DONE = "DONE"


# -- the in-memory world ---------------------------------------------------------------------
def world(box: InMemorySandbox, command: str):
    """Answers ``(exit_code, output, duration_s, timed_out)``: a few agent commands and the verifiers' calls."""
    ok = box.files.get("/app/hello.txt") == b"hello\n"
    if command == "echo hello > /app/hello.txt":
        box.files["/app/hello.txt"] = b"hello\n"
        return (0, "", 0.5, False)
    if command == "ls /app":
        return (0, "".join(k[len("/app/"):] + "\n" for k in sorted(box.files) if k.startswith("/app/")), 0.25, False)
    if command == "sleep 2":
        return (0, "", 2.0, False)
    if command == "sleep 100":  # killed at the task's command deadline
        return (137, "", 10.0, True)
    if command == "rm -rf /":
        raise SandboxInfraError("environment_broken", "the agent removed /")
    junit = re.search(r"--junitxml=(\S+)", command)
    if "pytest" in command and junit:  # Terminal-Bench verifier: pytest writes its JUnit report there
        collected = 1 if "/tests/test_outputs.py" in box.files else 0
        box.files[junit.group(1)] = junit_report(tests=collected, failures=0 if ok else collected)
        return (0 if ok and collected else 1, "1 passed" if ok else "1 failed", 0.5, False)
    if command.startswith("rm -rf /logs/verifier"):  # Harbor verifier empties its reward dir first
        for k in [k for k in box.files if k.startswith("/logs/verifier/")]:
            del box.files[k]
        return (0, "", 0.0, False)
    if command == HARBOR_TEST_COMMAND and "/tests/test.sh" in box.files:  # Harbor runs test.sh directly
        box.files["/logs/verifier/reward.txt"] = b"1\n" if ok else b"0\n"
        return (0, "", 0.5, False)
    if command == "mkdir -p /work":
        return (0, "", 0.0, False)
    if command == "python3 /work/program.py":  # HumanEval verifier: passes when the body is right
        return (0, "", 0.1, False) if b"return a + b" in box.files["/work/program.py"] else (1, "AssertionError", 0.1,
                                                                                              False)
    return (127, f"bash: {command}: command not found\n", 0.0, False)


def chatml(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def prompt_text(task: Task) -> str:
    """ChatML of the opening chat: system, user, then the assistant header (infra.model.CHATML_TEMPLATE)."""
    return (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{task.instruction}<|im_end|>\n"
            "<|im_start|>assistant\n")


def continuation_text(obs: str, after_eos: bool = True) -> str:
    """What follows a turn: its closing (``<|im_end|>`` already sampled if it ended on EOS), user turn, header."""
    return ("\n" if after_eos else "<|im_end|>\n") + f"<|im_start|>user\n{obs}<|im_end|>\n<|im_start|>assistant\n"


def terminal_task(tmp_path: Path, verifier: str = "pytest", **kw) -> Task:
    tests = tmp_path / kw.get("task_id", "tb/hello").replace("/", "_") / "tests"
    tests.mkdir(parents=True, exist_ok=True)
    if verifier == "pytest":
        (tests / "test_outputs.py").write_text("def test_hello():\n"
                                               "    assert open('/app/hello.txt').read() == 'hello\\n'\n")
    else:
        (tests / "test.sh").write_text("#!/bin/bash\n[ \"$(cat /app/hello.txt)\" = hello ] && echo 1 > "
                                       "/logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n")
    kind = {"pytest": TerminalBenchTask, "harbor": HarborTask}[verifier]
    return kind(task_id=kw.pop("task_id", "tb/hello"), instruction="Write hello to /app/hello.txt.",
                build_context=tests.parent, tests_dir=tests, **kw)


@dataclass
class Rig:
    collector: Collector
    engine: ScriptedEngine
    sandboxes: InMemoryBackend

    def run(self, task: Task, seed: int = SEED, job: EpisodeJob | None = None) -> dict:
        self.collector.bind("run", 3, {task.task_id: (IMAGE, DIGEST)} if task.acts_in_sandbox else {})
        job = job or EpisodeJob(f"run/3/{task.task_id}", task, 0, 0, seed, 0)
        row = self.collector.run(job)
        validate_rows([row])
        return row

    def collect(self, tasks: list[Task], step: int = 3, **kw) -> list[dict]:
        rows = self.collector.collect("run", step, tasks, {t.task_id: (IMAGE, DIGEST) for t in tasks}, **kw)
        validate_rows(rows)
        return rows


@pytest.fixture
def rig(tiny_tokenizer):
    def make(script, exec_fn=world, max_model_len: int = 2048, start_failures=(), **settings) -> Rig:
        s = {"group_size": 1, "temperature": 0.7, "top_p": 0.95, "max_tokens_per_turn": 64, "max_turns": 5,
             "seed": 0, "max_infra_retries": 1, **settings}
        engine = ScriptedEngine(tiny_tokenizer, script, max_model_len=max_model_len)
        sandboxes = InMemoryBackend(exec_fn, start_failures)
        c = Collector(engine, sandboxes, CollectSettings(**s), code_image=CODE_IMAGE, retry_backoff_s=0.0)
        return Rig(c, engine, sandboxes)

    return make


def execs(box: InMemorySandbox) -> list[str]:
    return [c for c, _, _ in box.execs]


def assert_all_closed(sandboxes: InMemoryBackend) -> None:
    assert sandboxes.starts == sandboxes.closes and all(b.closed for b in sandboxes.sandboxes)


# -- how an episode ends ---------------------------------------------------------------------
@pytest.mark.parametrize(("replies", "turns", "commands", "outcome", "reward"), [
    ([HELLO, DONE], 2, ["echo hello > /app/hello.txt"], "success", 1.0),  # the command, then DONE on its own
    ([HELLO + "\nDONE"], 1, ["echo hello > /app/hello.txt"], "success", 1.0),  # DONE after the block: runs, ends
    ([DONE], 1, [], "model_failure", 0.0),  # gave up at once: the hidden test fails
])
def test_done_ends_the_episode_and_the_verdict_is_the_verifiers(rig, tmp_path, replies, turns, commands, outcome,
                                                                 reward):
    r = rig(replies)
    task = terminal_task(tmp_path)
    row = r.run(task)
    assert (row["agent_end"], row["num_turns"], row["commands"]) == ("done", turns, commands)
    assert (row["outcome"], row["reward"]) == (outcome, reward)
    assert row["reason"] == ("tests_passed" if reward else "tests_failed")
    [box] = r.sandboxes.sandboxes
    assert box.image == IMAGE and box.labels == {"agentrl.episode": row["episode_id"]}
    # Verification: agent processes stopped once, hidden tests put in fresh, then pytest ran.
    assert box.stop_calls == 1
    assert box.files["/tests/test_outputs.py"] == (task.tests_dir / "test_outputs.py").read_bytes()
    assert execs(box)[:len(commands)] == commands and "pytest" in execs(box)[-1]
    assert (row["image"], row["image_digest"], row["seed"]) == (IMAGE, DIGEST, SEED)
    # Turn k is seeded seed + 7919 k; each request continues exactly the ids so far.
    assert [x.request.seed for x in r.engine.received] == [SEED + 7919 * k for k in range(turns)]
    assert all(row["token_ids"][:len(x.request.prompt_ids)] == x.request.prompt_ids for x in r.engine.received)
    assert r.engine.finished == [row["episode_id"]]
    assert_all_closed(r.sandboxes)


def test_a_reply_without_a_command_gets_exactly_the_format_reminder(rig, tmp_path, tiny_tokenizer):
    r = rig(["Let me think about it.", DONE])
    task = terminal_task(tmp_path)
    row = r.run(task)
    assert (row["agent_end"], row["num_turns"], row["commands"]) == ("done", 2, [])
    first, second = r.engine.received
    # Turn 2's prompt = turn 1's prompt + its sample + the reminder as the next user turn.
    after = second.request.prompt_ids[len(first.request.prompt_ids) + len(first.sample.token_ids):]
    assert after == chatml(tiny_tokenizer, continuation_text(FORMAT_REMINDER))
    assert tiny_tokenizer.decode(after) == f"\n<|im_start|>user\n{FORMAT_REMINDER}<|im_end|>\n<|im_start|>assistant\n"
    [box] = r.sandboxes.sandboxes
    assert "pytest" in box.execs[0][0]  # no agent command ran: the first exec is the verifier's
    assert_all_closed(r.sandboxes)


@pytest.mark.parametrize(("reply", "obs"), [
    (LS, "hello.txt\n\n[exit code 0]"),  # output, then the exit code (envs.agent.observation)
    ("```bash\nsleep 100\n```", "\n[command killed after 10 s]"),  # timed out at command_timeout_s = 10
    ("```bash\nfrobnicate\n```", "bash: frobnicate: command not found\n\n[exit code 127]"),
])
def test_the_observation_is_the_commands_result(rig, tmp_path, tiny_tokenizer, reply, obs):
    r = rig([HELLO, reply, DONE])
    r.run(terminal_task(tmp_path))
    second, third = r.engine.received[1:]
    after = third.request.prompt_ids[len(second.request.prompt_ids) + len(second.sample.token_ids):]
    assert tiny_tokenizer.decode(after) == continuation_text(obs)


def test_max_turns_ends_the_episode_at_that_many_turns(rig, tmp_path):
    r = rig([LS] * 10, max_turns=3)
    row = r.run(terminal_task(tmp_path))
    # Three commands run, then the budget check after the third ends it: no fourth request.
    assert (row["agent_end"], row["num_turns"], row["commands"]) == ("max_turns", 3, ["ls /app"] * 3)
    assert len(r.engine.received) == 3
    assert row["loss_mask"][-1] == 1  # no observation is appended after the last turn
    assert row["outcome"] == "model_failure" and row["reason"] == "tests_failed"


@pytest.mark.parametrize(("agent_timeout_s", "turns"), [
    (5.0, 3),  # each `sleep 2` costs 2.0 s of tool time: 2, 4 < 5, then 6 >= 5 after the third
    (4.0, 2),  # 4.0 >= 4.0 after the second (the budget is spent when reached, not only when exceeded)
    (4.5, 3),
])
def test_the_agent_budget_counts_tool_time(rig, tmp_path, agent_timeout_s, turns):
    r = rig(["```bash\nsleep 2\n```"] * 10, max_turns=10)
    row = r.run(terminal_task(tmp_path, agent_timeout_s=agent_timeout_s))
    assert (row["agent_end"], row["num_turns"], row["tool_s"]) == ("agent_timeout", turns, 2.0 * turns)
    assert row["outcome"] == "model_failure"


def test_context_full_ends_the_episode_before_the_engine_is_overrun(rig, tmp_path, tiny_tokenizer):
    task = terminal_task(tmp_path)
    probe = rig([HELLO, "thinking " * 40, DONE])
    probe.run(task)
    after_one = len(probe.engine.received[1].request.prompt_ids)  # L1 = prompt + turn 1 + its observation
    assert after_one == (len(chatml(tiny_tokenizer, prompt_text(task))) + len(chatml(tiny_tokenizer, HELLO)) + 1
                         + len(chatml(tiny_tokenizer, continuation_text("\n[exit code 0]"))))

    # Room for turn 2 is 7 tokens: below the collector's minimum of 8, so no second request is made.
    r = rig([HELLO, "thinking " * 40, DONE], max_model_len=after_one + 7)
    row = r.run(task)
    assert (row["agent_end"], row["num_turns"], len(r.engine.received)) == ("context_full", 1, 1)
    assert row["outcome"] == "success"  # the verifier still judges what was done

    # Room of exactly 8: turn 2 is asked for max_tokens = min(64, 8) = 8, truncated there ("length"),
    # has no command (format reminder appended), and then the context is full.
    r = rig([HELLO, "thinking " * 40, DONE], max_model_len=after_one + 8)
    row = r.run(task)
    first, second = r.engine.received
    assert first.request.max_tokens == min(64, after_one + 8 - row["prompt_tokens"])
    assert second.request.max_tokens == 8 and len(second.sample.token_ids) == 8
    assert (row["agent_end"], row["num_turns"], row["stop_reason"]) == ("context_full", 2, "length")
    # Cut before its EOS, turn 2 is closed by the template's full "<|im_end|>\n" (mask 0).
    tail = row["token_ids"][len(second.request.prompt_ids) + 8:]
    assert tiny_tokenizer.decode(tail) == continuation_text(FORMAT_REMINDER, after_eos=False)
    assert all(len(x.request.prompt_ids) + x.request.max_tokens <= after_one + 8 for x in r.engine.received)


# -- failures: the model's or the infrastructure's -------------------------------------------
@pytest.mark.parametrize(("reason", "outcome", "agent_end"), [
    ("environment_broken", "model_failure", "environment_broken"),  # the model broke its own sandbox
    ("container_vanished", "infra_failure", ""),
    ("docker_api_error", "infra_failure", ""),
])
def test_a_sandbox_error_is_classified_by_its_reason(rig, tmp_path, reason, outcome, agent_end):
    def exec_fn(box, command):
        if command == "rm -rf /":
            raise SandboxInfraError(reason, "scripted")
        return world(box, command)

    r = rig(["```bash\nrm -rf /\n```", DONE], exec_fn=exec_fn)
    row = r.run(terminal_task(tmp_path))
    assert (row["outcome"], row["reason"], row["reward"], row["agent_end"]) == (outcome, reason, 0.0, agent_end)
    assert row["num_turns"] == 1 and row["commands"] == ["rm -rf /"]
    [box] = r.sandboxes.sandboxes
    assert execs(box) == ["rm -rf /"]  # no verification after either
    assert_all_closed(r.sandboxes)


def test_a_sandbox_that_fails_to_start_is_an_infra_failure_before_any_generation(rig, tmp_path):
    r = rig([HELLO, DONE], start_failures=[SandboxInfraError("sandbox_start_failed", "no space")])
    row = r.run(terminal_task(tmp_path))
    assert (row["outcome"], row["reason"], row["num_turns"]) == ("infra_failure", "sandbox_start_failed", 0)
    assert r.engine.received == [] and (row["min_policy_version"], row["max_policy_version"]) == (-1, -1)
    assert sum(row["loss_mask"]) == 0 and row["completion_tokens"] == 0
    # the sandbox starts before the prompt is made (the prompt names its working directory): none was made
    assert row["prompt_tokens"] == len(row["token_ids"]) == 0
    assert r.sandboxes.start_attempts == 1 and r.sandboxes.starts == 0


def test_the_prompt_names_the_sandboxs_own_working_directory(rig, tmp_path, tiny_tokenizer):
    """An image without WORKDIR runs commands in ``/``: the prompt says ``/``, not ``/app``."""
    r = rig([DONE])
    started = r.sandboxes.start

    def start(*a, **k):
        box = started(*a, **k)
        box.workdir = "/"
        return box

    r.sandboxes.start = start
    r.run(terminal_task(tmp_path))
    (first,) = r.engine.episode(0)
    task = terminal_task(tmp_path)
    want = (f"<|im_start|>system\n{system_prompt('/')}<|im_end|>\n<|im_start|>user\n{task.instruction}<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert first.request.prompt_ids == chatml(tiny_tokenizer, want)
    assert "The working directory is /." in system_prompt("/") and "ls /\n" in system_prompt("/")


def test_an_unreachable_engine_is_an_infra_failure(rig, tmp_path):
    r = rig([HELLO, EngineUnavailable("replica 1 died")])
    row = r.run(terminal_task(tmp_path))
    assert (row["outcome"], row["reason"], row["num_turns"]) == ("infra_failure", "engine_unreachable", 1)
    assert_all_closed(r.sandboxes)


def test_a_cancelled_job_stops_between_turns_and_releases_its_sandbox(rig, tmp_path):
    task = terminal_task(tmp_path)
    job = EpisodeJob("run/3/tb/hello", task, 0, 0, SEED, 0)

    def exec_fn(box, command):
        job.cancel.set()  # the scheduler gives up while the first command runs
        return world(box, command)

    r = rig([HELLO, DONE], exec_fn=exec_fn)
    row = r.run(task, job=job)
    assert (row["outcome"], row["reason"], row["num_turns"]) == ("infra_failure", "cancelled", 1)
    assert r.engine.finished == [row["episode_id"]]
    assert_all_closed(r.sandboxes)


# -- token bookkeeping -----------------------------------------------------------------------
def test_loss_mask_logprobs_and_per_token_versions(rig, tmp_path, tiny_tokenizer):
    holder: dict[str, ScriptedEngine] = {}

    def exec_fn(box, command):
        if command == "ls /app":  # weights v1 are loaded while the first command runs
            holder["engine"].policy_version = 1
        return world(box, command)

    r = rig([LS, HELLO, DONE], exec_fn=exec_fn)
    holder["engine"] = r.engine
    task = terminal_task(tmp_path)
    row = r.run(task)
    s1, s2, s3 = (x.sample for x in r.engine.received)
    assert s1.token_ids == chatml(tiny_tokenizer, LS) + [tiny_tokenizer.eos_token_id]  # reply ids, then EOS
    obs1, obs2 = "\n[exit code 0]", "\n[exit code 0]"  # `ls` of an empty /app; `echo` prints nothing
    segments = [  # (ids, sampled sample or None)
        (chatml(tiny_tokenizer, prompt_text(task)), None),
        (s1.token_ids, s1), (chatml(tiny_tokenizer, continuation_text(obs1)), None),
        (s2.token_ids, s2), (chatml(tiny_tokenizer, continuation_text(obs2)), None),
        (s3.token_ids, s3),
    ]
    assert row["token_ids"] == [t for ids, _ in segments for t in ids]
    assert row["loss_mask"] == [int(s is not None) for ids, s in segments for _ in ids]
    assert row["rollout_logprobs"] == [lp for ids, s in segments for lp in (s.logprobs if s else [0.0] * len(ids))]
    # Turn 1 was produced by v0, turns 2 and 3 by v1; template and observation ids are -1.
    assert (s1.policy_version, s2.policy_version, s3.policy_version) == (0, 1, 1)
    assert row["policy_versions"] == [s.policy_version if s else -1 for ids, s in segments for _ in ids]
    assert (row["min_policy_version"], row["max_policy_version"]) == (0, 1)
    assert row["prompt_tokens"] == len(segments[0][0])
    assert row["completion_tokens"] == len(s1.token_ids) + len(s2.token_ids) + len(s3.token_ids)
    assert row["outcome"] == "success"


def test_logprobs_from_the_script_are_stored_as_given(rig, tmp_path, tiny_tokenizer):
    n = len(chatml(tiny_tokenizer, DONE)) + 1  # DONE's ids and EOS
    lps = tuple(-0.5 * (k + 1) for k in range(n))
    r = rig([Reply(DONE, logprobs=lps)])
    row = r.run(terminal_task(tmp_path))
    assert [lp for lp, m in zip(row["rollout_logprobs"], row["loss_mask"], strict=True) if m] == list(lps)


# -- the persistent shell --------------------------------------------------------------------
@pytest.mark.parametrize("verifier", ["pytest", "harbor"])
def test_agent_commands_run_in_the_persistent_shell_and_verification_with_exec(rig, tmp_path, verifier):
    r = rig([LS, HELLO, "```bash\nsleep 100\n```", DONE])
    row = r.run(terminal_task(tmp_path, verifier=verifier))
    [box] = r.sandboxes.sandboxes
    # every agent command, in order, with the task's per-command deadline (10 s); nothing else in the shell
    assert box.shell == [("ls /app", 10.0), ("echo hello > /app/hello.txt", 10.0), ("sleep 100", 10.0)]
    assert row["commands"] == [c for c, _ in box.shell]
    verification = box.execs[len(box.shell):]
    assert verification and all(workdir != SHELL for _, _, workdir in verification)
    # tool time as before: the shell's durations 0.25 + 0.5 + 10.0 (world)
    assert row["tool_s"] == pytest.approx(10.75)
    assert (row["outcome"], row["reward"]) == ("success", 1.0)


def test_a_code_task_never_uses_the_shell(rig):
    task = CodeTask(task_id="humaneval/add", instruction="Complete add.", prompt="def add(a, b):\n",
                    test_program="def check(f):\n    assert f(1, 2) == 3\n\ncheck(add)\n", entry_point="add")
    r = rig(["```python\n    return a + b\n```"])
    assert r.run(task)["outcome"] == "success"
    [box] = r.sandboxes.sandboxes
    assert box.shell == [] and box.execs


def test_a_replay_runs_the_stored_commands_in_the_shell(rig, tmp_path):
    r = rig([HELLO, DONE])
    task = terminal_task(tmp_path)
    row = r.run(task)
    verdict, reproduced = replay_episode(row, task, r.sandboxes, CODE_IMAGE)
    assert reproduced and verdict.reward == 1.0
    replayed = r.sandboxes.by_label("agentrl.replay", row["episode_id"])
    assert [b.shell for b in replayed] == [[("echo hello > /app/hello.txt", 10.0)]]
    assert replayed[0].image == DIGEST and replayed[0].closed


def test_each_episode_gets_its_own_sandbox_and_so_its_own_shell(rig, tmp_path):
    r = rig(per_episode([[LS, DONE], [LS, DONE]]), group_size=2)
    rows = r.collect([terminal_task(tmp_path)])
    assert len(rows) == 2 and len({row["sandbox_id"] for row in rows}) == 2
    assert [b.shell for b in r.sandboxes.sandboxes] == [[("ls /app", 10.0)]] * 2


# -- verifiers and task kinds ----------------------------------------------------------------
@pytest.mark.parametrize(("replies", "outcome", "reward"), [([HELLO, DONE], "success", 1.0),
                                                            ([DONE], "model_failure", 0.0)])
def test_a_harbor_task_is_scored_from_its_reward_file(rig, tmp_path, replies, outcome, reward):
    r = rig(replies)
    row = r.run(terminal_task(tmp_path, verifier="harbor"))
    assert (row["outcome"], row["reward"]) == (outcome, reward)
    [box] = r.sandboxes.sandboxes
    assert box.files["/logs/verifier/reward.txt"] == (b"1\n" if reward else b"0\n")
    assert HARBOR_TEST_COMMAND in execs(box)


@pytest.mark.parametrize(("body", "outcome"), [("    return a + b\n", "success"),
                                               ("    return a - b\n", "model_failure")])
def test_a_code_task_is_one_turn_verified_in_the_code_image(rig, body, outcome):
    task = CodeTask(task_id="humaneval/add", instruction="Complete add.", prompt="def add(a, b):\n",
                    test_program="def check(f):\n    assert f(1, 2) == 3\n\ncheck(add)\n", tags=("humaneval",),
                    entry_point="add")
    r = rig([f"```python\n{body}```", DONE])
    row = r.run(task)
    program = f"def add(a, b):\n{body}\n\n{task.test_program}"  # prompt + body, then the tests (extract_program)
    assert (row["agent_end"], row["num_turns"], row["commands"], row["outcome"]) == ("single_turn", 1, [program],
                                                                                     outcome)
    [box] = r.sandboxes.sandboxes
    assert box.image == CODE_IMAGE and box.files["/work/program.py"] == program.encode()
    assert (row["image"], row["image_digest"]) == (CODE_IMAGE, "")  # not in the images map: the code image
    assert_all_closed(r.sandboxes)


# -- the turn-synchronous path ---------------------------------------------------------------
def job_seed(seed: int, step: int, group: int, sample: int, attempt: int = 0) -> int:
    """An attempt's seed in ``collect``: the scheduler's job seed, on a base drawn from (seed, step)."""
    base = (seed * 7919 + step * 10_007) % 2**31
    return (base * 1_000_003 + group * 101 + sample * 7 + attempt * 7919) % 2**31


def by_seed(replies: dict[int, list]) -> object:
    """A script answering each episode by the seed of its first turn (turn t asks with seed + 7919 t):
    episodes run concurrently, so the order of their first requests is not theirs to fix."""

    def answer(episode: int, turn: int, request) -> object:
        return replies[request.seed - 7919 * turn][turn]

    return answer


def test_collect_runs_each_episode_with_its_jobs_seed(rig, tmp_path):
    a, b = terminal_task(tmp_path, task_id="tb/a"), terminal_task(tmp_path, task_id="tb/b")
    # a's agents solve it; b's give up. Group g, sample i at step 3 with base seed 5: job_seed(5, 3, g, i).
    seeds = {(g, i): job_seed(5, 3, g, i) for g in (0, 1) for i in (0, 1)}
    r = rig(by_seed({seeds[0, 0]: [HELLO, DONE], seeds[0, 1]: [HELLO, DONE], seeds[1, 0]: [DONE], seeds[1, 1]: [DONE]}),
            group_size=2, seed=5)
    progress = []
    rows = r.collect([a, b], on_progress=lambda done, total: progress.append((done, total)))
    assert [(x["group_id"], x["sample_index"], x["attempt"]) for x in rows] == [
        ("run/3/tb/a", 0, 0), ("run/3/tb/a", 1, 0), ("run/3/tb/b", 0, 0), ("run/3/tb/b", 1, 0)]
    assert [x["outcome"] for x in rows] == ["success", "success", "model_failure", "model_failure"]
    assert [x["seed"] for x in rows] == [seeds[0, 0], seeds[0, 1], seeds[1, 0], seeds[1, 1]]
    # every turn is its own request (the engines batch concurrent episodes): a's 2 turns each, b's 1
    assert r.engine.calls == [1] * 6
    assert sorted(x.request.seed for x in r.engine.received) == sorted(
        [*seeds.values(), seeds[0, 0] + 7919, seeds[0, 1] + 7919])
    assert progress[0] == (0, 2) and progress[-1] == (2, 2)
    assert r.sandboxes.starts == 4 and r.sandboxes.sweeps == 1
    assert_all_closed(r.sandboxes)


def test_collect_seeds_differ_across_steps_and_first_group(rig, tmp_path):
    task = terminal_task(tmp_path)
    seeds = [rig([DONE]).collect([task], step=step, first_group=g)[0]["seed"] for step, g in ((3, 0), (4, 0), (3, 1))]
    assert seeds == [job_seed(0, 3, 0, 0), job_seed(0, 4, 0, 0), job_seed(0, 3, 1, 0)] and len(set(seeds)) == 3


def collect_with_first_sandbox_vanishing(rig, tmp_path) -> tuple[Rig, list[dict]]:
    """G = 2; sample 0's first attempt loses its container under its first command."""
    holder: dict[str, ScriptedEngine] = {}
    doomed = job_seed(0, 3, 0, 0)

    def exec_fn(box, command):
        first_seed = next(x.request.seed for x in holder["engine"].received
                          if x.trajectory_id == box.labels["agentrl.episode"])
        if first_seed == doomed and command.startswith("echo"):
            raise SandboxInfraError("container_vanished", "scripted")
        return world(box, command)

    r = rig(by_seed({doomed: [HELLO], job_seed(0, 3, 0, 1): [HELLO, DONE], job_seed(0, 3, 0, 0, 1): [HELLO, DONE]}),
            exec_fn=exec_fn, group_size=2)
    holder["engine"] = r.engine
    return r, r.collect([terminal_task(tmp_path)])


def test_collect_retries_an_infra_failure_as_a_new_attempt(rig, tmp_path):
    r, rows = collect_with_first_sandbox_vanishing(rig, tmp_path)
    assert [(x["sample_index"], x["attempt"], x["outcome"], x["reason"]) for x in rows] == [
        (0, 0, "infra_failure", "container_vanished"), (0, 1, "success", "tests_passed"),
        (1, 0, "success", "tests_passed")]
    assert rows[1]["seed"] == job_seed(0, 3, 0, 0, attempt=1)  # the retry is a new job of the scheduler
    assert len({x["episode_id"] for x in rows}) == 3  # every attempt is its own episode
    assert r.sandboxes.wait_engine_calls == 1 and r.sandboxes.starts == 3
    assert_all_closed(r.sandboxes)


def test_a_retried_attempt_does_not_reuse_a_siblings_seed(rig, tmp_path):
    _, rows = collect_with_first_sandbox_vanishing(rig, tmp_path)
    final = [x["seed"] for x in rows if x["outcome"] != "infra_failure"]
    assert len(final) == 2 and len(set(final)) == 2


def test_collect_keeps_every_row_when_a_member_runs_out_of_retries(rig, tmp_path):
    # G = 3, no retries: sample 0's engine is unreachable; its siblings still run to their end (evaluation
    # counts every sample; a dropped group would cancel them and lose their rows)
    r = rig(by_seed({job_seed(0, 3, 0, 0): [EngineUnavailable("scripted")], job_seed(0, 3, 0, 1): [HELLO, DONE],
                     job_seed(0, 3, 0, 2): [DONE]}), group_size=3, max_infra_retries=0)
    rows = r.collect([terminal_task(tmp_path)])
    assert [(x["sample_index"], x["outcome"], x["reason"]) for x in rows] == [
        (0, "infra_failure", "engine_unreachable"), (1, "success", "tests_passed"),
        (2, "model_failure", "tests_failed")]
    assert_all_closed(r.sandboxes)


def test_collect_finishes_every_trajectory_on_the_engine(rig, tmp_path):
    r = rig(by_seed({job_seed(0, 3, 0, 0): [HELLO, DONE], job_seed(0, 3, 0, 1): [DONE]}), group_size=2)
    rows = r.collect([terminal_task(tmp_path)])
    assert sorted(r.engine.finished) == sorted(x["episode_id"] for x in rows)


def test_both_paths_build_the_same_row_from_the_same_replies(rig, tmp_path):
    task = terminal_task(tmp_path)
    one = rig([LS, HELLO, DONE]).run(task)
    sync = rig([LS, HELLO, DONE]).collect([task])
    assert len(sync) == 1
    same = ("token_ids", "loss_mask", "rollout_logprobs", "policy_versions", "min_policy_version",
            "max_policy_version", "prompt_tokens", "completion_tokens", "reward", "outcome", "reason", "stop_reason",
            "agent_end", "num_turns", "commands", "image", "image_digest", "tool_s")
    assert {k: one[k] for k in same} == {k: sync[0][k] for k in same}


def test_sampling_settings_reach_every_request(rig, tmp_path):
    """temperature, top_p and top_k of the run's config are what the engine is asked to sample with."""
    r = rig([HELLO, DONE], temperature=0.9, top_p=0.8, top_k=20)
    r.run(terminal_task(tmp_path))
    sent = [(x.request.temperature, x.request.top_p, x.request.top_k) for x in r.engine.received]
    assert sent == [(0.9, 0.8, 20)] * 2
