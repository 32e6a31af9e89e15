"""Numerical alignment between vLLM (CPU) and the trainer's forward, per precision pairing."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_fp32_pairing_agrees_and_bf16_pairings_do_not(tiny_model, tiny_tokenizer):
    from infra.train.mismatch import measure_mismatch

    text = "<|im_start|>user\nlist the files in /app please<|im_end|>\n<|im_start|>assistant\n```bash\nls -la /app\n```"
    seqs = [tiny_tokenizer.encode(text, add_special_tokens=False), list(range(5, 60))]
    table = {(r["engine_dtype"], r["trainer_dtype"]): r for r in measure_mismatch(str(tiny_model), seqs,
                                                                                   max_model_len=256)}
    assert len(table) == 4
    assert table["float32", "float32"]["tokens"] == sum(len(s) - 1 for s in seqs)
    assert table["float32", "float32"]["max_abs_diff"] < 1e-3  # same numbers up to kernel differences
    for pairing in (("float32", "bfloat16"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")):
        assert table[pairing]["mean_abs_diff"] > table["float32", "float32"]["mean_abs_diff"]


def test_sequence_length_checked():
    from infra.train.mismatch import measure_mismatch

    with pytest.raises(ValueError, match="sequence 0: length 1"):
        measure_mismatch("unused", [[1]])
