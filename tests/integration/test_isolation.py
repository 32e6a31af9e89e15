"""Sandboxes on a real dockerd: isolation, tamper-proof verification, task validation, warm pool, reaper."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from envs import load_taskset
from envs.harbor import load_harbor_task
from envs.task import Outcome
from envs.verify import verify_harbor
from infra.environments import BASE_IMAGE, build_catalog
from infra.sandbox.base import SandboxInfraError
from tests.integration.test_sandbox import AGENT_CAP_EFF

ROOT = Path(__file__).parents[2]
HARBOR = ROOT / "envs" / "harbor"
TERMINAL = ROOT / "envs" / "terminal"
pytestmark = pytest.mark.integration


@pytest.fixture
def boxes(backend):
    started = []

    def start(image=BASE_IMAGE, **limits):
        box = backend.start(image, {"agentrl.test": "isolation"}, **limits)
        started.append(box)
        return box

    yield start
    for b in started:
        b.close()


def test_no_network_dns_and_connect_fail(boxes):
    box = boxes()
    dns = box.exec("python3 -c \"import socket; socket.getaddrinfo('pypi.org', 443)\"", 10)
    assert dns.exit_code != 0 and "gaierror" in dns.output
    conn = box.exec("python3 -c \"import socket; socket.create_connection(('10.0.0.1', 80), timeout=2)\"", 10)
    assert conn.exit_code != 0 and "unreachable" in conn.output.lower()
    assert box.exec("ls /sys/class/net", 5).output.split() == ["lo"]


def test_fork_bomb_is_contained(boxes):
    bomb, other = boxes(), boxes()
    r = bomb.exec("bomb() { bomb | bomb & }; bomb; sleep 3", 8)
    assert "fork: retry: Resource temporarily unavailable" in r.output  # the pids limit refused forks
    # the pids limit held: the sandbox itself still answers once the bomb is killed, and so does another
    assert bomb.stop_agent_processes() > 100
    # nothing of the bomb is left (zombies included): a pipe forks, and only the command's own processes count
    r = bomb.exec("echo alive | cat; cat /sys/fs/cgroup/pids.current 2>/dev/null || "
                  "cat /sys/fs/cgroup/pids/pids.current", 10)
    assert r.output.split()[0] == "alive" and int(r.output.split()[1]) < 10, r.output
    assert other.exec("echo alive | cat", 5).output.strip() == "alive"
    pids = int(bomb.exec("cat /sys/fs/cgroup/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids/pids.max", 5).output)
    assert pids == 1024  # DockerBackend.pids_limit


def test_memory_hog_is_killed_without_touching_other_sandboxes(boxes):
    hog, other = boxes(memory_mb=128), boxes(memory_mb=128)
    other.exec("echo kept > /tmp/state", 5)
    r = hog.exec("python3 -c \"x = bytearray(600 * 2**20); print('allocated')\"", 30)
    assert r.exit_code == 137 and not r.timed_out and "allocated" not in r.output  # OOM-killed, not a deadline
    assert hog.exec("echo still-running", 5).output.strip() == "still-running"
    assert other.exec("cat /tmp/state", 5).output.strip() == "kept"


def test_tmp_fill_is_bounded_and_host_files_invisible(boxes, backend):
    box = boxes(disk_mb=200)
    r = box.exec("dd if=/dev/zero of=/tmp/fill bs=1M count=1024 2>&1; sync", 120)
    assert "No space left on device" in r.output or "Disk quota exceeded" in r.output, r.output
    written_mb = int(box.exec("du -sm /tmp/fill | cut -f1", 10).output.split()[0])
    # with a disk quota /tmp is the image's own, bounded by disk_mb; without one, a tmpfs of tmp_size_mb
    assert written_mb <= 220 if backend.disk_quota else written_mb == backend.tmp_size_mb
    # nothing of the host: not this repository, not the host's hostname, no docker socket
    out = box.exec(f"ls {ROOT} /var/run/docker.sock 2>&1; hostname", 5).output
    assert out.count("No such file") == 2 and socket.gethostname() not in out
    caps = box.exec("grep -E 'CapEff|NoNewPrivs' /proc/self/status", 5).output.split()
    assert caps == ["CapEff:", AGENT_CAP_EFF, "NoNewPrivs:", "1"]


def test_disk_fill_is_bounded(boxes, backend):
    if not backend.disk_quota:
        pytest.skip("the engine enforces no per-container size (make up was run with AGENTRL_DOCKER_QUOTA=0, "
                    "or btrfs was unavailable: see make up's warning)")
    box = boxes(disk_mb=200)
    r = box.exec("mkdir -p /app && dd if=/dev/zero of=/app/fill bs=1M count=1024 2>&1; sync", 120)
    assert "Disk quota exceeded" in r.output or "No space left on device" in r.output, r.output
    written_mb = int(box.exec("du -sm /app/fill | cut -f1", 10).output.split()[0])
    assert written_mb <= 220
    other = boxes()  # the host's disk and other sandboxes are untouched
    assert other.exec("mkdir -p /app && dd if=/dev/zero of=/app/ok bs=1M count=50 2>&1 && echo ok",
                      60).output.strip().endswith("ok")


def test_disk_limit_bounds_what_the_sandbox_writes_not_its_image(boxes, backend):
    """Simple quotas (``make up``): a limit below the image's size still lets the sandbox write that much.

    Under full qgroups the image's extents counted too (a 100 MiB limit on a 180 MiB image failed to
    start), and the limits lapsed whenever the accounting went inconsistent (a 1 GiB write into a
    200 MiB sandbox succeeded in CI).
    """
    if not backend.disk_quota:
        pytest.skip("the engine enforces no per-container size")
    from infra.services import quota_mode

    assert quota_mode(Path(backend.client.info()["DockerRootDir"])) == "squota"
    box = boxes(disk_mb=100)
    r = box.exec("dd if=/dev/zero of=/fill bs=1M count=300 2>&1; sync; du -sm /fill | cut -f1", 60)
    assert "Disk quota exceeded" in r.output and 90 <= int(r.output.split()[-1]) <= 100, r.output


def test_tmp_is_the_images_own_under_a_disk_quota(boxes, backend, tmp_path):
    """What an image puts in /tmp is there for the agent, as under ``docker run`` (issue 12)."""
    if not backend.disk_quota:
        pytest.skip("without a disk quota /tmp is a tmpfs (the only bound on what is written there)")
    (tmp_path / "Dockerfile").write_text(f"FROM {BASE_IMAGE}\nRUN echo seeded > /tmp/from-image\n")
    image, _, _ = backend.build_image("agentrl-test-tmp-seeded", tmp_path, network=False)
    assert boxes(image).exec("cat /tmp/from-image", 5).output.strip() == "seeded"


def test_task_limits_are_applied(boxes):
    box = boxes(cpus=0.5, memory_mb=300)
    attrs = box._container.attrs["HostConfig"]
    assert attrs["NanoCpus"] == 500_000_000 and attrs["Memory"] == 300 * 2**20
    assert attrs["NetworkMode"] == "none" and attrs["PidsLimit"] == 1024


def test_exec_deadline_separate_from_client_timeout(backend):
    """A client whose socket read timeout is shorter than the command must not turn it into an error."""
    import docker

    from infra.sandbox.docker_backend import DockerBackend

    short = DockerBackend(client=docker.from_env(timeout=5))  # socket read timeout 5 s
    box = short.start(BASE_IMAGE, {"agentrl.test": "deadline"})
    try:
        r = box.exec("sleep 8; echo finished", timeout_s=20)  # longer than the client's timeout
        assert (r.exit_code, r.output.strip(), r.timed_out) == (0, "finished", False)
        r = box.exec("sleep 30", timeout_s=1.5)
        assert r.timed_out and r.exit_code == 137 and r.duration_s < 10
    finally:
        box.close()


# ------------------------------------------------------------------ Harbor verification


@pytest.fixture(scope="module")
def greeting(backend):
    task = load_harbor_task(HARBOR / "write-greeting")
    tag, _, log = backend.build_image("harbor/write-greeting", task.build_context, fallback_base=BASE_IMAGE)
    assert "base image ubuntu:24.04 -> agentrl-ubuntu:24.04-noble-2" in log  # its local equivalent
    return task, tag


@pytest.mark.parametrize("tamper", [
    "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt",  # a pre-written reward
    "mkdir -p /logs/verifier && echo '{\"reward\": 1}' > /logs/verifier/reward.json",
    # a process left running that keeps writing the reward while the verifier runs
    "mkdir -p /logs/verifier; nohup sh -c 'while true; do echo 1 > /logs/verifier/reward.txt 2>/dev/null; "
    "sleep 0.01; done' >/dev/null 2>&1 &",
    # tests the agent wrote itself, at the path the hidden tests go
    "mkdir -p /tests && printf '#!/bin/bash\\nmkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt\\n'"
    " > /tests/test.sh",
])
def test_harbor_reward_cannot_be_forged(backend, greeting, tamper):
    task, tag = greeting
    box = backend.start(tag, {"agentrl.test": "forge"})
    try:
        assert box.exec(tamper, 5).exit_code == 0
        time.sleep(0.2)
        verdict = verify_harbor(box, task)
        assert (verdict.reward, verdict.outcome) == (0.0, Outcome.MODEL_FAILURE), verdict
        box.stop_agent_processes()  # a forger still running (the reward loop) would be caught again
        box.exec("echo 'Hello, Harbor!' > /app/greeting.txt", 5)  # a genuine solution still scores 1
        assert verify_harbor(box, task).reward == 1.0
    finally:
        box.close()


def test_harbor_verifier_without_reward_is_unknown(backend, greeting, tmp_path):
    task, tag = greeting
    shutil.copytree(HARBOR / "write-greeting", tmp_path / "t")
    (tmp_path / "t" / "tests" / "test.sh").write_text("#!/bin/bash\necho forgot the reward\n")
    silent = load_harbor_task(tmp_path / "t")
    box = backend.start(tag, {"agentrl.test": "silent"})
    try:
        v = verify_harbor(box, silent)
        assert (v.outcome, v.reason) == (Outcome.UNKNOWN, "no_reward_file")
    finally:
        box.close()


# ------------------------------------------------------------------ validation gate


def test_validation_gate_over_real_task_formats(backend, tmp_path):
    """Harbor, Terminal-Bench (compose) and code tasks validate; broken ones are unusable with the reason."""
    for name in ("write-greeting", "fix-median"):
        shutil.copytree(HARBOR / name, tmp_path / name)
    shutil.copytree(TERMINAL / "csv-column", tmp_path / "csv-column")
    shutil.copytree(HARBOR / "write-greeting", tmp_path / "wrong-solution")
    (tmp_path / "wrong-solution" / "solution" / "solve.sh").write_text("echo 'Hello' > /app/greeting.txt\n")
    shutil.copytree(TERMINAL / "hello-file", tmp_path / "trivial-tests")
    (tmp_path / "trivial-tests" / "tests" / "test_outputs.py").write_text("def test_nothing():\n    assert True\n")
    shutil.copytree(HARBOR / "count-words", tmp_path / "no-solution")
    shutil.rmtree(tmp_path / "no-solution" / "solution")
    shutil.copytree(HARBOR / "count-words", tmp_path / "bad-build")
    (tmp_path / "bad-build" / "environment" / "Dockerfile").write_text("FROM agentrl-base:bookworm\nRUN false\n")
    (tmp_path / "code.jsonl").write_text((ROOT / "envs" / "simple_code" / "problems.jsonl").read_text()
                                         .splitlines()[0] + "\n")
    tasks, errors = load_taskset(tmp_path)
    assert errors == []
    by_id = {t.task_id: t for t in tasks}
    cache: dict[str, dict] = {}
    entries, logs = build_catalog(backend, by_id, dict.fromkeys(by_id, "train"), cache_get=cache.get,
                                  cache_put=cache.__setitem__, reference_less="unusable")
    got = {e.task_id: e for e in entries}
    for ok in ("harbor/write-greeting", "harbor/fix-median", "tb/csv-column", "code/SimpleCode/0"):
        assert got[ok].usable and got[ok].validation == "passed", (ok, got[ok].reason, logs.get(ok))
    assert "reference solution scored 0.0 (tests_failed)" in got["harbor/wrong-solution"].reason
    assert "a do-nothing agent passes" in got["tb/trivial-tests"].reason
    assert "no reference solution" in got["harbor/no-solution"].reason
    assert "image build failed" in got["harbor/bad-build"].reason
    assert not any(got[t].usable for t in ("harbor/wrong-solution", "tb/trivial-tests", "harbor/no-solution"))
    # the verdicts are cached by content: a second catalog runs no sandbox
    started = backend.start
    calls = []
    backend.start = lambda *a, **k: calls.append(a) or started(*a, **k)
    try:
        again, _ = build_catalog(backend, by_id, dict.fromkeys(by_id, "train"), cache_get=cache.get,
                                 cache_put=cache.__setitem__, reference_less="unusable")
    finally:
        backend.start = started
    assert calls == [] and [e.usable for e in again] == [e.usable for e in entries]


# ------------------------------------------------------------------ warm pool, snapshots, reaper


def test_warm_pool_hands_out_started_sandboxes_and_refills(backend):
    from infra.sandbox.pool import WarmPool

    pool = WarmPool(backend, max_parallel_starts=2)
    try:
        pool.ensure(BASE_IMAGE, 3)
        assert pool.wait_ready(60)
        box, warm = pool.acquire(BASE_IMAGE)
        assert warm and box.exec("echo ok", 5).output.strip() == "ok"
        box.close()
        assert pool.wait_ready(60) and pool.idle(BASE_IMAGE) == 3  # topped back up to demand
        # an idle container that died (dockerd restart, docker rm) is never handed out
        victim = pool._idle[pool._key(BASE_IMAGE, None, None, False)][0]
        subprocess.run(["docker", "rm", "-f", victim.sandbox_id], check=True, capture_output=True)
        boxes = [pool.acquire(BASE_IMAGE) for _ in range(3)]
        assert pool.stats["stale"] == 1 and sum(w for _, w in boxes) == 2  # one cold start made up for it
        assert all(b.exec("true", 5).exit_code == 0 for b, _ in boxes)
        for b, _ in boxes:
            b.close()
        other, warm = pool.acquire(BASE_IMAGE, memory_mb=200)  # other limits: another queue
        assert not warm
        other.close()
    finally:
        pool.close()
    from infra.sandbox.docker_backend import owner_id

    mine = {"label": ["agentrl.pool=warm", f"agentrl.owner={owner_id()}"]}  # not other runs' containers
    assert backend.client.containers.list(all=True, ignore_removed=True, filters=mine) == []


def test_snapshot_skips_expensive_setup(backend):
    from infra.sandbox.pool import WarmPool

    pool = WarmPool(backend)
    setup = f"sleep 2; echo ready-{time.time_ns()} > /opt/setup-done"
    try:
        t0 = time.monotonic()
        snap = pool.snapshot(BASE_IMAGE, setup)
        first_s = time.monotonic() - t0
        t0 = time.monotonic()
        assert pool.snapshot(BASE_IMAGE, setup) == snap  # cached by image digest and command
        assert time.monotonic() - t0 < 1.5 <= first_s
        box, _ = pool.acquire(snap)
        assert box.exec("cat /opt/setup-done", 5).output.startswith("ready-")
        box.close()
        with pytest.raises(SandboxInfraError, match="set-up exited 3"):
            pool.snapshot(BASE_IMAGE, "exit 3")
    finally:
        pool.close()
        backend.client.images.remove(snap, force=True)


def test_orphan_reaper_removes_only_dead_owners(backend):
    dead_owner = f"{socket.gethostname()}:999999"
    orphan = backend.client.containers.run(BASE_IMAGE, ["sleep", "infinity"], detach=True, network_mode="none",
                                           labels={"agentrl": "1", "agentrl.owner": dead_owner})
    foreign = backend.client.containers.run(BASE_IMAGE, ["sleep", "infinity"], detach=True, network_mode="none",
                                            labels={"agentrl": "1", "agentrl.owner": "other-host:1"})
    mine = backend.start(BASE_IMAGE, {"agentrl.test": "reaper"})
    try:
        assert backend.reap_orphans() >= 1  # ours, plus any a crashed earlier run left on this engine
        ours = backend.client.containers.list(all=True, ignore_removed=True, filters={"label": "agentrl=1"})
        left = {c.id for c in ours}
        assert orphan.id not in left and foreign.id in left and mine._container.id in left
    finally:
        foreign.remove(force=True)
        mine.close()


def test_model_breaking_its_sandbox_is_told_apart_from_an_outside_kill(backend):
    broken = backend.start(BASE_IMAGE, {"agentrl.test": "broken"})
    killed = backend.start(BASE_IMAGE, {"agentrl.test": "killed"})
    try:
        with pytest.raises(SandboxInfraError) as err:  # the model kills the sandbox's main process itself
            broken.exec("kill -9 $(cat /proc/1/task/1/children)", 5)
            time.sleep(0.5)
            broken.exec("true", 5)
        assert err.value.reason == "environment_broken"
        subprocess.run(["docker", "kill", killed.sandbox_id], check=True, capture_output=True)
        with pytest.raises(SandboxInfraError) as err:  # killed from outside: infra
            killed.exec("true", 5)
        assert err.value.reason == "container_vanished"
    finally:
        broken.close()
        killed.close()


def test_setup_command_is_snapshotted_once(backend, tmp_path):
    shutil.copytree(HARBOR / "write-greeting", tmp_path / "slow-setup")
    toml = tmp_path / "slow-setup" / "task.toml"
    marker = f"ready-{time.time_ns()}"
    toml.write_text(toml.read_text().replace("[environment]", f"[environment]\nsetup_command = \"sleep 1; echo "
                                             f"{marker} > /opt/setup-done\""))
    task = load_harbor_task(tmp_path / "slow-setup")
    entries, logs = build_catalog(backend, {task.task_id: task}, {task.task_id: "train"}, validate=False)
    (entry,) = entries
    assert entry.usable and entry.image.startswith("agentrl-snapshot-"), entry
    box = backend.start(entry.image, {"agentrl.test": "snapshot"})
    try:
        assert box.exec("cat /opt/setup-done", 5).output.strip() == marker
    finally:
        box.close()
        backend.client.images.remove(entry.image, force=True)


@pytest.mark.engine_exclusive
def test_engine_restart_during_starts_leaves_no_container(backend):
    """Starts racing a dockerd restart: every container created is removed, reply lost or not."""
    import threading

    from infra import services
    from infra.environments import BASE_IMAGE
    from infra.sandbox.base import SandboxInfraError
    from infra.sandbox.docker_backend import OWNER_LABEL, owner_id

    if "dockerd" not in services._running(services.state_path()):
        pytest.skip("dockerd was not started by `make up`; an external engine is never restarted")
    run = uuid.uuid4().hex[:8]
    stop = threading.Event()
    failures = []

    def starter() -> None:
        while not stop.is_set():
            try:
                backend.start(BASE_IMAGE, {"agentrl.test": run}).close()
            except SandboxInfraError as err:
                failures.append(err.reason)
                time.sleep(0.05)
            except Exception as err:  # noqa: BLE001 - anything else escaping start() is a bug
                failures.append(f"unexpected {type(err).__name__}: {err}")
                return

    threads = [threading.Thread(target=starter) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(2)
    services.restart_engine(down_s=1.0)
    time.sleep(3)
    stop.set()
    for t in threads:
        t.join(120)
    assert backend.wait_engine(60)
    backend.sweep_leftovers()
    left = backend.client.containers.list(all=True, ignore_removed=True,
                                          filters={"label": [f"agentrl.test={run}", f"{OWNER_LABEL}={owner_id()}"]})
    assert failures, "no start hit the restart"
    assert not [f for f in failures if f.startswith("unexpected")], failures
    assert left == [], [(c.short_id, c.status) for c in left]
