"""Deployable flow: evaluate a published checkpoint on the held-out tasks, in the serving precision.

``python -m flows.evaluate --config configs/quickstart.toml`` (newest version) or the ``evaluate``
deployment with a ``version``. The report goes beside the checkpoint (``…/vN/eval.json``).
"""

from __future__ import annotations

import sys

from prefect import flow

from infra.checkpoint import checkpoint_uri, published_versions
from infra.config import RunConfig
from tasks.evaluate import evaluate as evaluate_task
from tasks.lineage import as_asset
from tasks.publish import hot_load
from tasks.runtime import run_uri, runtime, work_dir

DEFAULT_CONFIG = RunConfig()


@flow(name="evaluate", log_prints=True)
def evaluate(config: RunConfig = DEFAULT_CONFIG, version: int | None = None) -> dict:
    """Greedy pass@1 of checkpoint ``version`` (default: newest published) with the serving engine and dtype.

    Raises:
        ValueError: the run has no published checkpoint, or not that version.
    """
    rt = runtime(config)
    s = config.storage
    versions = published_versions(rt.fs, s.bucket, s.prefix, config.run_id)
    if not versions or (version is not None and version not in versions):
        raise ValueError(f"run {config.run_id}: checkpoint version {version} not published (have {versions})")
    version = version if version is not None else versions[-1]
    ckpt = checkpoint_uri(s.bucket, s.prefix, config.run_id, version)
    if rt.policy_dir:
        hot_load(config, ckpt)  # an engine already serves in this process: load the version into it
    else:
        from infra.checkpoint import fetch

        local = work_dir(config.run_id) / f"v{version}"
        fetch(rt.fs, ckpt, local)
        rt.policy_dir, rt.policy_version = str(local), version
    report = as_asset(evaluate_task, f"{ckpt}/eval.json", [ckpt])(config, f"{run_uri(config)}/envs.json",
                                                                 f"{ckpt}/eval.json")
    print(f"{ckpt}: pass@1 {report['pass_at_1']:.3f} on {report['tasks']} held-out tasks ({report['dtype']})")
    return report


if __name__ == "__main__":
    from flows.cli import run_flow_cli

    sys.exit(run_flow_cli(evaluate, __doc__))
