"""Does SmolLM2-135M answer in the built-in agent protocol? Two turns of look-then-act, no sandbox.

For each system prompt (the protocol's without and with its worked exchange, ``envs.agent.SYSTEM_PROMPT``)
and each instruction, samples ``--n`` first replies with the in-process vLLM engine, parses them as
the harness does (``envs.agent.parse_action``) and counts: replies holding a command (``fence``),
commands that read the named file (``look``); for those, it answers with the file's content as the
harness would and counts second commands that write the expected value to ``/app/answer.txt``
(``act``). No sandbox runs: ``look`` and ``act`` are string checks, an upper bound on what a real
episode passes. Needs no services.

Usage: ``python -m benchmarks.protocol_probe --n 32``
"""

from __future__ import annotations

import argparse
import os
import sys

# (instruction, file the agent should read, what the harness answers with, value the act must write)
INSTRUCTIONS = {
    "copy-word": ("Your working directory is /app. The file /app/word.txt holds one secret word. First look at it "
                  "(for example: cat /app/word.txt). Then write that word to /app/answer.txt (for example: echo "
                  "WORD > /app/answer.txt, with WORD replaced by the word you saw).", "word.txt", "marmalade",
                  "marmalade"),
    "copy-word-short": ("Read /app/word.txt with cat, then write the word it contains into /app/answer.txt.",
                        "word.txt", "marmalade", "marmalade"),
    "run-note": ("The file /app/note.txt contains a shell command. First print it: cat /app/note.txt\n"
                 "Then run the command it contains.", "note.txt", "echo 7391 > /app/answer.txt", "7391"),
    "run-note2": ("Step 1: run `cat /app/note.txt` to see the next command.\nStep 2: run the command you saw.",
                  "note.txt", "echo 7391 > /app/answer.txt", "7391"),
    "copy-num": ("Step 1: run `cat /app/code.txt` to see a number.\nStep 2: write that number into "
                 "/app/answer.txt with echo.", "code.txt", "7391", "7391"),
}


def main(argv: list[str] | None = None) -> int:
    """Sample, count and print one line per (system prompt, instruction)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32, help="first replies per instruction")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    from envs.agent import SYSTEM_PROMPT, parse_action
    from infra.model import prepare_smollm2

    plain = SYSTEM_PROMPT.split("\n\nExample:")[0]
    llm = LLM(model=str(prepare_smollm2()), dtype="float32", enforce_eager=True, max_model_len=2048, seed=0)
    params = SamplingParams(n=1, temperature=args.temperature, max_tokens=args.max_tokens)
    for name, system in (("without example", plain), ("with example", SYSTEM_PROMPT)):
        for key, (instruction, path, shown, value) in INSTRUCTIONS.items():
            chats = [[{"role": "system", "content": system}, {"role": "user", "content": instruction}]
                     for _ in range(args.n)]
            fence, second = 0, []
            for chat, out in zip(chats, llm.chat(chats, params, use_tqdm=False), strict=True):
                action = parse_action(out.outputs[0].text)
                fence += action.command is not None
                if action.command and path in action.command and "answer" not in action.command:
                    second.append(chat + [{"role": "assistant", "content": out.outputs[0].text},
                                          {"role": "user", "content": f"{shown}\n[exit code 0]"}])
            acted = 0
            for out in llm.chat(second, params, use_tqdm=False) if second else []:
                command = parse_action(out.outputs[0].text).command
                acted += bool(command and value in command and "answer.txt" in command)
            print(f"{name:16s} {key:16s} fence {fence}/{args.n} look {len(second)}/{args.n} "
                  f"act {acted}/{len(second)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
