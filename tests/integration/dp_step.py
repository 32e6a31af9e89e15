"""One GRPO step as rank 0 of ``--world-size`` ranks on hand-built rows; writes the weights and metrics.

Run as its own process (a data-parallel group cannot share a pytest worker's torch.distributed state):
``python -m tests.integration.dp_step MODEL_DIR OUT_DIR --zero-stage 2 [--world-size 2 --master H:P]``.
``OUT_DIR`` gets ``weights.safetensors`` (the fp32 weights after the step), ``metrics.json`` and
``decisions.json``; ``--save-state``/``--load-state`` save after / restore before the step.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def hand_built_rows(tokenizer, seed: int = 0) -> list[dict]:
    """Nine rows: two groups with mixed rewards, one without signal, one infra failure; lengths 8..40."""
    import torch

    prompt = tokenizer.encode("<|im_start|>user\ndo it<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    gen = torch.Generator().manual_seed(seed)
    plan = [("a", 1.0), ("a", 0.0), ("a", 0.0), ("b", 0.0), ("b", 1.0), ("b", 1.0), ("c", 1.0), ("c", 1.0)]
    rows = []
    for i, (group, reward) in enumerate(plan):
        n = 8 + (i * 13) % 33
        sampled = torch.randint(5, 400, (n,), generator=gen).tolist()
        logprobs = (-3.0 - 4.0 * torch.rand(n, generator=gen)).tolist()
        rows.append({"token_ids": prompt + sampled, "loss_mask": [0] * len(prompt) + [1] * n,
                     "rollout_logprobs": [0.0] * len(prompt) + logprobs, "reward": reward, "group_id": group,
                     "outcome": "success" if reward else "model_failure", "stop_reason": "stop",
                     "episode_id": f"e{i}"})
    rows.append(dict(rows[0], outcome="infra_failure", reward=0.0, episode_id="e-infra"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--forward-dtype", default="float32")
    parser.add_argument("--micro-batch-rows", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--master", default=None)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--hold-s", type=float, default=0.0, help="sleep this long before the step")
    parser.add_argument("--rows-seed", type=int, default=0)
    parser.add_argument("--ray", action="store_true", help="start the other ranks as Ray actors (local Ray)")
    parser.add_argument("--load-state", type=Path, default=None, help="restore tag 's' from this folder first")
    parser.add_argument("--save-state", type=Path, default=None, help="save tag 's' to this folder after the step")
    a = parser.parse_args()
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from infra.train.ranks import RayRanks
    from infra.train.trainer import GRPOTrainer

    ranks = RayRanks(a.world_size, a.master, a.timeout_s) if a.ray else None
    trainer = GRPOTrainer(a.model_dir, lr=1e-3, zero_stage=a.zero_stage, grad_clip=1e9,
                          micro_batch_rows=a.micro_batch_rows, tis_cap=2.0, temperature=1.0, top_p=1.0, top_k=0,
                          scale_by_std=False, mask_truncated=False, max_seq_len=512, forward_dtype=a.forward_dtype,
                          divergence_threshold=5.0, world_size=a.world_size, master=a.master,
                          ranks_timeout_s=a.timeout_s)
    print("trainer built", flush=True)
    time.sleep(a.hold_s)
    if a.load_state:
        trainer.load_state(a.load_state, "s")
    metrics = trainer.step(hand_built_rows(AutoTokenizer.from_pretrained(a.model_dir), a.rows_seed))
    if a.save_state:
        trainer.save_state(a.save_state, "s")
    state = {k: v.contiguous() for k, v in trainer.fp32_state_dict().items()}
    a.out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(a.out_dir / "weights.safetensors"))
    (a.out_dir / "metrics.json").write_text(json.dumps(metrics))
    (a.out_dir / "decisions.json").write_text(json.dumps(trainer.last_row_decisions))
    trainer.close()
    if ranks is not None:
        (a.out_dir / "ray_ranks.json").write_text(json.dumps(ranks.close()))


if __name__ == "__main__":
    main()
