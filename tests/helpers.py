"""Helpers shared by more than one tier or module: the repository root, the flows' CLI in a subprocess, a
trajectory row, Prefect's asset events, whether realtime scheduling is permitted.

Light on purpose (no service, nothing heavy imported at module level): unit tests import it too, and
subprocesses started by integration tests import ``make_row`` from here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_cli(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m module args`` from the repository root, with ``env`` over this process's environment."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def make_row(**over):
    """A valid trajectory row (every column of ``TRAJECTORY_SCHEMA``), with ``over`` applied."""
    from infra.store import TRAJECTORY_SCHEMA

    row = {name: None for name in TRAJECTORY_SCHEMA.names}
    row.update(run_id="r", step=0, episode_id="e0", task_id="tb/x", group_id="r/0/tb/x", sample_index=0, attempt=0,
               token_ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], rollout_logprobs=[0.0, 0.0, -0.5, -1.0],
               policy_versions=[-1, -1, 3, 4], min_policy_version=3, max_policy_version=4, prompt_tokens=2,
               completion_tokens=2, reward=1.0, outcome="success", reason="tests_passed", stop_reason="stop",
               agent_end="done", num_turns=1, commands=[], image="img", image_digest="sha256:x", seed=1,
               temperature=1.0, top_p=1.0, max_tokens=8, queue_s=0.0, sandbox_acquire_s=0.1, generation_s=0.2,
               tool_s=0.0, verify_s=0.1, engine_replica="e", sandbox_id="s", segment_starts=[0], episode_s=0.5,
               engine_queue_s=0.02, prefill_s=0.05, decode_s=0.1)
    row.update(over)
    return row


def asset_events(uri: str, timeout_s: float = 20.0) -> list[dict]:
    """Asset materialization events of ``uri`` from the Prefect API (events land asynchronously)."""
    import httpx
    from prefect.settings import PREFECT_API_URL

    body = {"filter": {"event": {"name": ["prefect.asset.materialization.succeeded"]},
                       "resource": {"id": [uri]}, "occurred": {"since": "2000-01-01T00:00:00Z"}}, "limit": 50}
    deadline = time.monotonic() + timeout_s
    while True:
        events = httpx.post(f"{PREFECT_API_URL.value()}/events/filter", json=body, timeout=10).json()["events"]
        if events or time.monotonic() > deadline:
            return events
        time.sleep(0.5)


def related_assets(event: dict) -> set[str]:
    """The assets an asset event names as its upstream."""
    return {r["prefect.resource.id"] for r in event["related"] if r.get("prefect.resource.role") == "asset"}


def run_scripted_episode(backend, tokenizer, task, entry, replies: list[str],
                         max_turns: int = 5) -> tuple[dict, object]:
    """One episode of the built-in agent with scripted ``replies`` on ``task`` in ``entry``'s image (a real
    sandbox of ``backend``); returns (its row, the scripted engine)."""
    from infra.environments import BASE_IMAGE
    from infra.rollout.collector import Collector, CollectSettings
    from infra.rollout.scheduler import EpisodeJob
    from tests.fakes import ScriptedEngine

    engine = ScriptedEngine(tokenizer, replies, max_model_len=4096)
    settings = CollectSettings(group_size=1, temperature=0.7, top_p=0.95, max_tokens_per_turn=96, max_turns=max_turns,
                               seed=0, max_infra_retries=0)
    c = Collector(engine, backend, settings, code_image=BASE_IMAGE)
    c.bind("run", 0, {task.task_id: (entry.image, entry.image_digest)})
    try:
        return c.run(EpisodeJob(f"run/0/{task.task_id}", task, 0, 0, 1234, 0)), engine
    finally:
        c.close()


def may_run_fifo() -> bool:
    """Whether this process may put a thread under SCHED_FIFO (root is not enough in every container)."""
    ok = []

    def probe():
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
            ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe)  # the probing thread ends at once
    t.start()
    t.join()
    return bool(ok)

