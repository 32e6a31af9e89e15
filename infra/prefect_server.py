"""A local Prefect server and a process worker, started and stopped by pid file (``make server``).

The server (``prefect server start``, SQLite under ``$PREFECT_HOME``) listens on 127.0.0.1, or on the
address ``--host`` names, for workers and flows on other machines: then every API route but the health
probes needs Prefect's basic-auth string (``PREFECT_SERVER_API_AUTH_STRING`` on the server,
``PREFECT_API_AUTH_STRING`` on clients; one is made and saved unless given). The worker polls a process
work pool (created if missing). ``start`` also saves the API URL (and auth string) in the checkout's
Prefect profile (``agentrl`` in ``$PREFECT_HOME/profiles.toml``, made active), so every ``make`` target,
flow and ``prefect`` command with this ``PREFECT_HOME`` reaches this server instead of starting another
on the same database, and creates the zombie-flow automation (runs whose heartbeats stop are marked
Crashed). ``stop`` ends exactly what ``start`` started and removes the URL from the profile. This module
runs the ``prefect`` CLI as subprocesses and does not import Prefect.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from infra.prefect_backend import ensure_zombie_automation, healthy, prefect_cli

POOL = "agentrl-process"
PROFILE = "agentrl"


def profiles_path() -> Path:
    """The Prefect profiles file of this checkout (``$PREFECT_PROFILES_PATH``, else ``$PREFECT_HOME/profiles.toml``)."""
    if os.environ.get("PREFECT_PROFILES_PATH"):
        return Path(os.environ["PREFECT_PROFILES_PATH"])
    return Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect")) / "profiles.toml"


def save_api_url(api_url: str | None, path: Path | None = None, auth: str | None = None) -> Path:
    """Set (or, with None, remove) ``PREFECT_API_URL`` in the ``agentrl`` profile and make it active; returns the file.

    ``path``: the profiles file (default :func:`profiles_path`). ``auth``: also ``PREFECT_API_AUTH_STRING``
    (removed with the URL, or when None). Other profiles in the file are kept.
    """
    import toml

    path = path or profiles_path()
    data = toml.loads(path.read_text()) if path.is_file() else {}
    profile = data.setdefault("profiles", {}).setdefault(PROFILE, {})
    previous = path.with_name("profiles.agentrl-previous-active")  # the profile active before ours
    profile.pop("PREFECT_API_AUTH_STRING", None)
    if api_url is None:
        profile.pop("PREFECT_API_URL", None)
        if data.get("active") == PROFILE and previous.is_file():
            data["active"] = previous.read_text().strip()
        previous.unlink(missing_ok=True)
    else:
        profile["PREFECT_API_URL"] = api_url
        if auth:
            profile["PREFECT_API_AUTH_STRING"] = auth
        if data.get("active", PROFILE) != PROFILE:
            previous.write_text(data["active"])
        data["active"] = PROFILE
    path.parent.mkdir(parents=True, exist_ok=True)
    if auth:
        _write_secret(path, toml.dumps(data))  # it holds a secret now
    else:
        path.write_text(toml.dumps(data))
    return path


def _alive(pid_file: Path) -> int | None:
    if not pid_file.is_file():
        return None
    pid = int(pid_file.read_text().strip())
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return None
    return pid if "prefect" in cmdline else None


def start(state: Path, port: int = 4200, pool: str = POOL, timeout_s: float = 180.0,
          home: Path | None = None, host: str = "127.0.0.1", advertise: str = "", auth: str | None = None) -> str:
    """Start the server and a worker on ``pool`` unless already running; returns the API URL.

    ``home``: the ``PREFECT_HOME`` of both (its database, and the profile saved there); default the
    caller's ``$PREFECT_HOME``. ``host``: the address the server binds; ``advertise``: the one clients
    reach it at (default ``host``; needed for ``0.0.0.0``). Beyond loopback the server needs ``auth``
    (``user:password``): without one, a random one is made and kept in ``state/prefect-auth`` (mode 600).
    The auth string is saved in the profile with the URL (:func:`auth_string` reads it back).

    Raises:
        ValueError: ``host`` binds every address and ``advertise`` is empty; ``auth`` on loopback; ``auth``
            differs from the one the running server was started with.
        RuntimeError: the server did not become healthy in time (the message has its log tail).
    """
    import secrets

    if host in ("0.0.0.0", "::") and not advertise:
        raise ValueError(f"host = {host!r} binds every address: give the advertised address clients reach")
    loopback = _is_loopback(host)
    if loopback and auth:
        raise ValueError("an auth string is for a server bound beyond loopback (host)")
    state.mkdir(parents=True, exist_ok=True)
    server_pid, server_log = state / "prefect-server.pid", state / "prefect-server.log"
    running = _alive(server_pid) is not None
    if not loopback:
        stored = auth_string(state)
        if running and auth and stored and auth != stored:
            raise ValueError(f"the Prefect server of {state} already runs with another auth string; stop it first")
        auth = (stored if running else auth) or stored or f"agentrl:{secrets.token_urlsafe(24)}"
        _write_secret(state / "prefect-auth", auth)
    api_url = f"http://{advertise or host}:{port}/api"
    home = home or Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect"))
    from infra.reaper import unmarked_env

    env = {**unmarked_env(), "PREFECT_HOME": str(home), "PREFECT_API_URL": api_url,  # they outlive any run
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_WORKER_QUERY_SECONDS": os.environ.get("PREFECT_WORKER_QUERY_SECONDS", "2"),
           "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}
    env.pop("PREFECT_API_AUTH_STRING", None)
    env.pop("PREFECT_SERVER_API_AUTH_STRING", None)
    server_env = {**env, "PREFECT_SERVER_API_AUTH_STRING": auth} if auth else env
    env = {**env, "PREFECT_API_AUTH_STRING": auth} if auth else env  # the CLI calls and the worker below
    if not running:
        with open(server_log, "ab") as log:
            proc = subprocess.Popen([prefect_cli(), "server", "start", "--host", host, "--port", str(port),
                                     "--analytics-off"], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, env=server_env)
        server_pid.write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + timeout_s
    while not healthy(api_url):
        if time.monotonic() > deadline:
            tail = server_log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"Prefect server at {api_url} not healthy after {timeout_s:.0f} s:\n{tail}")
        time.sleep(0.5)
    pools = subprocess.run([prefect_cli(), "work-pool", "inspect", pool], env=env, capture_output=True)
    if pools.returncode != 0:
        subprocess.run([prefect_cli(), "work-pool", "create", pool, "--type", "process"], env=env, check=True,
                       capture_output=True)
    ensure_zombie_automation(api_url, auth)
    save_api_url(api_url, home / "profiles.toml", auth)
    (state / "prefect-home").write_text(str(home))
    worker_pid, worker_log = state / "prefect-worker.pid", state / "prefect-worker.log"
    if _alive(worker_pid) is None:
        with open(worker_log, "ab") as log:
            proc = subprocess.Popen([prefect_cli(), "worker", "start", "--pool", pool, "--type", "process"],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=env)
        worker_pid.write_text(f"{proc.pid}\n")
    return api_url


def _write_secret(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by its owner only (mode 600, an existing file's mode too)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: not loopback
        return False


def auth_string(state: Path) -> str | None:
    """The auth string of the server started with ``state`` beyond loopback (``PREFECT_API_AUTH_STRING``), if any."""
    path = state / "prefect-auth"
    return path.read_text().strip() if path.is_file() else None


def stop(state: Path) -> list[str]:
    """Stop the worker, then the server (only those our pid files name); returns what was stopped."""
    stopped = []
    for name in ("prefect-worker", "prefect-server"):
        pid_file = state / f"{name}.pid"
        pid = _alive(pid_file)
        if pid is not None:
            os.killpg(pid, signal.SIGTERM)
            for _ in range(100):
                if _alive(pid_file) is None:
                    break
                time.sleep(0.1)
            else:
                os.killpg(pid, signal.SIGKILL)
            stopped.append(name)
        pid_file.unlink(missing_ok=True)
    home_file = state / "prefect-home"
    save_api_url(None, Path(home_file.read_text()) / "profiles.toml" if home_file.is_file() else None)
    home_file.unlink(missing_ok=True)
    return stopped


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m infra.prefect_server start|stop [--port 4200] [--host ADDRESS [--advertise ADDRESS]]``.

    Beyond loopback the auth string is ``$PREFECT_SERVER_API_AUTH_STRING`` if set, else made; either way it is
    kept in ``<state>/prefect-auth`` (mode 600), whose path is printed.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["start", "stop"])
    parser.add_argument("--port", type=int, default=4200)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (beyond loopback: basic auth)")
    parser.add_argument("--advertise", default="", help="address clients reach (default --host)")
    default_state = os.environ.get("AGENTRL_STATE", str(Path(__file__).parent.parent / ".state"))
    parser.add_argument("--state", default=default_state)
    args = parser.parse_args(argv)
    # a new shell (no PREFECT_HOME) reads the user's profiles: the server is saved there too, so the commands
    # `prefect deploy` prints reach it; `stop` removes it again
    user_profiles = Path.home() / ".prefect" / "profiles.toml"
    if args.action == "start":
        loopback = _is_loopback(args.host)
        api_url = start(Path(args.state), args.port, host=args.host, advertise=args.advertise,
                        auth=None if loopback else os.environ.get("PREFECT_SERVER_API_AUTH_STRING"))
        auth = None if loopback else auth_string(Path(args.state))  # the one start kept
        if user_profiles != profiles_path():
            save_api_url(api_url, user_profiles, auth)
        print(f"Prefect API {api_url} (UI {api_url.removesuffix('/api')}); worker on pool {POOL}; saved as the "
              f"active profile '{PROFILE}' in {profiles_path()} and {user_profiles}")
        if auth:
            print(f"basic auth on every route but /health: on other machines set PREFECT_API_URL={api_url} and "
                  f"PREFECT_API_AUTH_STRING from {Path(args.state) / 'prefect-auth'}")
    else:
        print(f"stopped: {', '.join(stop(Path(args.state))) or 'nothing'}")
        if user_profiles != profiles_path() and user_profiles.is_file():
            save_api_url(None, user_profiles)
    return 0


if __name__ == "__main__":
    sys.exit(main())
