"""One Prefect backend per checkout, and nothing left behind by a flow process that dies.

A flow started from the command line (``flows.cli``) uses, in order:
1. the API in ``PREFECT_API_URL`` (the environment, or the checkout's Prefect profile that
   ``make server`` writes into ``$PREFECT_HOME/profiles.toml``) when it answers;
2. otherwise a temporary server of its own on a free port, on the same ``$PREFECT_HOME`` database
   (what Prefect's ephemeral mode does), started here so that it can be stopped for sure.

While ``make server`` is up, flows use it rather than a second server on its database; a profile
whose server is down is reported and ignored. (Two CLI flows without a server each start their
own temporary server on the same file, as Prefect's ephemeral mode does.) Beside the flow runs a
watchdog process (``python -m infra.prefect_backend watch``): when the flow's process dies without
ending its flow runs (SIGKILL, OOM), it marks exactly those runs ``Crashed`` through the API (their
ids are written to a file by ``flows.naming.tagged``, :data:`FLOW_RUNS_FILE`), then stops every
process the flow had started (the temporary server, vLLM servers), by pid and start time, from its
snapshots of the process tree. A server of ``make server`` also crashes silent runs by
Prefect's documented zombie-flow automation (heartbeats, :func:`ensure_zombie_automation`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from infra.net import free_port

log = logging.getLogger(__name__)
HEARTBEAT_S = 30
"""Flow-run heartbeat period (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``; Prefect's minimum is 30)."""
ZOMBIE_AUTOMATION = "agentrl: crash zombie flow runs"
FLOW_RUNS_FILE = "AGENTRL_FLOW_RUNS_FILE"
"""Environment variable naming the file where a CLI flow's process lists its flow-run ids (one per line)."""


def healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    """Whether ``{api_url}/health`` answers 200."""
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


def prefect_cli() -> str:
    """The ``prefect`` command of this interpreter's environment."""
    return str(Path(sys.executable).with_name("prefect"))


def start_temporary_server(home: Path, timeout_s: float = 180.0) -> tuple[subprocess.Popen, str]:
    """``prefect server start`` on a free loopback port with ``PREFECT_HOME=home``; returns (process, API URL).

    Raises:
        RuntimeError: it did not answer ``/health`` within ``timeout_s`` (the log tail is in the message).
    """
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    log_path = home / "temporary-server.log"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen([prefect_cli(), "server", "start", "--host", "127.0.0.1", "--port", str(port),
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
    """SIGTERM the process group of ``pid``, then SIGKILL what is left after ``timeout_s``.

    ``pid``, when it is this process's child, is reaped as soon as it exits: unreaped, its zombie kept
    the group alive to ``killpg(pid, 0)``, and every stop waited out both timeouts (20 s at each
    flow's end).
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
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
def flow_backend(home: Path | None = None) -> Iterator[str]:
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
    runs_file = home / f"flow-runs-{os.getpid()}-{time.time_ns()}.txt"
    runs_file.write_text("")
    from prefect.settings import PREFECT_API_AUTH_STRING

    auth = PREFECT_API_AUTH_STRING.value() if server is None else None  # the profile's or the environment's
    with open(home / "watchdog.log", "ab") as log_file:
        watchdog = subprocess.Popen([sys.executable, "-m", "infra.prefect_backend", "watch", "--pid", str(os.getpid()),
                                     "--runs-file", str(runs_file), "--api-url", api_url],
                                    stdin=subprocess.DEVNULL, start_new_session=True, stdout=log_file,
                                    stderr=subprocess.STDOUT,
                                    env={**os.environ, **({"PREFECT_API_AUTH_STRING": auth} if auth else {})})
    previous = os.environ.get(FLOW_RUNS_FILE)
    os.environ[FLOW_RUNS_FILE] = str(runs_file)
    try:
        with temporary_settings(updates={PREFECT_API_URL: api_url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: HEARTBEAT_S}):
            try:
                yield api_url
            finally:
                drain_workers()  # this run's queued logs and events go to its server before that server stops
    finally:
        watchdog.terminate()
        try:
            watchdog.wait(timeout=10)
        except subprocess.TimeoutExpired:
            watchdog.kill()
            watchdog.wait()
        if previous is None:
            os.environ.pop(FLOW_RUNS_FILE, None)
        else:
            os.environ[FLOW_RUNS_FILE] = previous
        runs_file.unlink(missing_ok=True)
        if server is not None:
            stop_process_group(server.pid)


def drain_workers(timeout_s: float = 30.0) -> None:
    """Send Prefect's queued logs and events now, as ``prefect_test_harness`` does before it stops its server.

    The events worker is keyed by client type, not API URL: drained, the next event starts one for
    whatever ``PREFECT_API_URL`` then says. Bounded by ``timeout_s`` (an API that died mid-run makes
    each queued event retry); never raises: what is not sent by then is logged and dropped.
    """
    import asyncio
    import inspect

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain() -> None:
        try:
            result = APILogWorker.instance().drain()
            if inspect.isawaitable(result):
                await result
        except RuntimeError:  # never started
            pass
        result = EventsWorker.drain_all()
        if inspect.isawaitable(result):
            await result

    try:
        run_coro_as_sync(asyncio.wait_for(drain(), timeout_s))
    except Exception as e:  # noqa: BLE001 - the flow's own outcome matters more than its last logs
        log.warning("Prefect's queued logs and events not all sent within %.0f s: %r", timeout_s, e)


def record_flow_run(flow_run_id: str) -> None:
    """Add a flow run of this process to the watchdog's list (no-op outside :func:`flow_backend`)."""
    path = os.environ.get(FLOW_RUNS_FILE)
    if path and Path(path).exists():
        with open(path, "a") as f:
            f.write(f"{flow_run_id}\n")


def _stat(pid: int) -> tuple[int, str, int] | None:
    """``(ppid, state, start time in clock ticks)`` of ``pid`` from ``/proc/pid/stat``; None if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[0], int(fields[19])


def descendants(pid: int) -> dict[int, int]:
    """Every live descendant of ``pid``: pid -> start time (so a reused pid is never taken for it)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            children.setdefault(st[0], []).append((int(entry), st[2]))
    out, frontier = {}, [pid]
    while frontier:
        for child, start in children.get(frontier.pop(), []):
            if child not in out:
                out[child] = start
                frontier.append(child)
    return out


def crash_flow_runs(api_url: str, flow_run_ids: list[str], pid: int) -> list[str]:
    """Mark ``Crashed`` those of ``flow_run_ids`` that are not in a final state; returns their ids.

    Sends ``$PREFECT_API_AUTH_STRING`` (basic auth) when set. Raises ``httpx.HTTPStatusError`` on a refused call.
    """
    import httpx

    crashed = []
    with httpx.Client(timeout=10, headers=auth_headers(os.environ.get("PREFECT_API_AUTH_STRING"))) as client:
        for run_id in flow_run_ids:
            fr = client.get(f"{api_url}/flow_runs/{run_id}").raise_for_status().json()
            if (fr.get("state") or {}).get("type") in ("COMPLETED", "FAILED", "CANCELLED", "CRASHED"):
                continue
            state = {"type": "CRASHED", "name": "Crashed",
                     "message": f"the flow's process (pid {pid}) died without ending this run (killed?); "
                                "marked Crashed by agentrl's watchdog"}
            client.post(f"{api_url}/flow_runs/{run_id}/set_state",
                        json={"state": state, "force": True}).raise_for_status()
            crashed.append(run_id)
    return crashed


def auth_headers(auth: str | None) -> dict[str, str]:
    """The ``Authorization`` header Prefect's basic auth expects for ``auth`` (``user:password``); {} for None."""
    import base64

    return {"Authorization": f"Basic {base64.b64encode(auth.encode()).decode()}"} if auth else {}


def watch(pid: int, runs_file: Path, api_url: str, period_s: float = 0.2) -> int:
    """Wait for ``pid`` to exit; if it died with flow runs open, crash them and stop what it started.

    The flow process is dead once ``/proc`` has no entry for it with its start time, or shows it a
    zombie; its descendants are every process seen under it (by pid and start time), not only the
    last snapshot's, since its children are re-parented the moment it dies. A process started less
    than ``period_s`` before the death can be missed.
    """
    me = _stat(pid)
    if me is None:
        return 0
    known: dict[int, int] = {}
    while (st := _stat(pid)) is not None and st[2] == me[2] and st[1] != "Z":
        known.update(descendants(pid))
        known.pop(os.getpid(), None)
        time.sleep(period_s)
    if not runs_file.exists():  # the flow left flow_backend normally (it removes the file)
        return 0
    flow_runs = [line for line in runs_file.read_text().split() if line]
    try:
        crashed = crash_flow_runs(api_url, flow_runs, pid) if flow_runs and healthy(api_url) else []
    except Exception as e:  # noqa: BLE001 - the API may be gone with the process; still clean up
        crashed = []
        log.warning("could not mark runs crashed: %s", e)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for child, start in known.items():
            if (st := _stat(child)) is not None and st[2] == start:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(child, sig)
        time.sleep(2)
    runs_file.unlink(missing_ok=True)
    sys.stdout.write(json.dumps({"pid": pid, "crashed": crashed, "stopped": sorted(known)}) + "\n")
    return 0


def ensure_zombie_automation(api_url: str, auth: str | None = None) -> None:
    """Create Prefect's documented zombie-flow automation on the server unless present.

    A flow run whose heartbeats (every :data:`HEARTBEAT_S`) stop for 3 periods without a final state is
    marked Crashed (docs.prefect.io/v3/advanced/detect-zombie-flows). ``auth``: the server's basic-auth
    string (``user:password``, Prefect's ``PREFECT_API_AUTH_STRING``), if it has one.
    """
    import httpx

    with httpx.Client(timeout=10, headers=auth_headers(auth)) as client:
        existing = client.post(f"{api_url}/automations/filter", json={}).raise_for_status().json()
        if any(a["name"] == ZOMBIE_AUTOMATION for a in existing):
            return
        automation = {
            "name": ZOMBIE_AUTOMATION, "enabled": True,
            "trigger": {"type": "event", "posture": "Proactive", "after": ["prefect.flow-run.heartbeat"],
                        "expect": ["prefect.flow-run.heartbeat", "prefect.flow-run.Completed",
                                   "prefect.flow-run.Failed", "prefect.flow-run.Cancelled",
                                   "prefect.flow-run.Crashed"],
                        "match": {"prefect.resource.id": ["prefect.flow-run.*"]},
                        "for_each": ["prefect.resource.id"], "threshold": 1, "within": 3 * HEARTBEAT_S},
            "actions": [{"type": "change-flow-run-state", "state": "CRASHED",
                         "message": f"no heartbeat for {3 * HEARTBEAT_S} s: the flow's process died"}],
        }
        client.post(f"{api_url}/automations/", json=automation).raise_for_status()


def main(argv: list[str] | None = None) -> int:
    """``python -m infra.prefect_backend watch --pid P --runs-file F --api-url U``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["watch"])
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--runs-file", type=Path, required=True)
    parser.add_argument("--api-url", required=True)
    args = parser.parse_args(argv)
    return watch(args.pid, args.runs_file, args.api_url)


if __name__ == "__main__":
    sys.exit(main())
