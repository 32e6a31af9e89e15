"""Prefect task: pass@1 on the held-out tasks with the serving engine and dtype; report beside the checkpoint."""

from __future__ import annotations

import json

from prefect import task
from prefect.assets import add_asset_metadata
from prefect.cache_policies import NO_CACHE

from infra.config import RunConfig
from infra.environments import BASE_IMAGE
from infra.evaluate import eval_report
from infra.rollout.collector import Collector, CollectSettings
from tasks.runtime import runtime


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(config: RunConfig, catalog_uri: str, report_uri: str) -> dict:
    """Greedy pass@1 on every usable held-out task with the engine as it serves now.

    Run as a materializing task (asset ``report_uri``, upstream the checkpoint).

    Returns:
        The report (see ``infra.evaluate.eval_report``), also written to ``report_uri``.
    """
    rt = runtime(config)
    catalog = rt.load_catalog(catalog_uri)
    held_out = [e for e in catalog["tasks"] if e["usable"] and e["split"] == "eval"]
    images = {e["task_id"]: (e["image"], e["image_digest"]) for e in held_out}
    r = config.rollout
    settings = CollectSettings(group_size=1, temperature=0.0, top_p=1.0, max_tokens_per_turn=config.eval.max_tokens,
                               max_turns=r.max_turns, seed=r.seed, max_infra_retries=r.max_infra_retries)
    collector = Collector(rt.engine, rt.backend, settings, code_image=BASE_IMAGE, pool=rt.sandbox_pool)
    rows = collector.collect(f"{config.run_id}-eval", rt.policy_version, [rt.tasks[e["task_id"]] for e in held_out],
                             images)
    report = eval_report(rows, rt.policy_version, engine=f"vllm:{rt.engine.replica}", dtype=rt.engine.dtype)
    rt.fs.pipe_file(report_uri, json.dumps(report, indent=1).encode())
    add_asset_metadata(report_uri, {"version": report["version"], "pass_at_1": report["pass_at_1"],
                                    "dtype": report["dtype"]})
    return report
