"""A flow that starts a child process (standing in for a vLLM server) and sleeps: killed by test_prefect_backend."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from prefect import flow, tags

from infra.prefect_backend import flow_backend, record_flow_run


@flow(name="sleepy")
def sleepy(child_pid_file: str) -> None:
    from prefect.runtime import flow_run

    record_flow_run(flow_run.id)  # as flows.naming.tagged does for the real flows
    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    Path(child_pid_file).write_text(str(child.pid))
    print("RUNNING", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    run_id, child_pid_file = sys.argv[1], sys.argv[2]
    with flow_backend() as api_url, tags(f"run:{run_id}"):
        print(f"API {api_url}", flush=True)
        sleepy(child_pid_file)
