"""The agent protocol and multi-turn token bookkeeping."""

from __future__ import annotations

import pytest

from envs.agent import observation, parse_action
from infra.rollout.chat_tokens import ChatTokens


def test_parse_action_command_done_and_neither():
    a = parse_action("I'll look.\n```bash\nls -la /app\n```")
    assert a.command == "ls -la /app" and not a.done
    assert parse_action("DONE").done and parse_action("DONE").command is None
    b = parse_action("```sh\necho hi > x\n```\nDONE")
    assert b.command == "echo hi > x" and b.done
    # a closing fence is not the opening of a new block; blocks in other languages are skipped
    d = parse_action("```ines\nfoo\n```\n\nSo this works\n```python\nprint(1)\n```\n```bash\npwd\n```")
    assert d.command == "pwd"
    assert parse_action("```ines\nfoo\n```\n\nSo this seems to work").command is None
    c = parse_action("I think we should list files")
    assert c.command is None and not c.done


def test_observation_reports_timeout_and_truncates():
    assert observation(0, "ok", False, 10).endswith("[exit code 0]")
    assert "killed after 10 s" in observation(137, "", True, 10)
    assert "[truncated]" in observation(0, "x" * 5000, False, 10)


def test_second_turn_prompt_is_first_turn_plus_sampled_plus_template(tiny_tokenizer):
    chat = ChatTokens(tiny_tokenizer)
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "do it"}]
    first = chat.prompt_ids(messages)
    # what the engine sampled, ending with the end-of-turn token (EOS), kept as ids
    sampled = tiny_tokenizer.encode("```bash\nls\n```", add_special_tokens=False) + [tiny_tokenizer.eos_token_id]
    cont = chat.continuation_ids(sampled, "a.txt\n[exit code 0]")
    second = first + sampled + cont
    # The rendered two-turn conversation is exactly what the ids spell out
    expected = tiny_tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": "```bash\nls\n```"},
         {"role": "user", "content": "a.txt\n[exit code 0]"}],
        tokenize=False, add_generation_prompt=True)
    assert tiny_tokenizer.decode(second) == expected
    # and the prompt of the second turn ends with the assistant header generation saw
    header = tiny_tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert second[-len(header):] == header
    # a turn cut by length (no EOS) gets the full closing
    cut = sampled[:-1]
    assert tiny_tokenizer.decode(first + cut + chat.continuation_ids(cut, "x")).count("<|im_end|>") == 4


def test_the_prompt_names_the_working_directory_it_is_given():
    from envs.agent import SYSTEM_PROMPT, initial_messages, system_prompt
    from envs.humaneval import load_humaneval
    from envs.task import Task

    assert "The working directory is /srv." in system_prompt("/srv") and "ls /srv\n" in system_prompt("/srv")
    assert SYSTEM_PROMPT == system_prompt("/app")
    task = Task(task_id="tb/x", instruction="do it")
    assert initial_messages(task, "/")[0]["content"] == system_prompt("/")
    with pytest.raises(ValueError, match="tb/x: acts in a sandbox"):
        initial_messages(task)
    code = load_humaneval(first=1)[0]  # answers once: no sandbox, no working directory
    assert initial_messages(code)[0]["content"] == "You are an expert Python programmer."
