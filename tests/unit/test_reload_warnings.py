"""The reload-warning filter drops exactly vLLM's two expected "Failed to load weights" lines, only in its block;
the cast filter summarizes exactly the float32 -> serving dtype casts."""

from __future__ import annotations

import logging

import pytest

from infra.rollout.reload_warnings import (
    CAST_LOGGER,
    LAYERWISE_LOGGER,
    expected_casts_summarized,
    expected_reload_warnings_dropped,
)


def _passed(caplog, tied: bool | None, records: list[tuple[str, int, str, str]]) -> list[str]:
    """Log ``(logger, level, msg, arg)`` records (inside the filter's block unless ``tied`` is None); what came out."""
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        if tied is None:
            for name, level, msg, arg in records:
                logging.getLogger(name).log(level, msg, arg)
        else:
            with expected_reload_warnings_dropped(tied):
                for name, level, msg, arg in records:
                    logging.getLogger(name).log(level, msg, arg)
    return [r.getMessage() for r in caplog.records]


def test_drops_the_two_expected_warnings_and_passes_the_rest(caplog):
    w, fail = logging.WARNING, "%s: Failed to load weights"
    records = [(LAYERWISE_LOGGER, w, fail, "RotaryEmbedding"), (LAYERWISE_LOGGER, w, fail, "ParallelLMHead"),
               (LAYERWISE_LOGGER, w, fail, "LlamaMLP"),  # a layer that should have loaded: kept
               (LAYERWISE_LOGGER, w, "%s: Excessive loading", "RotaryEmbedding"),
               (LAYERWISE_LOGGER, logging.ERROR, fail, "RotaryEmbedding"),  # not the warning vLLM prints
               ("vllm.other", w, fail, "RotaryEmbedding")]  # another logger
    kept = ["LlamaMLP: Failed to load weights", "RotaryEmbedding: Excessive loading",
            "RotaryEmbedding: Failed to load weights", "RotaryEmbedding: Failed to load weights"]
    assert _passed(caplog, True, records) == kept
    # Untied: a head missing from the checkpoint keeps stale weights, so its warning shows.
    assert _passed(caplog, False, records) == ["ParallelLMHead: Failed to load weights", *kept]
    # Outside the block nothing is dropped.
    assert _passed(caplog, None, records) == [r[2] % r[3] for r in records]
    assert logging.getLogger(LAYERWISE_LOGGER).filters == []


def test_filter_removed_when_the_reload_raises():
    with pytest.raises(RuntimeError, match="reload failed"), expected_reload_warnings_dropped(True):
        raise RuntimeError("reload failed")
    assert logging.getLogger(LAYERWISE_LOGGER).filters == []


def test_casts_to_the_serving_dtype_are_one_line_and_other_casts_still_warn(caplog):
    import torch

    msg = "Attempted to load weight %s with dtype %s into parameter with dtype %s"
    cast = logging.getLogger(CAST_LOGGER)
    caplog.clear()
    with caplog.at_level(logging.INFO), expected_casts_summarized("torch.bfloat16"):
        for name in ("embed_tokens.weight", "layers.0.mlp.down_proj.weight"):
            cast.warning(msg, name, torch.float32, torch.bfloat16)  # the configured narrowing: summarized
        cast.warning(msg, "norm.weight", torch.float64, torch.bfloat16)  # another source dtype: kept
        cast.warning(msg, "norm.weight", torch.float32, torch.float16)  # another target dtype: kept
        cast.warning("something else %s", "x")
    out = [(r.name, r.getMessage()) for r in caplog.records]
    assert out == [(CAST_LOGGER, msg % ("norm.weight", torch.float64, torch.bfloat16)),
                   (CAST_LOGGER, msg % ("norm.weight", torch.float32, torch.float16)),
                   (CAST_LOGGER, "something else x"),
                   ("infra.rollout.reload_warnings",
                    "vLLM cast 2 float32 tensors to bfloat16 while loading (the serving precision)")]
    assert cast.filters == []


def test_no_cast_no_summary_line(caplog):
    caplog.clear()
    with caplog.at_level(logging.INFO), expected_casts_summarized("torch.float32"):
        pass
    assert caplog.records == []
