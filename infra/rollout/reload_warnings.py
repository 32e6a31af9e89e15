"""The two warnings every weight reload of a tied-embedding model prints, why they are expected, and a filter.

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
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
"""The vLLM logger that prints the warnings (``init_logger(__name__)`` of ``reload/layerwise.py``)."""


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
    logger = logging.getLogger(LAYERWISE_LOGGER)
    drop = ExpectedReloadWarnings(tied_lm_head)
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)
