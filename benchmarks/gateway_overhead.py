"""The gateway's overhead per call against a direct engine call on the same prompts, one run, SmolLM2-135M.

Every side drives the same in-process vLLM engine with the same prompt ids, sampling parameters and
seeds, in rounds (so all see the same machine state):

- direct: ``engine.generate([SampleRequest(ids, ...)])``, the ids rendered once beforehand;
- gateway, once per wire format (OpenAI chat completions; OpenAI Responses, ``instructions`` and an
  ``input_text`` item; Anthropic Messages, ``system`` as its top-level field), over loopback HTTP
  (``httpx``) to the episode's endpoint: JSON parsing and validation, the format's translation,
  chat-template rendering, the engine call, the reply (and its JSON) back. The formats take turns going
  first.

Prints the median and p90 per-call wall time of each, their ratio (format / direct) and the gateway's
own time (translation, rendering, parsing, excluding the engine) per call. Each call is checked to have
sampled the same ids as the direct one (the same prompt ids reached the engine).

Usage: ``python -m benchmarks.gateway_overhead [--calls 24] [--max-tokens 32]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


class _Episode:
    """The gateway's episode side, minimal: every call samples on exactly the ids the gateway built."""

    def __init__(self, engine, max_tokens: int, seed: int):
        self.engine, self.max_tokens, self.seed = engine, max_tokens, seed
        self.max_model_len, self.model_name = engine.max_model_len, "policy"
        self.last = None

    def sample_ids(self, prompt_ids, extends, max_tokens, stop):
        from infra.rollout.engine import SampleRequest

        (s,) = self.engine.generate([SampleRequest(prompt_ids, self.max_tokens, 1.0, 1.0, self.seed, stop=stop)])
        self.last = s
        return s

    def exec_command(self, command, timeout_s, shell=True):
        return "no sandbox in this benchmark"

    def fail(self, reason):
        raise RuntimeError(reason)


def main(argv: list[str] | None = None) -> int:
    """Run the alternating pairs and print the medians and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--calls", type=int, default=24, help="pairs (direct, gateway)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results/gateway_overhead.json")
    args = parser.parse_args(argv)

    import httpx

    from envs.agent import SYSTEM_PROMPT
    from infra.model import resolve_model
    from infra.rollout.engine import SampleRequest, VLLMEngine
    from infra.rollout.gateway import Gateway

    model_dir = str(resolve_model(args.model))
    engine = VLLMEngine(model_dir, dtype="float32", max_model_len=2048, kv_cache_gib=1.0)
    gateway = Gateway(engine.tokenizer, tool_parser="")
    client = httpx.Client(timeout=120)

    def chat(endpoint, messages):
        return client.post(endpoint.base_url + "/chat/completions", json={"model": "policy", "messages": messages})

    def anthropic_messages(endpoint, messages):  # system as the top-level field, as Anthropic clients send it
        return client.post(endpoint.anthropic_base_url + "/v1/messages",
                           json={"model": "policy", "max_tokens": args.max_tokens, "system": messages[0]["content"],
                                 "messages": messages[1:]})

    def responses(endpoint, messages):  # instructions and input items, as Codex CLI sends them
        return client.post(endpoint.base_url + "/responses",
                           json={"model": "policy", "instructions": messages[0]["content"], "store": False,
                                 "input": [{"type": "message", "role": "user",
                                            "content": [{"type": "input_text", "text": messages[1]["content"]}]}]})

    formats = {"chat_completions": chat, "responses": responses, "anthropic_messages": anthropic_messages}
    wall = {name: [] for name in ("direct", *formats)}
    own = {name: [] for name in formats}
    same = dict.fromkeys(formats, 0)
    try:
        for i in range(args.calls + 2):  # the first two rounds warm up (not counted)
            messages = [{"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": f"Write the number {i} to /app/n.txt, then say DONE."}]
            ids = engine.tokenizer.encode(gateway.renderer.render(messages, None, True), add_special_tokens=False)
            t0 = time.perf_counter()
            (direct,) = engine.generate([SampleRequest(ids, args.max_tokens, 1.0, 1.0, 1000 + i)])
            if i >= 2:
                wall["direct"].append(time.perf_counter() - t0)
            order = list(formats)[i % len(formats):] + list(formats)[:i % len(formats)]  # each goes first in turn
            for name in order:
                ep = _Episode(engine, args.max_tokens, seed=1000 + i)
                endpoint = gateway.open(ep)
                own_before = gateway.overhead_s
                t1 = time.perf_counter()
                resp = formats[name](endpoint, messages)
                t2 = time.perf_counter()
                resp.raise_for_status()
                gateway.close(endpoint.key)
                if i >= 2:
                    wall[name].append(t2 - t1)
                    own[name].append(gateway.overhead_s - own_before)
                    same[name] += ep.last.token_ids == direct.token_ids
    finally:
        gateway.shutdown()
        engine.close()
    d = np.array(wall["direct"])
    result = {"model": args.model, "calls": args.calls, "max_tokens": args.max_tokens,
              "direct_median_ms": 1e3 * float(np.median(d)), "direct_p90_ms": 1e3 * float(np.quantile(d, 0.9))}
    print(f"direct             median {result['direct_median_ms']:.1f} ms  p90 {result['direct_p90_ms']:.1f} ms")
    for name in formats:
        g = np.array(wall[name])
        result[name] = {"median_ms": 1e3 * float(np.median(g)), "p90_ms": 1e3 * float(np.quantile(g, 0.9)),
                        "ratio_median": float(np.median(g) / np.median(d)),
                        "overhead_median_ms": 1e3 * float(np.median(g - d)),
                        "gateway_own_ms_per_call": 1e3 * float(np.mean(own[name])), "same_ids_pairs": same[name]}
        r = result[name]
        print(f"{name:18s} median {r['median_ms']:.1f} ms  p90 {r['p90_ms']:.1f} ms  ratio/direct "
              f"{r['ratio_median']:.3f}; overhead {r['overhead_median_ms']:.1f} ms per call, of which "
              f"translation/rendering/parsing {r['gateway_own_ms_per_call']:.1f} ms; same sampled ids in "
              f"{same[name]}/{args.calls}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
