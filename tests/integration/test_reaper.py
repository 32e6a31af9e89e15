"""A run killed with SIGKILL leaves no process it started and no container behind (``infra.reaper``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

_START_THEN_DIE = r"""
import os, signal, subprocess, sys
from infra.config import RunConfig
from infra.environments import BASE_IMAGE
from infra.run import Run
from infra.sandbox.docker_backend import owner_id

rt = Run.open(RunConfig(run_id=sys.argv[1]), model=False, tasks=False)
box = rt.backend.start(BASE_IMAGE, {"agentrl.test": "reaper"})
rt.pool.ensure(BASE_IMAGE, 1)
assert rt.pool.wait_ready(120), "warm pool did not fill"
# a server-like child in a session of its own (as the vLLM servers and the egress proxy are started)
child = subprocess.Popen(["sleep", "600"], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(owner_id(), box.sandbox_id, child.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no finally, no atexit
"""


def test_a_run_killed_with_sigkill_leaves_no_process_or_container(backend):
    from infra.reaper import OWNER_ENV, marked_pids
    from infra.sandbox.docker_backend import OWNER_LABEL

    env = {k: v for k, v in os.environ.items() if k != OWNER_ENV}  # a run of its own, not this test's
    r = subprocess.run([sys.executable, "-c", _START_THEN_DIE, f"reaper-{uuid.uuid4().hex[:8]}"],
                       cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == -9, r.stderr[-2000:]
    owner, sandbox_id, child = r.stdout.split()
    assert owner.endswith(":" + owner.rpartition(":")[2]) and owner != os.environ.get(OWNER_ENV)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        left = backend.client.containers.list(all=True, ignore_removed=True,
                                              filters={"label": f"{OWNER_LABEL}={owner}"})
        if not left and not marked_pids(owner) and not Path(f"/proc/{child}").exists():
            break
        time.sleep(0.5)
    assert left == [], [(c.short_id, c.labels.get("agentrl.pool")) for c in left]  # the sandbox and the warm one
    assert not Path(f"/proc/{child}").exists() and marked_pids(owner) == []
