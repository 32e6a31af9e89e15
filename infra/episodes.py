"""The trajectory viewer: a stored episode decoded turn by turn, as markdown a person can read.

A trajectory row (``infra.store.Trajectory``) holds the whole chat as token ids: the opening prompt
(``loss_mask`` 0), then alternating runs of sampled reply tokens (``loss_mask`` 1) and of template and
observation tokens (``loss_mask`` 0), which the rollout runner appended (``infra.rollout.chat_tokens``).
:func:`decode_turns` splits them back into turns and matches each reply to the command that ran, with
the bash-fence harness's own parser (``envs.agent.parse_action``). :func:`choose_episodes` picks the
episodes that explain a step; :func:`render_step_episodes` renders them (fenced code blocks, which the
Prefect UI's markdown artifacts show as written). No Prefect here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from envs.agent import parse_action
from envs.harness import BashFenceHarness
from envs.task import Outcome

Decode = Callable[[list[int]], str]
"""Token ids -> text (e.g. a Hugging Face tokenizer's ``decode``, special tokens kept)."""

INSTRUCTION_LIMIT_CHARS = 800
REPLY_LIMIT_CHARS = 4000
OUTPUT_LIMIT_CHARS = 1500
COMMANDS_LIMIT = 40  # a third-party harness's commands listed per episode
_OUTCOMES = [str(o) for o in Outcome]  # report order: success, model_failure, infra_failure, unknown
_BACKTICKS = re.compile(r"`+")


@dataclass(frozen=True)
class ChatMarkers:
    """The chat template's text around a turn, stripped from decoded text where it matches exactly.

    Attributes:
        eos: the end-of-turn token's text (``<|im_end|>``); the harness parsed replies without it.
        turn_closing: template text closing an assistant turn (ChatML: ``<|im_end|>`` and a newline).
        user_open: template text opening a user turn (ChatML: ``<|im_start|>user`` and a newline).
        user_close: template text closing it and opening the next assistant turn.
    """

    eos: str
    turn_closing: str
    user_open: str
    user_close: str

    @classmethod
    def of(cls, tokenizer) -> ChatMarkers:
        """The markers of a Hugging Face tokenizer's chat template, as the rollout runner splits it.

        Raises:
            ValueError: the template is not prefix-stable (``infra.rollout.chat_tokens.ChatTokens``).
        """
        from infra.rollout.chat_tokens import ChatTokens

        chat = ChatTokens(tokenizer)
        return cls(chat.eos_text, chat.turn_closing, chat.user_open, chat.user_close)


@dataclass(frozen=True)
class Turn:
    """One model turn of an episode and what the harness did with it.

    Attributes:
        index: 1-based turn number.
        reply: the sampled reply, decoded (its end-of-turn token stripped when markers are given).
        action: how the harness read the reply: ``command`` (it ran), ``command+done`` (it ran, then
            the episode ended on ``DONE``), ``done``, ``no_command`` (answered "No command found"),
            ``answer`` (a code task's one reply; ``command`` is the program verified), ``reply`` (a
            third-party harness's reply: its commands are not matched to replies).
        command: the command that ran for this reply, as stored in the row's ``commands``; None: none ran.
        observation: the ``loss_mask`` 0 text that followed (role markers stripped when markers are given
            and match); None: nothing followed in the trajectory (the episode ended on this turn).
        tokens: sampled tokens of the reply.
        policy_versions: (min, max) policy version of the reply's tokens.
    """

    index: int
    reply: str
    action: str
    command: str | None
    observation: str | None
    tokens: int
    policy_versions: tuple[int, int]


def load_decoder(model_dir: Path) -> tuple[Decode, ChatMarkers]:
    """The decode function (special tokens kept) and chat markers of the tokenizer in a local HF folder.

    Raises:
        OSError: no tokenizer in ``model_dir`` (``transformers.AutoTokenizer``).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return tokenizer.decode, ChatMarkers.of(tokenizer)


def _runs(loss_mask: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal mask values as ``(value, start, end)``."""
    runs: list[tuple[int, int, int]] = []
    for i, m in enumerate(loss_mask):
        if runs and runs[-1][0] == m:
            runs[-1] = (m, runs[-1][1], i + 1)
        else:
            runs.append((m, i, i + 1))
    return runs


def _prompt_end(row: dict) -> int:
    """Length of the opening prompt (the leading ``loss_mask`` 0 run).

    Raises:
        ValueError: the trajectory starts with a sampled token (there is no prompt).
    """
    runs = _runs(row["loss_mask"])
    if runs and runs[0][0] != 0:
        raise ValueError(f"episode {row['episode_id']}: token 0 is sampled (loss_mask 1); expected the prompt first")
    return runs[0][2] if runs else 0


def decode_instruction(row: dict, decode: Decode, markers: ChatMarkers | None = None) -> str:
    """The opening prompt's text: with markers, the user message (the task's instruction), else raw.

    Raises:
        ValueError: the trajectory starts with a sampled token.
    """
    text = decode(list(row["token_ids"][:_prompt_end(row)]))
    if markers is None or not markers.user_open or markers.user_open not in text:
        return text
    body = text.split(markers.user_open, 1)[1]
    return body[:-len(markers.user_close)] if markers.user_close and body.endswith(markers.user_close) else body


def _observation(text: str, markers: ChatMarkers | None) -> str:
    """An observation run's text without the template around it, when the markers match exactly."""
    if markers is None or not markers.user_open:
        return text
    i = text.find(markers.user_open)
    if i < 0 or not markers.turn_closing.endswith(text[:i]) or not text.endswith(markers.user_close):
        return text
    return text[i + len(markers.user_open):len(text) - len(markers.user_close)]


def decode_turns(row: dict, decode: Decode, markers: ChatMarkers | None = None,
                 harness: str = BashFenceHarness.name) -> list[Turn]:
    """Split a trajectory row into its turns and match replies to the commands that ran.

    Each ``loss_mask`` 1 run is one reply; the ``loss_mask`` 0 run after it is its observation. For a
    terminal task of the bash-fence harness each reply is parsed as the harness parsed it
    (``envs.agent.parse_action``); a reply holding a command takes the next of the row's ``commands``
    (what actually ran). Another harness (a third-party one behind the gateway) parses replies its own
    way and may run many commands per reply, or none: its turns are ``reply`` actions without a command
    (the row's ``commands`` are shown apart). A code task (``agent_end == "single_turn"``) has one reply,
    its ``commands`` the program verified.

    Raises:
        ValueError: the trajectory starts with a sampled token; or, for the bash-fence harness, the replies
            holding a command do not number ``len(commands)`` (not a bash-fence trajectory, or a tokenizer
            other than the run's).
    """
    own_parser = harness == BashFenceHarness.name
    ids, versions, commands = row["token_ids"], row["policy_versions"], list(row["commands"])
    _prompt_end(row)
    runs = _runs(row["loss_mask"])
    code_task = row["agent_end"] == "single_turn"
    turns: list[Turn] = []
    used = 0
    for k, (mask, start, end) in enumerate(runs):
        if mask != 1:
            continue
        reply = decode(list(ids[start:end]))
        if markers is not None and markers.eos and reply.endswith(markers.eos):
            reply = reply[:-len(markers.eos)]
        after = runs[k + 1] if k + 1 < len(runs) else None
        observation = _observation(decode(list(ids[after[1]:after[2]])), markers) if after else None
        if code_task:
            action, command = "answer", (commands[0] if commands else None)
        elif not own_parser:
            action, command = "reply", None
        else:
            parsed = parse_action(reply)
            if parsed.command is None:
                action, command = ("done" if parsed.done else "no_command"), None
            else:
                action = "command+done" if parsed.done else "command"
                command = commands[used] if used < len(commands) else None
                used += 1
        span = versions[start:end]
        turns.append(Turn(len(turns) + 1, reply, action, command, observation, end - start, (min(span), max(span))))
    if own_parser and not code_task and used != len(commands):
        raise ValueError(f"episode {row['episode_id']}: {used} replies hold a command but the row stores "
                         f"{len(commands)} commands: not a {harness} trajectory, or decoded with another tokenizer")
    return turns


def step_advantages(rows: Sequence[dict], scale_by_std: bool = False, baseline: str = "mean") -> dict[str, float]:
    """Episode id -> GRPO advantage as the trainer computes it for this step's rows (``GRPOTrainer.step``).

    Only rows that enter the gradient (``infra.train.trainer.eligible_rows``) get one; ``scale_by_std`` and
    ``baseline`` are the run's ``train`` settings (``infra.train.grpo.group_advantages``).

    Raises:
        ValueError: as ``group_advantages`` (a reward is not finite, an unknown baseline).
    """
    import numpy as np

    # torch loads with infra.train.grpo: only when advantages are asked for
    from infra.train.grpo import group_advantages
    from infra.train.trainer import eligible_rows

    trained = eligible_rows(list(rows))
    adv = group_advantages(np.array([r["reward"] for r in trained], dtype=np.float64),
                           [r["group_id"] for r in trained], scale_by_std=scale_by_std, baseline=baseline)
    return {r["episode_id"]: float(a) for r, a in zip(trained, adv, strict=True)}


def _outcome_order(outcomes) -> list[str]:
    present = set(outcomes)
    return [o for o in _OUTCOMES if o in present] + sorted(present - set(_OUTCOMES))


def choose_episodes(rows: Sequence[dict], limit: int = 12) -> list[tuple[str, dict]]:
    """The episodes that explain a step, each with why it was chosen: ``[(label, row)]``, at most ``limit``.

    For each outcome present (success, model_failure, infra_failure, unknown, then others by name): its
    best (highest reward) and worst (lowest reward) episode, one when they coincide; then, by task id,
    the best episode of each task not yet shown. Ties go to the smaller episode id.

    Raises:
        ValueError: ``limit`` < 1.
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    best = sorted(rows, key=lambda r: (-r["reward"], r["episode_id"]))
    worst = sorted(rows, key=lambda r: (r["reward"], r["episode_id"]))
    chosen: list[tuple[str, dict]] = []
    for outcome in _outcome_order(r["outcome"] for r in rows):
        n = sum(r["outcome"] == outcome for r in rows)
        hi = next(r for r in best if r["outcome"] == outcome)
        lo = next(r for r in worst if r["outcome"] == outcome)
        if hi is lo:
            alike = "the only" if n == 1 else f"all {n} alike,"
            chosen.append((f"{alike} {outcome} (reward {hi['reward']:.3f})", hi))
        else:
            chosen.append((f"best {outcome} of {n} (reward {hi['reward']:.3f})", hi))
            chosen.append((f"worst {outcome} of {n} (reward {lo['reward']:.3f})", lo))
    covered = {r["task_id"] for _, r in chosen}
    for task_id in sorted({r["task_id"] for r in rows} - covered):
        mine = [r for r in best if r["task_id"] == task_id]
        mean = sum(r["reward"] for r in mine) / len(mine)
        chosen.append((f"task {task_id}: best of its {len(mine)} (reward {mine[0]['reward']:.3f}, "
                       f"mean {mean:.3f})", mine[0]))
    return chosen[:limit]


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters when longer: the first 2/3 and last 1/3 of ``limit`` kept.

    Between them a line ``[... N characters cut ...]``; a text of at most ``limit`` comes back as is.
    """
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - limit} characters cut ...]\n{text[len(text) - tail:]}"


def fenced(text: str, info: str = "text") -> str:
    """A fenced code block holding ``text`` verbatim: the fence is longer than any backtick run inside."""
    longest = max((len(m) for m in _BACKTICKS.findall(text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{info}\n{text}{'' if text.endswith(chr(10)) else chr(10)}{fence}"


def inline(text: str) -> str:
    """``text`` as inline code, whatever backticks it holds (newlines become spaces)."""
    text = text.replace("\n", " ")
    fence = "`" * (max((len(m) for m in _BACKTICKS.findall(text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _versions(lo: int, hi: int) -> str:
    if lo < 0:
        return "none sampled"
    return f"v{lo}" if lo == hi else f"v{lo}..v{hi}"


def _egress_lines(row: dict) -> list[str]:
    """The header's egress line per phase that sent anything out (``infra.egress``): requests, bytes, hosts, denials."""
    out = []
    for phase, who in (("agent", "agent"), ("verifier", "tests")):
        n = row.get(f"egress_{phase}_requests", 0)
        if n:
            denied = row.get(f"egress_{phase}_denied") or []
            out.append(f"- **egress ({who})** {n} request{'s' if n != 1 else ''}, "
                       f"{row.get(f'egress_{phase}_bytes', 0) / 1e6:.2f} MB, to "
                       + ", ".join(inline(h) for h in row.get(f"egress_{phase}_hosts") or [])
                       + (f"; **denied** {', '.join(inline(h) for h in denied)}" if denied else ""))
    return out


def render_episode(row: dict, decode: Decode, advantage: float | None = None, harness: str = BashFenceHarness.name,
                   markers: ChatMarkers | None = None) -> str:
    """One episode as markdown, model text and outputs in fenced code blocks.

    A header (task, outcome, reason, reward, advantage, agent end, policy versions, harness, timings),
    the instruction (clipped), each turn's reply, command and output (clipped, the cut counted), then the
    verdict.

    ``advantage``: the row's GRPO advantage (:func:`step_advantages`); None: not trained, or not computed.

    Raises:
        ValueError: as :func:`decode_turns`.
    """
    turns = decode_turns(row, decode, markers, harness)
    adv = "n/a" if advantage is None else f"{advantage:+.3f}"
    plural = "" if row["num_turns"] == 1 else "s"
    out = [
        f"### Episode {inline(row['episode_id'])} · task {inline(row['task_id'])} · {row['outcome']}",
        "",
        f"- **outcome** {inline(row['outcome'])}, reason {inline(row['reason'])}; **reward** {row['reward']:.3f}, "
        f"**advantage** {adv}",
        f"- **agent end** {inline(row['agent_end'] or '-')} after {row['num_turns']} turn{plural} "
        f"(last stop: {row['stop_reason'] or '-'}); **harness** {harness}",
        f"- **policy versions** {_versions(row['min_policy_version'], row['max_policy_version'])}; "
        f"tokens {row['prompt_tokens']} prompt, {row['completion_tokens']} sampled",
        f"- **group** {inline(row['group_id'])} sample {row['sample_index']}, attempt {row['attempt']}; "
        f"step {row['step']}",
        f"- **timings** queue {row['queue_s']:.2f} s, sandbox {row['sandbox_acquire_s']:.2f} s, generation "
        f"{row['generation_s']:.2f} s, tools {row['tool_s']:.2f} s, verify {row['verify_s']:.2f} s",
        *_egress_lines(row),
        "",
    ]
    instruction = decode_instruction(row, decode, markers)
    shown = "" if len(instruction) <= INSTRUCTION_LIMIT_CHARS else f", clipped to {INSTRUCTION_LIMIT_CHARS}"
    out += [f"**Instruction** ({len(instruction)} characters{shown})", "",
            fenced(clip(instruction, INSTRUCTION_LIMIT_CHARS)), ""]
    if not turns:
        out += ["*No model turn in the trajectory.*", ""]
    for t in turns:
        out += [f"#### Turn {t.index} · {t.tokens} tokens · policy {_versions(*t.policy_versions)}", "",
                "**Reply**", "", fenced(clip(t.reply, REPLY_LIMIT_CHARS)), ""]
        if t.action == "answer":
            out += ["**Program verified**", "", fenced(t.command, "python") if t.command else "*none stored*", ""]
        elif t.command is not None:
            then = ", then DONE" if t.action == "command+done" else ""
            out += [f"**Command run**{then}", "", fenced(t.command, "bash"), ""]
        elif t.action != "reply":
            out += ["*DONE: the agent ended the episode.*" if t.action == "done"
                    else "*No command found: the harness answered with its format reminder.*", ""]
        if t.observation is not None:
            label = ("Output" if t.command is not None else
                     "Next request's new messages" if t.action == "reply" else "Harness reply")
            out += [f"**{label}** ({len(t.observation)} characters)", "",
                    fenced(clip(t.observation, OUTPUT_LIMIT_CHARS)), ""]
        elif t.command is not None and t.action != "answer":
            out += [f"*Its output is not in the trajectory: the episode ended after it "
                    f"(agent end {inline(row['agent_end'] or '-')}).*", ""]
    if turns and turns[0].action == "reply":
        shown = row["commands"][:COMMANDS_LIMIT]
        more = f", the first {COMMANDS_LIMIT} shown" if len(row["commands"]) > COMMANDS_LIMIT else ""
        out += [f"**Commands the harness ran in the sandbox** ({len(row['commands'])}{more})", "",
                fenced(clip("\n".join(shown), OUTPUT_LIMIT_CHARS), "bash") if shown else "*none*", ""]
    out += [f"**Verdict**: {inline(row['outcome'])}, reason {inline(row['reason'])}, reward {row['reward']:.3f}", ""]
    return "\n".join(out)


def render_step_episodes(rows: Sequence[dict], decode: Decode, harness: str = BashFenceHarness.name,
                         limit: int = 12, markers: ChatMarkers | None = None, scale_by_std: bool = False,
                         baseline: str = "mean") -> str:
    """A step's episodes as markdown: a title, one line per outcome, then the chosen episodes.

    Each outcome's line has its count and mean reward; then each of :func:`choose_episodes`'s episodes,
    with why it was chosen, as :func:`render_episode`.

    Advantages are :func:`step_advantages` over all ``rows`` (``scale_by_std``, ``baseline``: the run's).

    Raises:
        ValueError: ``rows`` is empty; ``limit`` < 1; as :func:`decode_turns`.
    """
    if not rows:
        raise ValueError("no trajectory rows to render")
    advantages = step_advantages(rows, scale_by_std, baseline)
    chosen = choose_episodes(rows, limit)
    steps = ", ".join(str(s) for s in sorted({r["step"] for r in rows}))
    runs = ", ".join(sorted({r["run_id"] for r in rows}))
    groups = len({r["group_id"] for r in rows})
    out = [f"## Episodes of step {steps} · run {inline(runs)}", "",
           f"{len(rows)} episodes in {groups} groups, {len(advantages)} in the gradient.", ""]
    for outcome in _outcome_order(r["outcome"] for r in rows):
        mine = [r["reward"] for r in rows if r["outcome"] == outcome]
        out.append(f"- **{outcome}**: {len(mine)} (mean reward {sum(mine) / len(mine):.3f})")
    out += ["", f"Showing {len(chosen)}: the best and worst of each outcome, then one per task not yet shown.", ""]
    for i, (label, row) in enumerate(chosen, 1):
        out += ["---", "", f"**{i}. Chosen: {label}**", "",
                render_episode(row, decode, advantages.get(row["episode_id"]), harness, markers)]
    return "\n".join(out)
