"""Deployable flow: evaluate a published checkpoint on the held-out tasks, in the serving precision.

``python -m flows.evaluate --config configs/quickstart.toml [--version N] [--force]`` or the
``evaluate`` deployment. The serving-precision report goes beside the checkpoint (``…/vN/eval.json``)
and is reused while the serving dtype and the eval settings are unchanged; a change of either
re-evaluates (a report of an earlier serving dtype is kept as ``eval-served-{dtype}.json``). An
evaluation in another precision is refused unless ``eval.allow_precision_mismatch``; it is then
marked ``precision_mismatch`` and stored apart, as ``…/vN/eval-{dtype}-not-serving.json``.
"""

from __future__ import annotations

import json
import sys

from prefect import flow, get_run_logger

from flows.naming import flow_run_name, tagged
from infra.checkpoint import published_versions
from infra.config import RunConfig
from infra.config_record import check as check_config
from infra.evaluate import eval_precision
from infra.run import Run
from tasks.evaluate import eval_settings
from tasks.evaluate import evaluate as evaluate_task
from tasks.lineage import as_asset

DEFAULT_CONFIG = RunConfig()
EVAL_MAY_CHANGE = ("eval", "model.serving_dtype")
"""Config fields an evaluation of a stored run may set otherwise than the run did (its report says how)."""


@flow(name="evaluate", flow_run_name=flow_run_name, log_prints=True)
def evaluate(config: RunConfig = DEFAULT_CONFIG, version: int | None = None, force: bool = False,
             allow_config_change: bool = False) -> dict:
    """pass@k of checkpoint ``version`` (default: newest published) with the serving engine and dtype.

    Returns the report; ``reevaluated_because`` says why an existing report was replaced, and
    ``reused: true`` marks a stored report returned as is (same dtype and settings; ``force``
    re-evaluates anyway).

    Args:
        config: the run config (the form's defaults are the deployment's config; its run_id names the run).
        version: the checkpoint version to evaluate (default: the newest published).
        force: re-evaluate even when a report with the same dtype and settings is stored.
        allow_config_change: evaluate although the run's stored config differs outside ``eval`` and
            ``model.serving_dtype`` (which an evaluation may set otherwise).

    Raises:
        PrecisionMismatch: ``eval.dtype`` is not the serving dtype and the mismatch is not allowed
            (checked before anything loads).
        ValueError: the run has no published checkpoint, or not that version.
        CheckpointError: the checkpoint fails verification against its manifest (nothing is evaluated).
    """
    dtype, mismatch = eval_precision(config.model.serving_dtype, config.eval.dtype,
                                     config.eval.allow_precision_mismatch)
    with tagged(config), Run.open(config, model=False) as run:
        check_config(run.fs, config, allow_config_change, ignore=EVAL_MAY_CHANGE)
        versions = published_versions(run.fs, run.layout)
        if not versions or (version is not None and version not in versions):
            raise ValueError(f"run {config.run_id}: checkpoint version {version} not published (have {versions})")
        version = version if version is not None else versions[-1]
        layout = run.layout
        ckpt, report_uri = layout.checkpoint(version), layout.eval_report(version, dtype, mismatch)
        reason = ""
        run.fs.invalidate_cache()
        if run.fs.exists(report_uri):
            stored = json.loads(run.fs.cat_file(report_uri))
            same = (stored.get("dtype") == dtype and stored.get("settings") == eval_settings(config)
                    and stored.get("version") == version)
            if same and not force:
                print(f"{report_uri}: up to date ({dtype}, same settings); not re-evaluated")
                return {**stored, "reused": True}
            reason = ("forced" if same else f"dtype {stored.get('dtype')} -> {dtype}" if stored.get("dtype") != dtype
                      else f"version {stored.get('version')} -> {version}" if stored.get("version") != version
                      else f"settings {stored.get('settings')} -> {eval_settings(config)}")
            if stored.get("dtype") != dtype:  # keep the report of the old serving precision, with its lineage
                kept = layout.eval_served(version, stored.get("dtype"))
                run.fs.copy(report_uri, kept)
                if run.fs.exists(layout.lineage(report_uri)):
                    record = {**json.loads(run.fs.cat_file(layout.lineage(report_uri))), "asset": kept}
                    run.fs.pipe_file(layout.lineage(kept), json.dumps(record, indent=1).encode())
            get_run_logger().info("re-evaluating v%d: %s", version, reason)
        run.serve_published(version)
        previous = layout.eval_report(version - 1, dtype, mismatch)
        report = as_asset(evaluate_task, report_uri, [ckpt])(run, report_uri, previous)
        if reason:
            report["reevaluated_because"] = reason
            run.fs.pipe_file(report_uri, json.dumps(report, indent=1).encode())
    scores = " ".join(f"pass@{k} {v:.3f}" for k, v in report["pass_at_k"].items())
    print(f"{ckpt}: {scores} on {report['tasks']} held-out tasks ({report['dtype']}"
          f"{', NOT the serving precision ' + config.model.serving_dtype if mismatch else ''})")
    return report


def main(argv: list[str] | None = None) -> int:
    """CLI: ``--config``, ``--run-id``, ``--version``, ``--force``; prints the report without per-task rows."""
    from flows.cli import run_flow_cli

    options = [("--version", {"type": int, "default": None, "help": "checkpoint version (default: newest)"}),
               ("--force", {"action": "store_true", "help": "re-evaluate even if an up-to-date report exists"})]
    return run_flow_cli(evaluate, __doc__, argv, options,
                        show=lambda r, c: print(json.dumps({k: v for k, v in r.items() if k != "per_task"})),
                        precheck=lambda c: eval_precision(c.model.serving_dtype, c.eval.dtype,
                                                          c.eval.allow_precision_mismatch),
                        checks={"model": False},  # evaluates published checkpoints, never model.path
                        record_ignore=EVAL_MAY_CHANGE)


if __name__ == "__main__":
    sys.exit(main())
