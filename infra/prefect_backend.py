"""One Prefect backend per checkout, and nothing left behind by a flow process that dies.

A flow started from the command line (``flows.cli``) uses, in order:
1. the API in ``PREFECT_API_URL`` (the environment, or the checkout's Prefect profile that
   ``make server`` writes into ``$PREFECT_HOME/profiles.toml``) when it answers;
2. otherwise a temporary server of its own on a free port, on the same ``$PREFECT_HOME`` database
   (what Prefect's ephemeral mode does), started here so that it can be stopped for sure.

Never two servers on one SQLite file: a profile whose server is down is reported and ignored.
Beside the flow runs a watchdog process (``python -m infra.prefect_backend watch``): when the
flow's process dies without ending its flow runs (SIGKILL, OOM), it marks them ``Crashed`` through
the API, then stops every process the flow had started (the temporary server, vLLM servers) from
its last snapshot of the process tree. A server of ``make server`` also crashes silent runs by
Prefect's documented zombie-flow automation (heartbeats, :func:`ensure_zombie_automation`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)
HEARTBEAT_S = 30
"""Flow-run heartbeat period (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``; Prefect's minimum is 30)."""
ZOMBIE_AUTOMATION = "agentrl: crash zombie flow runs"


def healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    """Whether ``{api_url}/health`` answers 200."""
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prefect() -> str:
    return str(Path(sys.executable).with_name("prefect"))


def start_temporary_server(home: Path, timeout_s: float = 180.0) -> tuple[subprocess.Popen, str]:
    """``prefect server start`` on a free loopback port with ``PREFECT_HOME=home``; returns (process, API URL).

    Raises:
        RuntimeError: it did not answer ``/health`` within ``timeout_s`` (the log tail is in the message).
    """
    home.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    log_path = home / "temporary-server.log"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen([_prefect(), "server", "start", "--host", "127.0.0.1", "--port", str(port),
                                 "--analytics-off"], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while not healthy(api_url):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process_group(proc.pid)
            tail = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"temporary Prefect server on {api_url} did not start (log {log_path}):\n{tail}")
        time.sleep(0.5)
    return proc, api_url


def stop_process_group(pid: int, timeout_s: float = 10.0) -> None:
    """SIGTERM the process group of ``pid``, then SIGKILL what is left after ``timeout_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.1)


def configured_api_url() -> str | None:
    """``PREFECT_API_URL`` as Prefect resolves it here (environment, then the active profile)."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


@contextlib.contextmanager
def flow_backend(run_id: str, home: Path | None = None) -> Iterator[str]:
    """The Prefect API for one CLI flow run, and its watchdog; yields the API URL.

    Inside the block Prefect's settings point at the chosen API with flow heartbeats on. Leaving it
    stops the temporary server (if one was started) and the watchdog.
    """
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, PREFECT_HOME, temporary_settings

    home = home or Path(PREFECT_HOME.value())
    server = None
    api_url = configured_api_url()
    if api_url and not healthy(api_url):
        log.warning("the Prefect API %s (PREFECT_API_URL or the profile of `make server`) does not answer; "
                    "using a temporary server for this run (`make server` starts the checkout's)", api_url)
        api_url = None
    if api_url is None:
        server, api_url = start_temporary_server(home)
    watchdog = subprocess.Popen([sys.executable, "-m", "infra.prefect_backend", "watch", "--pid", str(os.getpid()),
                                 "--run-id", run_id, "--api-url", api_url, "--since", str(time.time() - 1)],
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                stdout=open(home / "watchdog.log", "ab"), stderr=subprocess.STDOUT)
    try:
        with temporary_settings(updates={PREFECT_API_URL: api_url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: HEARTBEAT_S}):
            yield api_url
    finally:
        watchdog.terminate()
        if server is not None:
            stop_process_group(server.pid)


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, frontier = set(), [pid]
    while frontier:
        for c in children.get(frontier.pop(), []):
            if c not in out:
                out.add(c)
                frontier.append(c)
    return out


def crash_flow_runs(api_url: str, run_id: str, since: float, pid: int) -> list[str]:
    """Mark ``Crashed`` the flow runs tagged ``run:{run_id}``, started after ``since``, still Running/Pending."""
    import httpx

    body = {"flow_runs": {"tags": {"all_": [f"run:{run_id}"]}, "state": {"type": {"any_": ["RUNNING", "PENDING"]}},
                          "start_time": {"after_": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since))}}}
    runs = httpx.post(f"{api_url}/flow_runs/filter", json=body, timeout=10).json()
    crashed = []
    for fr in runs:
        state = {"type": "CRASHED", "name": "Crashed",
                 "message": f"the flow's process (pid {pid}) died without ending this run (killed?); "
                            "marked Crashed by agentrl's watchdog"}
        httpx.post(f"{api_url}/flow_runs/{fr['id']}/set_state", json={"state": state, "force": True}, timeout=10)
        crashed.append(fr["id"])
    return crashed


def watch(pid: int, run_id: str, api_url: str, since: float, period_s: float = 0.5) -> int:
    """Wait for ``pid`` to exit; if it died with flow runs open, crash them and stop what it started."""
    known: set[int] = set()
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        known = descendants(pid) - {os.getpid()}
        time.sleep(period_s)
    try:
        crashed = crash_flow_runs(api_url, run_id, since, pid) if healthy(api_url) else []
    except Exception as e:  # noqa: BLE001 - the API may be gone with the process; still clean up
        crashed = []
        log.warning("could not mark runs crashed: %s", e)
    for child in known:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGTERM)
    time.sleep(2)
    for child in known:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)
    sys.stdout.write(json.dumps({"pid": pid, "run_id": run_id, "crashed": crashed, "stopped": sorted(known)}) + "\n")
    return 0


def ensure_zombie_automation(api_url: str) -> None:
    """Create Prefect's documented zombie-flow automation on the server unless present.

    A flow run whose heartbeats (every :data:`HEARTBEAT_S`) stop for 3 periods without a final state is
    marked Crashed (docs.prefect.io/v3/advanced/detect-zombie-flows).
    """
    import httpx

    existing = httpx.post(f"{api_url}/automations/filter", json={}, timeout=10).json()
    if any(a["name"] == ZOMBIE_AUTOMATION for a in existing):
        return
    automation = {
        "name": ZOMBIE_AUTOMATION, "enabled": True,
        "trigger": {"type": "event", "posture": "Proactive", "after": ["prefect.flow-run.heartbeat"],
                    "expect": ["prefect.flow-run.heartbeat", "prefect.flow-run.Completed",
                               "prefect.flow-run.Failed", "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"],
                    "match": {"prefect.resource.id": ["prefect.flow-run.*"]},
                    "for_each": ["prefect.resource.id"], "threshold": 1, "within": 3 * HEARTBEAT_S},
        "actions": [{"type": "change-flow-run-state", "state": "CRASHED",
                     "message": f"no heartbeat for {3 * HEARTBEAT_S} s: the flow's process died"}],
    }
    httpx.post(f"{api_url}/automations/", json=automation, timeout=10).raise_for_status()


def main(argv: list[str] | None = None) -> int:
    """``python -m infra.prefect_backend watch --pid P --run-id R --api-url U --since T``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["watch"])
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--api-url", required=True)
    parser.add_argument("--since", type=float, required=True)
    args = parser.parse_args(argv)
    return watch(args.pid, args.run_id, args.api_url, args.since)


if __name__ == "__main__":
    sys.exit(main())
