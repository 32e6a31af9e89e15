"""The GRPO step on a real DeepSpeed engine (ZeRO-2, gloo, CPU) with the tiny Llama."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _no_group_left():
    """These tests leave their trainers open: end the process group they made, as ``GRPOTrainer.close`` would,
    so a later test in this worker (a trainer with another world size) starts its own."""
    yield
    import torch.distributed as dist
    from deepspeed.utils import groups

    if dist.is_initialized():
        groups._release_process_group_references(None)
        dist.destroy_process_group()


def _rows(tokenizer):
    prompt = tokenizer.encode("<|im_start|>user\ndo it<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    torch.manual_seed(0)
    rows = []
    for i, (group, reward) in enumerate([("a", 1.0), ("a", 0.0), ("b", 0.0), ("b", 1.0), ("a", 0.0)]):
        sampled = torch.randint(5, 400, (6 + i,)).tolist()
        rows.append({"token_ids": prompt + sampled, "loss_mask": [0] * len(prompt) + [1] * len(sampled),
                     "rollout_logprobs": [0.0] * len(prompt) + [-6.0] * len(sampled), "reward": reward,
                     "group_id": group, "outcome": "success" if reward else "model_failure", "stop_reason": "stop"})
    rows.append(dict(rows[0], outcome="infra_failure", reward=0.0))  # must be left out of the gradient
    return rows


def _trainer(model_dir, micro_batch_rows, zero_stage=2, forward_dtype="float32", temperature=1.0, top_p=1.0,
             top_k=0):
    from infra.train.trainer import GRPOTrainer

    return GRPOTrainer(str(model_dir), lr=1e-3, zero_stage=zero_stage, grad_clip=1e9,
                       micro_batch_rows=micro_batch_rows, tis_cap=2.0, temperature=temperature, top_p=top_p,
                       top_k=top_k, scale_by_std=False, mask_truncated=False, max_seq_len=512,
                       forward_dtype=forward_dtype)


def _param_change_norm(trainer, before: dict, after: dict) -> float:
    """||after - before|| over the trainable parameters, by name (a tied head counted once)."""
    names = [n for n, p in trainer.engine.module.named_parameters() if p.requires_grad]
    squares = (((after[n].detach().float() - before[n].detach().float()).double() ** 2).sum() for n in names)
    return float(sum(squares) ** 0.5)


def _assert_strict_export(trainer, out_dir):
    from transformers import AutoModelForCausalLM

    trainer.export(out_dir)
    model, info = AutoModelForCausalLM.from_pretrained(out_dir, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    return model


def test_step_excludes_infra_failures_and_is_invariant_to_micro_batching(tiny_model, tiny_tokenizer, tmp_path):
    rows = _rows(tiny_tokenizer)
    one = _trainer(tiny_model, micro_batch_rows=1)
    before = {k: v.clone() for k, v in one.engine.module.state_dict().items()}
    m1 = one.step(rows)
    after = one.engine.module.state_dict()
    assert m1["rows_trained"] == 5  # the infra_failure row is not trained on
    assert m1["loss_tokens"] == sum(6 + i for i in range(5))
    assert m1["grad_norm"] > 0 and any(not torch.equal(before[k], after[k]) for k in before)
    assert m1["update_norm"] > 0
    assert m1["update_norm"] == pytest.approx(_param_change_norm(one, before, after), rel=1e-6)
    m4 = _trainer(tiny_model, micro_batch_rows=4).step(rows)
    # same loss and gradient whether the step runs as 5 micro-batches of 1 row or 2 of up to 4
    assert m4["loss"] == pytest.approx(m1["loss"], rel=1e-4, abs=1e-7)
    assert m4["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-4)

    model = _assert_strict_export(one, tmp_path / "export")
    torch.testing.assert_close(model.model.embed_tokens.weight, after["model.embed_tokens.weight"])


def test_step_without_signal_does_not_move_weights(tiny_model, tiny_tokenizer):
    rows = [dict(r, reward=0.0, outcome="model_failure") for r in _rows(tiny_tokenizer)]
    trainer = _trainer(tiny_model, micro_batch_rows=2)
    before = {k: v.clone() for k, v in trainer.engine.module.state_dict().items()}
    m = trainer.step(rows)
    assert (m["rows_with_signal"], m["optimizer_step"], m["loss"], m["update_norm"]) == (0.0, 0.0, 0.0, 0.0)
    assert m["logprob_abs_diff"] > 0  # metrics still computed on every eligible row
    after = trainer.engine.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(("zero_stage", "forward_dtype"), [(1, "float32"), (3, "float32"), (2, "bfloat16")])
def test_zero_stages_and_bf16_train_and_export_fp32(tiny_model, tiny_tokenizer, tmp_path, zero_stage, forward_dtype):
    trainer = _trainer(tiny_model, micro_batch_rows=2, zero_stage=zero_stage, forward_dtype=forward_dtype)
    fp32_before = trainer.fp32_state_dict()
    m = trainer.step(_rows(tiny_tokenizer))
    assert m["optimizer_step"] == 1.0 and m["grad_norm"] > 0 and m["loss"] == m["loss"]
    # the fp32 master weights moved by update_norm (not the bf16 module copy; ZeRO-3 partitions gathered)
    assert m["update_norm"] == pytest.approx(_param_change_norm(trainer, fp32_before, trainer.fp32_state_dict()),
                                             rel=1e-5)
    if forward_dtype == "bfloat16":
        assert next(trainer.engine.module.parameters()).dtype == torch.bfloat16
        assert m["logprob_abs_diff"] > 1e-4  # bf16 forward differs from the fp32 numbers
    model = _assert_strict_export(trainer, tmp_path / "export")
    assert model.dtype == torch.float32
    initial = _trainer_free_weights(tiny_model)
    assert not torch.equal(model.model.embed_tokens.weight, initial)  # the update reached the export


def _trainer_free_weights(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).model.embed_tokens.weight


def test_save_and_resume_is_exact(tiny_model, tiny_tokenizer, tmp_path):
    rows = _rows(tiny_tokenizer)
    batch_b = [dict(r, reward=1.0 - r["reward"]) for r in rows]
    first = _trainer(tiny_model, micro_batch_rows=3)
    first.step(rows)
    first.save_state(tmp_path / "state", tag="step-1")
    expected = first.step(batch_b)
    resumed = _trainer(tiny_model, micro_batch_rows=3)
    resumed.load_state(tmp_path / "state", tag="step-1")
    got = resumed.step(batch_b)
    assert got["loss"] == expected["loss"] and got["grad_norm"] == expected["grad_norm"]
    a, b = first.fp32_state_dict(), resumed.fp32_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # optimizer moments were restored too
    with pytest.raises(FileNotFoundError, match="no trainer state"):
        resumed.load_state(tmp_path / "state", tag="step-9")


def test_divergence_beyond_threshold_drops_the_row_and_records_the_decision(tiny_model, tiny_tokenizer):
    from infra.train.trainer import GRPOTrainer

    rows = _rows(tiny_tokenizer)[:4]
    rows = [dict(r, episode_id=f"e{i}") for i, r in enumerate(rows)]
    # Row 0: the behaviour policy was near-certain of tokens the current policy finds unlikely (random
    # tokens, logprob about -6 under the tiny model): k1 = mean(lp_rollout - lp_trainer) about 6. Row 1:
    # unknown (NaN) behaviour logprobs: neutral, k = 0, kept.
    rows[0]["rollout_logprobs"] = [0.0 if m == 0 else -0.01 for m in rows[0]["loss_mask"]]
    rows[1]["rollout_logprobs"] = [0.0 if m == 0 else float("nan") for m in rows[1]["loss_mask"]]
    trainer = GRPOTrainer(str(tiny_model), lr=1e-3, zero_stage=2, grad_clip=1e9, micro_batch_rows=2, tis_cap=2.0,
                          temperature=1.0, top_p=1.0, top_k=0, scale_by_std=False, mask_truncated=False,
                          max_seq_len=512, divergence_threshold=3.0, divergence_estimator="k1",
                          divergence_action="drop")
    m = trainer.step(rows)
    by_id = {d["episode_id"]: d for d in trainer.last_row_decisions}
    assert set(by_id) == {"e0", "e1", "e2", "e3"}
    assert by_id["e0"]["decision"] == "drop" and by_id["e0"]["weight"] == 0.0 and by_id["e0"]["kl_k1"] > 3.0
    assert by_id["e1"]["decision"] == "keep" and by_id["e1"]["known_tokens"] == 0 and by_id["e1"]["kl_k3"] == 0.0
    assert m["rows_dropped_divergence"] == 1.0 and m["rows_downweighted_divergence"] == 0.0
    with pytest.raises(ValueError, match="zero_stage 0 with forward_dtype 'bfloat16'"):
        _trainer(tiny_model, micro_batch_rows=2, zero_stage=0, forward_dtype="bfloat16")
    with pytest.raises(ValueError, match="divergence estimator"):
        GRPOTrainer(str(tiny_model), lr=1e-3, zero_stage=2, grad_clip=1e9, micro_batch_rows=2, tis_cap=2.0,
                    temperature=1.0, top_p=1.0, top_k=0, scale_by_std=False, mask_truncated=False, max_seq_len=512,
                    divergence_estimator="k2")


def _truncated_rows(model_dir, tokenizer, temperature, top_k, top_p):
    """Rows sampled from the tiny model's truncated distribution, with its logprobs as the rollout's."""
    from transformers import AutoModelForCausalLM

    from infra.train.grpo import kept_tokens, sampling_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = tokenizer.encode("<|im_start|>user\ndo it<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i, (group, reward) in enumerate([("a", 1.0), ("a", 0.0), ("b", 0.0), ("b", 1.0)]):
        ids, lps = list(prompt), []
        for _ in range(5 + i):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            z = logits / temperature
            probs = z.masked_fill(~kept_tokens(z, top_k, top_p), -float("inf")).softmax(-1)
            tok = int(torch.multinomial(probs, 1, generator=gen))
            ids.append(tok)
            lps.append(float(sampling_logprobs(logits, torch.tensor(tok), temperature, top_k, top_p)[0]))
        rows.append({"token_ids": ids, "loss_mask": [0] * len(prompt) + [1] * len(lps),
                     "rollout_logprobs": [0.0] * len(prompt) + lps, "reward": reward, "group_id": group,
                     "outcome": "success" if reward else "model_failure", "stop_reason": "stop"})
    return rows, model


@pytest.mark.parametrize(("top_k", "top_p"), [(20, 1.0), (0, 0.5), (20, 0.7)])
def test_truncated_sampling_ratio_is_one_at_unchanged_weights(tiny_model, tiny_tokenizer, top_k, top_p):
    rows, _ = _truncated_rows(tiny_model, tiny_tokenizer, 0.8, top_k, top_p)
    m = _trainer(tiny_model, micro_batch_rows=2, temperature=0.8, top_k=top_k, top_p=top_p).step(rows)
    assert m["unkept_frac"] == 0.0 and m["logprob_abs_diff"] < 1e-5
    assert m["ratio_p05"] == pytest.approx(1.0, abs=1e-5) and m["ratio_p95"] == pytest.approx(1.0, abs=1e-5)
    # the full-vocabulary trainer (the old behaviour) sees every ratio biased by the kept mass
    full = _trainer(tiny_model, micro_batch_rows=2, temperature=0.8).step(rows)
    assert full["ratio_p95"] < 0.999 and full["logprob_abs_diff"] > 1e-3


def test_token_outside_the_kept_set_is_counted_and_trains_finitely(tiny_model, tiny_tokenizer):
    from infra.train.grpo import kept_tokens

    rows, model = _truncated_rows(tiny_model, tiny_tokenizer, 1.0, 5, 1.0)
    ids = rows[0]["token_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0, -1]
    ids[-1] = int((~kept_tokens(logits, 5, 1.0)).nonzero()[0])  # a token top-k = 5 cannot sample
    rows[0]["rollout_logprobs"][-1] = -1.0  # as if sampled by a rollout policy that differs
    m = _trainer(tiny_model, micro_batch_rows=2, top_k=5).step(rows)
    total = sum(sum(r["loss_mask"]) for r in rows)
    assert m["unkept_frac"] == pytest.approx(1 / total)
    assert m["loss"] == m["loss"] and m["grad_norm"] > 0 and m["update_norm"] > 0  # finite, and it trained
    assert m["logprob_abs_diff"] < 1e-5  # the other tokens still match exactly


def test_close_ends_the_group_the_trainer_started_and_restores_its_environment(tiny_model, monkeypatch):
    """So a later trainer in this process may have another world size (a 2-rank run after a 1-rank one)."""
    import os

    import torch.distributed as dist

    for key in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert not dist.is_initialized()
    trainer = _trainer(tiny_model, micro_batch_rows=2)
    assert dist.get_world_size() == 1 and os.environ["WORLD_SIZE"] == "1"
    trainer.close()
    assert not dist.is_initialized()
    assert not {"RANK", "WORLD_SIZE", "MASTER_PORT"} & set(os.environ)


def test_mismatch_at_lag_0_is_reported_apart_from_the_lagged_tokens(tiny_model, tiny_tokenizer):
    """Rows sampled by the trainer's own version (lag 0) match it exactly; lagged rows (here: rollout logprobs
    0.5 off) raise ``logprob_abs_diff`` but not ``logprob_abs_diff_lag0``."""
    rows, _ = _truncated_rows(tiny_model, tiny_tokenizer, 0.8, 20, 1.0)
    for n, r in enumerate(rows):
        version = 3 if n % 2 else 2  # the trainer holds v3
        r["policy_versions"] = [-1 if not m else version for m in r["loss_mask"]]
        if version == 2:
            r["rollout_logprobs"] = [lp - 0.5 if m else lp for lp, m in zip(r["rollout_logprobs"], r["loss_mask"],
                                                                             strict=True)]
    current = sum(sum(r["loss_mask"]) for n, r in enumerate(rows) if n % 2)
    m = _trainer(tiny_model, micro_batch_rows=2, temperature=0.8, top_k=20).step(rows, policy_version=3)
    assert m["logprob_abs_diff_lag0"] < 1e-5 and m["logprob_abs_diff"] > 0.1
    assert m["lag0_token_frac"] == pytest.approx(current / sum(sum(r["loss_mask"]) for r in rows))
    unknown = _trainer(tiny_model, micro_batch_rows=2, temperature=0.8, top_k=20).step(rows)
    assert unknown["lag0_token_frac"] == 0.0 and unknown["logprob_abs_diff_lag0"] == 0.0
