"""The warnings every weight load prints that are expected, why, and filters for them.

vLLM 0.32's layerwise reload (``vllm/model_executor/model_loader/reload/layerwise.py:266``, in
``finalize_layerwise_processing``) logs ``"<Layer>: Failed to load weights"`` for a layer that has
tensors but got none from the checkpoint, and puts that layer's previous tensors back. A reload of
SmolLM2 (or the tiny test Llama) names two layers:

- ``RotaryEmbedding``: its only tensor is the non-persistent ``cos_sin_cache`` buffer, computed
  from the config when the model is built (``rotary_embedding/base.py:63``) and never in a
  checkpoint. Keeping it is right.
- ``ParallelLMHead`` of a tied model: its ``weight`` is the embedding's Parameter (``tie_weights``,
  ``vocab_parallel_embedding.py:91``); the loader fills it once through ``model.embed_tokens`` and
  skips ``lm_head.weight`` as its alias (``AutoWeightsLoader``, ``models/utils.py:202,291``), so the
  head has the new values. What is not redone is the head's CPU GEMM pack:
  :func:`infra.rollout.engine._repack_tied_lm_head` does that, and every reload of ours calls it.

Measured on SmolLM2-135M (CPU, fp32; a checkpoint with perturbed embeddings): after
``load_weights`` the head is the embedding Parameter and equals the checkpoint's
``model.embed_tokens.weight``, the rotary cache equals the one before and one recomputed from the
config, and sampled logprobs match HF transformers on the checkpoint within 1.3e-5. The stock
``reload_weights`` without the repack was off by 21.5 nats; after the repack, 1.7e-5. So with the
repack both warnings are noise; without it the head's warning is real. The filter drops them only
around our reload-and-repack, and the head's only when the model ties it (an untied head missing
from a checkpoint keeps stale weights, and that warning must show).

Casts to the serving precision. vLLM 0.32's ``AutoWeightsLoader._load_param`` (``models/utils.py:324``)
warns once per tensor, "Attempted to load weight W with dtype torch.float32 into parameter with dtype
torch.bfloat16", whenever a checkpoint's dtype is narrowed to the parameter's; it then casts
(``default_weight_loader``: ``param.data.copy_``). Serving in bf16 from the fp32 trainer's checkpoints is
a configured choice (``model.serving_dtype``; its mismatch is measured and corrected by TIS), so every
load printed 122 of these lines (SmolLM2-135M; 3 loads, 366 lines, in the quickstart). :func:`expected_casts_summarized`
drops exactly float32 -> the serving dtype and logs one line with the count; any other narrowing still warns.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
"""The vLLM logger that prints the warnings (``init_logger(__name__)`` of ``reload/layerwise.py``)."""
CAST_LOGGER = "vllm.model_executor.models.utils"
"""The vLLM logger of ``AutoWeightsLoader``'s per-tensor dtype warning."""
_CAST_MESSAGE = "Attempted to load weight %s with dtype %s into parameter with dtype %s"
log = logging.getLogger(__name__)


class ExpectedReloadWarnings(logging.Filter):
    """Drops ``RotaryEmbedding: Failed to load weights`` (and, tied, ``ParallelLMHead: ...``); passes the rest."""

    def __init__(self, tied_lm_head: bool):
        super().__init__()
        layers = ("RotaryEmbedding", "ParallelLMHead") if tied_lm_head else ("RotaryEmbedding",)
        self.messages = frozenset(f"{layer}: Failed to load weights" for layer in layers)

    def filter(self, record: logging.LogRecord) -> bool:
        """False for exactly the expected messages of :data:`LAYERWISE_LOGGER` at WARNING."""
        expected = (record.name == LAYERWISE_LOGGER and record.levelno == logging.WARNING
                    and record.getMessage() in self.messages)
        return not expected


@contextmanager
def expected_reload_warnings_dropped(tied_lm_head: bool) -> Iterator[None]:
    """Within the block, :class:`ExpectedReloadWarnings` sits on :data:`LAYERWISE_LOGGER` (this process only).

    Wrap a ``reload_weights`` that is followed by :func:`~infra.rollout.engine._repack_tied_lm_head`
    (see the module docstring); ``tied_lm_head``: the model's ``tie_word_embeddings``.
    """
    with _filtered(LAYERWISE_LOGGER, ExpectedReloadWarnings(tied_lm_head)):
        yield


@contextmanager
def _filtered(logger_name: str, drop: logging.Filter) -> Iterator[None]:
    """``drop`` on the logger ``logger_name`` within the block, removed after it (also on an exception)."""
    logger = logging.getLogger(logger_name)
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


class ExpectedCasts(logging.Filter):
    """Drops (and counts) :data:`CAST_LOGGER`'s warning for a float32 tensor loaded into a ``param_dtype`` parameter."""

    def __init__(self, param_dtype: str):
        super().__init__()
        self.param_dtype, self.dropped = param_dtype, 0

    def filter(self, record: logging.LogRecord) -> bool:
        """False for exactly float32 -> ``param_dtype`` casts (as torch prints a dtype: ``torch.bfloat16``)."""
        args = record.args if isinstance(record.args, tuple) else ()
        expected = (record.name == CAST_LOGGER and record.levelno == logging.WARNING and record.msg == _CAST_MESSAGE
                    and len(args) == 3 and str(args[1]) == "torch.float32" and str(args[2]) == self.param_dtype)
        self.dropped += expected
        return not expected


@contextmanager
def expected_casts_summarized(param_dtype: str) -> Iterator[None]:
    """Within the block, :class:`ExpectedCasts` sits on :data:`CAST_LOGGER` (this process only).

    After it, one INFO line says how many float32 tensors were cast to ``param_dtype`` (``"torch.bfloat16"``).
    """
    drop = ExpectedCasts(param_dtype)
    try:
        with _filtered(CAST_LOGGER, drop):
            yield
    finally:
        if drop.dropped:
            log.info("vLLM cast %d float32 tensors to %s while loading (the serving precision)", drop.dropped,
                     param_dtype.removeprefix("torch."))
