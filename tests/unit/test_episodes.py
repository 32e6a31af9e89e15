"""The trajectory viewer (infra.episodes): turns, advantages, chosen episodes, markdown."""

from __future__ import annotations

import numpy as np
import pytest
from markdown_it import MarkdownIt

from envs.agent import FORMAT_REMINDER, SYSTEM_PROMPT, observation
from infra.episodes import (
    ChatMarkers,
    Turn,
    choose_episodes,
    clip,
    decode_instruction,
    decode_turns,
    fenced,
    inline,
    render_episode,
    render_step_episodes,
    step_advantages,
)
from infra.rollout.chat_tokens import ChatTokens
from infra.store import Trajectory, validate_rows
from infra.train.grpo import group_advantages


def decode(ids: list[int]) -> str:
    """The fake tokenizer: one character per id."""
    return "".join(map(chr, ids))


def make_row(segments: list[tuple[str, int | None]] | None = None, **fields) -> dict:
    """A valid trajectory row whose tokens are the characters of ``segments``: (text, policy version or
    None for prompt/observation text)."""
    segments = segments if segments is not None else [("P", None), ("DONE", 0)]
    ids, mask, versions = [], [], []
    for text, version in segments:
        ids += [ord(c) for c in text]
        mask += [0 if version is None else 1] * len(text)
        versions += [-1 if version is None else version] * len(text)
    sampled = [v for v in versions if v >= 0]
    row = Trajectory(
        run_id="r", step=3, episode_id="e0", task_id="t0", group_id="r/3/t0", sample_index=0, attempt=0,
        token_ids=ids, loss_mask=mask, rollout_logprobs=[-0.5 if m else 0.0 for m in mask], policy_versions=versions,
        min_policy_version=min(sampled, default=-1), max_policy_version=max(sampled, default=-1),
        prompt_tokens=len(segments[0][0]) if segments else 0, completion_tokens=sum(mask), reward=0.0,
        outcome="model_failure", reason="tests_failed", stop_reason="stop", agent_end="done",
        num_turns=sum(v is not None for _, v in segments), commands=[], image="img", image_digest="sha256:x",
        seed=1, temperature=1.0, top_p=1.0, max_tokens=64, queue_s=0.0, sandbox_acquire_s=0.5, generation_s=1.25,
        tool_s=0.75, verify_s=2.0, engine_replica="inproc", sandbox_id="s", sandbox_warm=False,
    ).row()
    row.update(fields)
    validate_rows([row])
    return row


def three_turns() -> dict:
    """Prompt, a command (v3), an observation, a reply with no command (v3..v4), the format reminder, then a
    command followed by DONE (v4) whose output is not in the trajectory."""
    return make_row([("Do it", None), ("```bash\nls\n```", 3), ("\nout1\n[exit code 0]\n", None),
                     ("hm", 3), ("m", 4), (FORMAT_REMINDER, None), ("```bash\ncat a\n```\nDONE", 4)],
                    commands=["ls", "cat a"])


def test_decode_turns_splits_prompt_replies_and_observations():
    row = three_turns()
    assert decode_instruction(row, decode) == "Do it"
    assert decode_turns(row, decode) == [
        Turn(1, "```bash\nls\n```", "command", "ls", "\nout1\n[exit code 0]\n", 14, (3, 3)),
        # the second reply's tokens came from two policy versions (3 for "hm", 4 for "m")
        Turn(2, "hmm", "no_command", None, FORMAT_REMINDER, 3, (3, 4)),
        Turn(3, "```bash\ncat a\n```\nDONE", "command+done", "cat a", None, 22, (4, 4)),
    ]


def test_decode_turns_done_code_task_and_empty_row():
    done = make_row([("P", None), ("All good.\nDONE", 2)])
    assert [(t.action, t.command, t.observation) for t in decode_turns(done, decode)] == [("done", None, None)]
    code = make_row([("P", None), ("```python\ndef f():\n    return 1\n```", 0)], agent_end="single_turn",
                    commands=["def f():\n    return 1"])
    (turn,) = decode_turns(code, decode)
    assert (turn.action, turn.command, turn.observation) == ("answer", "def f():\n    return 1", None)
    failed = make_row([], outcome="infra_failure", reason="sandbox_start", agent_end="")
    assert decode_turns(failed, decode) == [] and decode_instruction(failed, decode) == ""


def test_decode_turns_refuses_commands_that_do_not_match_the_replies():
    row = make_row([("P", None), ("```bash\nls\n```", 0)], commands=["ls", "pwd"])
    with pytest.raises(ValueError, match=r"episode e0: 1 replies hold a command but the row stores 2 commands"):
        decode_turns(row, decode)


def test_a_third_party_harness_turns_are_replies_and_its_commands_are_listed_apart():
    row = make_row([("P", None), ('{"commands": [{"keystrokes": "ls\\n"}]}', 0), ("New Terminal Output: a", None),
                    ('{"task_complete": true}', 0)], commands=["tmux send-keys -t t -- 'ls'", "tmux capture-pane -p"])
    turns = decode_turns(row, decode, harness="terminus-2")
    assert [(t.action, t.command) for t in turns] == [("reply", None), ("reply", None)]
    assert turns[0].observation == "New Terminal Output: a"
    md = render_episode(row, decode, harness="terminus-2")
    assert "**Commands the harness ran in the sandbox** (2)" in md and "tmux capture-pane -p" in md
    assert "No command found" not in md and "**Next request's new messages**" in md


def test_chat_markers_strip_the_template_of_a_real_tokenizer(tiny_tokenizer):
    chat = ChatTokens(tiny_tokenizer)
    tok = tiny_tokenizer
    prompt = chat.prompt_ids([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "do it"}])
    reply = tok.encode("```bash\nls\n```", add_special_tokens=False) + [tok.eos_token_id]
    obs = observation(0, "a.txt", False, 10.0)
    cont = chat.continuation_ids(reply, obs)
    cut = tok.encode("```bash\nls", add_special_tokens=False)  # stopped by length: no EOS, the full closing
    ids = prompt + reply + cont + cut
    mask = [0] * len(prompt) + [1] * len(reply) + [0] * len(cont) + [1] * len(cut)
    row = {"episode_id": "e", "agent_end": "max_turns", "commands": ["ls", "ls"], "token_ids": ids, "loss_mask": mask,
           "policy_versions": [1 if m else -1 for m in mask]}
    markers = ChatMarkers.of(tok)
    assert decode_instruction(row, tok.decode, markers) == "do it"
    t1, t2 = decode_turns(row, tok.decode, markers)
    assert (t1.reply, t1.command, t1.observation) == ("```bash\nls\n```", "ls", "a.txt\n[exit code 0]")
    assert (t2.reply, t2.command, t2.observation) == ("```bash\nls", "ls", None)
    # without markers the observation is shown raw, template tokens included
    assert decode_turns(row, tok.decode)[0].observation == "\n<|im_start|>user\na.txt\n[exit code 0]<|im_end|>\n" \
                                                          "<|im_start|>assistant\n"


def test_step_advantages_are_the_trainers():
    rows = [make_row(episode_id="a", group_id="g1", reward=1.0, outcome="success"),
            make_row(episode_id="b", group_id="g1", reward=0.0),
            make_row(episode_id="c", group_id="g1", reward=0.0),
            make_row(episode_id="d", group_id="g1", reward=0.0, outcome="infra_failure", reason="engine_unreachable"),
            make_row(episode_id="e", group_id="g2", reward=1.0, outcome="success"),
            make_row(episode_id="f", group_id="g2", reward=1.0, outcome="success")]
    adv = step_advantages(rows)
    # g1's trained rewards are 1, 0, 0 (the infra failure is left out): mean 1/3, so 2/3, -1/3, -1/3;
    # g2's are equal: 0
    assert adv == {"a": float(np.float32(2 / 3)), "b": float(np.float32(-1 / 3)), "c": float(np.float32(-1 / 3)),
                   "e": 0.0, "f": 0.0}
    trained = [r for r in rows if r["episode_id"] != "d"]
    expected = group_advantages(np.array([r["reward"] for r in trained]), [r["group_id"] for r in trained],
                                scale_by_std=True, baseline="leave_one_out")
    assert list(step_advantages(rows, scale_by_std=True, baseline="leave_one_out").values()) == expected.tolist()


def chosen_rows() -> list[dict]:
    spec = [("a", "t1", "success", 1.0), ("b", "t1", "success", 1.0), ("c", "t2", "model_failure", 0.5),
            ("d", "t2", "model_failure", 0.0), ("e", "t3", "infra_failure", 0.0), ("f", "t4", "model_failure", 0.0),
            ("g", "t5", "model_failure", 0.25)]
    return [make_row(episode_id=e, task_id=t, group_id=f"r/3/{t}", outcome=o, reward=r) for e, t, o, r in spec]


def test_choose_episodes_best_and_worst_per_outcome_then_one_per_task():
    rows = chosen_rows()
    expected = [
        ("all 2 alike, success (reward 1.000)", "a"),  # a and b tie at 1.0: the smaller id
        ("best model_failure of 4 (reward 0.500)", "c"),
        ("worst model_failure of 4 (reward 0.000)", "d"),  # d and f tie at 0.0: the smaller id
        ("the only infra_failure (reward 0.000)", "e"),
        ("task t4: best of its 1 (reward 0.000, mean 0.000)", "f"),  # t1..t3 are shown already
        ("task t5: best of its 1 (reward 0.250, mean 0.250)", "g"),
    ]
    assert [(label, r["episode_id"]) for label, r in choose_episodes(rows)] == expected
    assert [(label, r["episode_id"]) for label, r in choose_episodes(rows[::-1], limit=4)] == expected[:4]
    with pytest.raises(ValueError, match="limit must be >= 1"):
        choose_episodes(rows, limit=0)


def test_fences_and_inline_code_hold_backticks():
    assert fenced("a ```` b") == "`````text\na ```` b\n`````"
    assert fenced("x\n", "bash") == "```bash\nx\n```"
    assert inline("a`b") == "``a`b``" and inline("`x") == "`` `x ``"


def test_rendered_markdown_keeps_model_text_verbatim():
    reply = "Try:\n```bash\nls\n```\nnot ```` this"  # the model's own fence, and a longer backtick run
    row = make_row([("Do `it`", None), (reply, 2), ("\nfile ``` here\n", None)], commands=["ls"],
                   agent_end="max_turns")
    md = render_episode(row, decode, advantage=-0.25)
    assert "**advantage** -0.250" in md and "**harness** bash-fence" in md and "**policy versions** v2;" in md
    blocks = [(t.info, t.content) for t in MarkdownIt().parse(md) if t.type == "fence"]
    assert blocks == [("text", "Do `it`\n"), ("text", reply + "\n"), ("bash", "ls\n"), ("text", "\nfile ``` here\n")]


def test_long_outputs_are_clipped_and_the_cut_counted():
    assert clip("abcdefghij", 6) == "abcd\n[... 4 characters cut ...]\nij"  # first 4 (2/3 of 6), last 2
    assert clip("abc", 3) == "abc"
    row = make_row([("P", None), ("```bash\nseq 1 3000\n```", 0), ("x" * 3000, None), ("DONE", 0)],
                   commands=["seq 1 3000"])
    md = render_episode(row, decode)
    # 3000 characters against the 1500 limit: 1000 kept from the start, 500 from the end
    cut = f"{'x' * 1000}\n[... 1500 characters cut ...]\n{'x' * 500}"
    assert f"**Output** (3000 characters)\n\n```text\n{cut}\n```" in md
    assert "**advantage** n/a" in md and "*DONE: the agent ended the episode.*" in md


def test_render_step_episodes_title_counts_and_choices():
    md = render_step_episodes(chosen_rows(), decode, limit=2)
    head = md.split("\n---\n")[0]
    # 6 in the gradient: all but the infra failure; t2 (0.5, 0.0) is the one group whose rewards differ
    assert head == ("## Episodes of step 3 · run `r`\n\n7 episodes in 5 groups, 6 in the gradient.\n\n"
                    "- **success**: 2 (mean reward 1.000)\n- **model_failure**: 4 (mean reward 0.188)\n"
                    "- **infra_failure**: 1 (mean reward 0.000)\n\n"
                    "Showing 2: the best and worst of each outcome, then one per task not yet shown.\n")
    assert md.count("**1. Chosen: all 2 alike, success (reward 1.000)**") == 1
    assert "**2. Chosen: best model_failure of 4 (reward 0.500)**" in md and "**3." not in md
    assert "**advantage** +0.250" in md  # c: 0.5 - mean(0.5, 0.0)
    with pytest.raises(ValueError, match="no trajectory rows"):
        render_step_episodes([], decode)
