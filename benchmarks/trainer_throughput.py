"""Trainer tokens/s: the DeepSpeed GRPO step against a plain PyTorch loop, same model, same batch, one run.

Both compute the same loss (hidden states, vocabulary projection at loss positions, TIS
policy-gradient loss, AdamW in fp32); the plain loop is the baseline measured in the same process,
and the ratio is what to read (the machine is shared and noisy).

Usage: ``python -m benchmarks.trainer_throughput [--model smollm2-135m] [--rows 8] [--tokens 256] [--steps 3]``
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def synthetic_rows(vocab: int, rows: int, tokens: int, seed: int = 0) -> list[dict]:
    """``rows`` episodes of ``tokens`` ids: the first quarter prompt, the rest sampled; alternating rewards."""
    rng = np.random.default_rng(seed)
    prompt = tokens // 4
    out = []
    for i in range(rows):
        out.append({"token_ids": rng.integers(10, vocab, tokens).tolist(),
                    "loss_mask": [0] * prompt + [1] * (tokens - prompt),
                    "rollout_logprobs": [0.0] * prompt + [-5.0] * (tokens - prompt),
                    "reward": float(i % 2), "group_id": f"g{i // 4}", "outcome": "model_failure",
                    "stop_reason": "stop"})
    return out


def plain_torch_steps(model_dir: str, rows: list[dict], micro_batch_rows: int, steps: int) -> list[float]:
    """Seconds per step of the same loss with a plain torch model and AdamW (no DeepSpeed)."""
    import torch
    from transformers import AutoModelForCausalLM

    from infra.train.grpo import group_advantages, tis_policy_loss, token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    adv = group_advantages(np.array([r["reward"] for r in rows]), [r["group_id"] for r in rows])
    total = sum(sum(r["loss_mask"][1:]) for r in rows)
    times = []
    for _ in range(steps):
        start = time.monotonic()
        for lo in range(0, len(rows), micro_batch_rows):
            batch = rows[lo: lo + micro_batch_rows]
            ids = torch.tensor([r["token_ids"] for r in batch])
            mask = torch.tensor([r["loss_mask"][1:] for r in batch], dtype=torch.float32)
            rollout = torch.tensor([r["rollout_logprobs"][1:] for r in batch])
            sel = mask.bool()
            hidden = model.get_decoder()(input_ids=ids).last_hidden_state
            lp = token_logprobs(model.get_output_embeddings()(hidden[:, :-1][sel]), ids[:, 1:][sel], 1.0)
            a = torch.from_numpy(adv[lo: lo + micro_batch_rows])[:, None].expand_as(mask)[sel]
            loss, _, _ = tis_policy_loss(lp, rollout[sel], a, mask[sel], total, 2.0)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.monotonic() - start)
    return times


def deepspeed_steps(model_dir: str, rows: list[dict], micro_batch_rows: int, steps: int,
                    zero_stage: int) -> list[float]:
    """Seconds per ``GRPOTrainer.step`` on the DeepSpeed engine."""
    from infra.train.trainer import GRPOTrainer

    trainer = GRPOTrainer(model_dir, lr=1e-6, zero_stage=zero_stage, grad_clip=1.0,
                          micro_batch_rows=micro_batch_rows, tis_cap=2.0, temperature=1.0, top_p=1.0, top_k=0,
                          scale_by_std=False, mask_truncated=False, max_seq_len=4096)
    times = []
    for _ in range(steps):
        start = time.monotonic()
        trainer.step(rows)
        times.append(time.monotonic() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    """Run both, print tokens/s and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--micro-batch-rows", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--zero-stage", type=int, default=2)
    args = parser.parse_args(argv)
    from transformers import AutoConfig

    from infra.model import resolve_model

    model_dir = str(resolve_model(args.model))
    rows = synthetic_rows(AutoConfig.from_pretrained(model_dir).vocab_size, args.rows, args.tokens)
    tokens = args.rows * args.tokens
    plain = plain_torch_steps(model_dir, rows, args.micro_batch_rows, args.steps + 1)[1:]
    ds = deepspeed_steps(model_dir, rows, args.micro_batch_rows, args.steps + 1, args.zero_stage)[1:]
    plain_tps, ds_tps = tokens / np.median(plain), tokens / np.median(ds)
    print(f"model {args.model}, {args.rows} rows x {args.tokens} tokens, micro-batch {args.micro_batch_rows}, "
          f"median of {args.steps} steps after warm-up")
    print(f"plain PyTorch AdamW:      {plain_tps:8.1f} tokens/s  (step {np.median(plain):.2f} s)")
    print(f"DeepSpeed ZeRO-{args.zero_stage} (gloo): {ds_tps:8.1f} tokens/s  (step {np.median(ds):.2f} s)")
    print(f"ratio DeepSpeed / plain:  {ds_tps / plain_tps:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
