"""One parent cgroup for every sandbox, weighted below the run's own processes.

On a machine where the rollout engine, dockerd and the sandboxes' commands (agents' tools, verifiers'
pytest) share a few cores, the engine's steps should not wait on the sandboxes. Docker's own
``cpu_shares`` weighs a container only against its siblings under Docker's parent cgroup, which as a
whole weighs as much as one busy process; so every sandbox is started under one parent,
:data:`PARENT`, whose weight is set here, and the sandboxes together weigh ``cpu_shares / 1024`` of one
busy thread of the run (the engine's) when both want a core. Idle cores stay theirs: a weight is not a
limit.

The weight is in cgroup v1's unit (``cpu.shares``, 1024 = a nice-0 task); on cgroup v2 it is converted
to ``cpu.weight`` as the kernel scales one to the other (default 100 = 1024, ``kernel/sched/core.c``,
``cpu_weight_write_u64``), so that 1024 still weighs one busy process (runc's linear conversion of a
container's ``--cpu-shares`` maps 1024 to 39, which would not).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

PARENT = "agentrl-sandboxes"
CGROUP_ROOT = Path("/sys/fs/cgroup")


def shares_to_weight(shares: int) -> int:
    """Convert cgroup v1 ``cpu.shares`` to v2 ``cpu.weight`` (1..10000): ``shares * 100 / 1024``, rounded."""
    return min(10000, max(1, (shares * 100 + 512) // 1024))


def sandbox_parent(cpu_shares: int, driver: str, version: str, root: Path = CGROUP_ROOT) -> str:
    """Create (or re-weigh) the sandboxes' parent cgroup and return the ``cgroup_parent`` to start them under.

    Args:
        cpu_shares: the weight of all sandboxes together, 2..262144 (1024 = one busy process).
        driver: the engine's cgroup driver (``docker info``'s ``CgroupDriver``: ``cgroupfs`` or ``systemd``).
        version: its cgroup version (``CgroupVersion``: ``"1"`` or ``"2"``).
        root: where the cgroup filesystem is mounted.

    Returns:
        ``/agentrl-sandboxes`` (cgroupfs) or ``agentrl-sandboxes.slice`` (systemd).

    Raises:
        ValueError: ``cpu_shares`` out of range, or an unknown driver.
        RuntimeError: the weight cannot be set on this machine (the engine's cgroups are not here, e.g. a
            remote ``DOCKER_HOST``, or not writable); names the file or command and the setting.
    """
    if not 2 <= cpu_shares <= 262144:
        raise ValueError(f"tasks.sandbox_cpu_shares must be in 2..262144 (1024 = one busy process), got {cpu_shares}")
    v2 = str(version) == "2"
    if driver == "systemd":
        unit = f"{PARENT}.slice"
        prop = f"CPUWeight={shares_to_weight(cpu_shares)}" if v2 else f"CPUShares={cpu_shares}"
        if not shutil.which("systemctl"):
            raise RuntimeError(f"tasks.sandbox_cpu_shares: the Docker engine uses systemd cgroups, and systemctl "
                               f"is not here to set {prop} on {unit}; unset tasks.sandbox_cpu_shares")
        done = subprocess.run(["systemctl", "set-property", "--runtime", unit, prop], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"tasks.sandbox_cpu_shares: systemctl set-property {unit} {prop} failed: "
                               f"{done.stderr.strip()}")
        return unit
    if driver != "cgroupfs":
        raise ValueError(f"tasks.sandbox_cpu_shares: unknown cgroup driver {driver!r} (cgroupfs or systemd)")
    if v2:
        target, value = root / PARENT / "cpu.weight", str(shares_to_weight(cpu_shares))
    else:
        target, value = root / "cpu" / PARENT / "cpu.shares", str(cpu_shares)
    try:
        target.parent.mkdir(exist_ok=True)
        target.write_text(value)
    except OSError as e:
        raise RuntimeError(f"tasks.sandbox_cpu_shares: cannot write {value} to {target} ({e}); the Docker engine's "
                           "cgroups must be on this machine and writable (root), or unset the setting") from e
    return f"/{PARENT}"
