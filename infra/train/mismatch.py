"""Numerical alignment: vLLM against trainer logprobs on the same tokens, per precision pairing.

``measure_mismatch`` scores the same token sequences with the rollout engine (vLLM prompt
logprobs) and with the trainer's model (transformers forward), each in float32 and bfloat16, and
reports for every (engine dtype, trainer dtype) pairing the mean and max absolute logprob
difference, the k3 KL estimate (Schulman 2020) and ratio quantiles. Both sides score at
temperature 1 (raw logits), so the figure isolates the numerics of the two forward passes.

CLI: ``python -m infra.train.mismatch --model smollm2-135m --sequences 8`` prints the table.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import numpy as np

DTYPES = ("float32", "bfloat16")


def engine_logprobs(model_dir: str, sequences: list[list[int]], dtype: str, max_model_len: int = 2048,
                    kv_cache_gib: int = 1) -> list[np.ndarray]:
    """Logprob the vLLM engine gives every token after the first: per sequence, shape ``(len - 1,)`` float64.

    Starts a vLLM engine in this process and releases it before returning.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, max_model_len=max_model_len, seed=0,
              enable_prefix_caching=False)
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences],
                            SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False)
        return [np.array([step[tok].logprob for tok, step in zip(seq[1:], out.prompt_logprobs[1:], strict=True)])
                for seq, out in zip(sequences, outs, strict=True)]
    finally:
        del llm
        gc.collect()


def trainer_logprobs(model_dir: str, sequences: list[list[int]], dtype: str) -> list[np.ndarray]:
    """The trainer model's logprob of every token after the first (forward in ``dtype``, log-softmax in fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from infra.train.grpo import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    result = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            logits = model(input_ids=ids).logits[0, :-1]
            result.append(token_logprobs(logits, ids[0, 1:], 1.0).double().numpy())
    return result


def compare(engine: list[np.ndarray], trainer: list[np.ndarray]) -> dict[str, float]:
    """Mismatch statistics over all positions: mean/max |Δ|, k3 KL(engine || trainer), ratio p05/p95."""
    e, t = np.concatenate(engine), np.concatenate(trainer)
    log_ratio = t - e  # log pi_trainer / pi_engine on tokens scored by both
    ratio = np.exp(log_ratio)
    return {"tokens": float(e.size), "mean_abs_diff": float(np.abs(log_ratio).mean()),
            "max_abs_diff": float(np.abs(log_ratio).max()), "kl_k3": float(np.mean(ratio - 1 - log_ratio)),
            "ratio_p05": float(np.quantile(ratio, 0.05)), "ratio_p95": float(np.quantile(ratio, 0.95))}


def measure_mismatch(model_dir: str, sequences: list[list[int]], dtypes: tuple[str, ...] = DTYPES,
                     max_model_len: int = 2048) -> list[dict]:
    """Compare engine and trainer logprobs for every precision pairing.

    Args:
        model_dir: HF model folder.
        sequences: token id lists (at least 2 tokens each).
        dtypes: precisions to try on each side.
        max_model_len: engine context length (>= the longest sequence + 1).

    Returns:
        One dict per pairing: ``engine_dtype``, ``trainer_dtype`` and :func:`compare`'s statistics.

    Raises:
        ValueError: a sequence shorter than 2 tokens or longer than ``max_model_len - 1``.
    """
    for i, s in enumerate(sequences):
        if not 2 <= len(s) < max_model_len:
            raise ValueError(f"sequence {i}: length {len(s)} not in [2, {max_model_len})")
    engine = {d: engine_logprobs(model_dir, sequences, d, max_model_len) for d in dtypes}
    trainer = {d: trainer_logprobs(model_dir, sequences, d) for d in dtypes}
    return [{"engine_dtype": ed, "trainer_dtype": td, **compare(engine[ed], trainer[td])}
            for ed in dtypes for td in dtypes]


def _sample_sequences(model_dir: str, count: int, max_tokens: int) -> list[list[int]]:
    """Real sequences to score: HumanEval prompts in chat form plus an fp32 vLLM completion."""
    from envs.agent import initial_messages
    from envs.humaneval import load_humaneval
    from infra.rollout.chat_tokens import ChatTokens
    from infra.rollout.engine import SampleRequest, VLLMEngine

    engine = VLLMEngine(model_dir, dtype="float32", max_model_len=2048, kv_cache_gib=1)
    chat = ChatTokens(engine.tokenizer)
    prompts = [chat.prompt_ids(initial_messages(t)) for t in load_humaneval(first=count)]
    samples = engine.generate([SampleRequest(p, max_tokens, 1.0, 1.0, i) for i, p in enumerate(prompts)])
    del engine
    gc.collect()
    return [p + s.token_ids for p, s in zip(prompts, samples, strict=True)]


def main(argv: list[str] | None = None) -> int:
    """Print the mismatch table for a model."""
    parser = argparse.ArgumentParser(description="vLLM vs trainer logprob mismatch per precision pairing")
    parser.add_argument("--model", default="smollm2-135m", help="HF folder or 'smollm2-135m'")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    from infra.model import resolve_model

    model_dir = str(resolve_model(args.model))
    rows = measure_mismatch(model_dir, _sample_sequences(model_dir, args.sequences, args.max_tokens))
    print("| engine | trainer | tokens | mean abs Δlogprob | max abs Δ | KL k3 | ratio p05 | ratio p95 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['engine_dtype']} | {r['trainer_dtype']} | {r['tokens']:.0f} | {r['mean_abs_diff']:.2e} | "
              f"{r['max_abs_diff']:.2e} | {r['kl_k3']:.2e} | {r['ratio_p05']:.3f} | {r['ratio_p95']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
