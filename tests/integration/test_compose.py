"""Multi-service tasks through Docker Compose on a real dockerd (infra/sandbox/compose.py).

One task written here that validates end to end (a client and a server it must query), and two
real ones vendored verbatim (tests/fixtures/real_tasks) whose reference solutions use their second
service: Terminal-Bench's ``simple-web-scraper`` and Harbor's cookbook ``multi-container``.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from envs.taskset import load_taskset
from envs.terminal_bench import load_terminal_task
from infra.environments import BASE_IMAGE, build_catalog
from infra.sandbox.compose import PROJECT_LABEL
from tests.integration.test_sandbox import AGENT_CAP_EFF

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "real_tasks"
COMPOSE = """\
services:
  client:
    build: {context: client}
    image: ${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}
    container_name: ${T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME}
    command: ["sh", "-c", "sleep infinity"]
    environment: ["TEST_DIR=${T_BENCH_TEST_DIR}"]
    volumes: ["${T_BENCH_TASK_LOGS_PATH}:${T_BENCH_CONTAINER_LOGS_PATH}"]
    depends_on:
      server: {condition: service_healthy}
  server:
    build: {context: server}
    command: ["python3", "-m", "http.server", "8000", "--directory", "/srv"]
    healthcheck:
      test: ["CMD", "python3", "-c", "import urllib.request as u; u.urlopen('http://localhost:8000')"]
      interval: 1s
      retries: 30
"""
TEST = """\
import urllib.request
from pathlib import Path


def test_answer_is_the_servers_secret():
    secret = urllib.request.urlopen("http://server:8000/secret.txt", timeout=5).read().decode().strip()
    assert Path("/app/answer.txt").read_text().strip() == secret
"""
SOLUTION = ("python3 -c \"import urllib.request as u; print(u.urlopen('http://server:8000/secret.txt')"
            ".read().decode().strip())\" > /app/answer.txt\n")


@pytest.fixture(scope="module")
def two_service(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks") / "fetch-secret"
    (d / "client").mkdir(parents=True)
    (d / "client" / "Dockerfile").write_text(f"FROM {BASE_IMAGE}\nWORKDIR /app\n")
    (d / "server").mkdir()
    (d / "server" / "Dockerfile").write_text(f"FROM {BASE_IMAGE}\nRUN mkdir -p /srv && echo s3cr3t-42 > "
                                             "/srv/secret.txt\n")
    (d / "docker-compose.yaml").write_text(COMPOSE)
    (d / "task.yaml").write_text("instruction: Write the secret that http://server:8000/secret.txt serves to "
                                 "/app/answer.txt.\n")
    (d / "run-tests.sh").write_text("#!/bin/bash\npytest $TEST_DIR/test_outputs.py -rA -p no:cacheprovider\n")
    (d / "tests").mkdir()
    (d / "tests" / "test_outputs.py").write_text(TEST)
    (d / "solution.sh").write_text(SOLUTION)
    return d


def _projects(backend) -> set[str]:
    return {c.labels[PROJECT_LABEL] for c in backend.client.containers.list(all=True, ignore_removed=True,
                                                                          filters={"label": PROJECT_LABEL})}


def test_two_service_task_validates_through_compose(backend, two_service):
    task = load_terminal_task(two_service)
    before = _projects(backend)
    entries, logs = build_catalog(backend, {task.task_id: task}, {task.task_id: "train"}, max_parallel_builds=1)
    (entry,) = entries
    # the reference solution read the server's secret; a do-nothing agent did not pass
    assert (entry.usable, entry.validation) == (True, "passed"), logs[task.task_id][-3000:]
    assert "service server: agentrl-task-fetch-secret-server:" in logs[task.task_id]
    assert _projects(backend) == before  # every project taken down after validation


def test_agent_service_is_isolated_and_reaches_only_its_services(backend, two_service):
    task = load_terminal_task(two_service)
    entries, _ = build_catalog(backend, {task.task_id: task}, {task.task_id: "train"}, validate=False)
    box = backend.start(entries[0].image, {"agentrl.test": "compose"}, **task.limits.kwargs())
    try:
        assert box.run_in_shell("cd /tmp && export X=1", 10).exit_code == 0
        assert box.run_in_shell("pwd; echo $X", 10).output.split() == ["/tmp", "1"]  # the persistent shell
        assert box.exec("echo $TEST_DIR; ls /logs", 10).output.split() == ["/tests"]  # upstream's variables
        caps = box.exec("grep -E 'CapEff|NoNewPrivs' /proc/self/status", 5).output.split()
        assert caps == ["CapEff:", AGENT_CAP_EFF, "NoNewPrivs:", "1"]
        # a server on every address of the host answers on no network of the sandbox (each bridge's host side, .1)
        host_server = socket.create_server(("0.0.0.0", 0))
        port = host_server.getsockname()[1]
        probe = ("import socket, subprocess\n"
                 "ips = subprocess.run(['hostname', '-I'], capture_output=True, text=True).stdout.split()\n"
                 "for ip in ips:\n"
                 "    host = '.'.join(ip.split('.')[:3] + ['1'])\n"
                 "    try:\n"
                 f"        socket.create_connection((host, {port}), timeout=3).close(); print('REACHED', host)\n"
                 "    except OSError as e:\n"
                 "        print('blocked', host, type(e).__name__)\n")
        box.put_file(probe.encode(), "/app/probe.py")
        try:
            out = box.exec("python3 /app/probe.py", 30).output
        finally:
            host_server.close()
        assert "REACHED" not in out and "blocked" in out, out
    finally:
        box.close()


def test_real_two_service_task_runs_its_solution_against_its_server(backend):
    """simple-web-scraper: the solution scrapes http://server:8000 from the client (its tests need astral.sh)."""
    tasks, errors = load_taskset(FIXTURES / "terminal-bench")
    task = next(t for t in tasks if t.task_id == "tb/simple-web-scraper")
    entries, logs = build_catalog(backend, {task.task_id: task}, {task.task_id: "train"}, max_parallel_builds=1)
    (entry,) = entries
    log = logs[task.task_id]
    assert "service server:" in log and entry.image, log[-3000:]
    assert (entry.usable, entry.cause) == (False, "unreachable_host"), (entry, log[-3000:])
    assert entry.fix == "needs astral.sh, which this machine cannot reach"
    box = backend.start(entry.image, {"agentrl.test": "compose"}, **task.limits.kwargs())
    try:
        r = task.run_solution(box)
        books = box.get_file("/app/books.csv")
        assert books is not None, r.output
        assert b"The Great Gatsby" in books and b"F. Scott Fitzgerald" in books, books
    finally:
        box.close()


def test_real_harbor_multi_container_task_runs_its_solution_against_its_api(backend):
    """Harbor's cookbook multi-container: main (no build of its own: environment/Dockerfile) and a Flask api-server."""
    tasks, errors = load_taskset(FIXTURES / "harbor")
    assert errors == []
    (task,) = tasks
    assert task.limits.services is not None and task.limits.services.main == "main"
    entries, logs = build_catalog(backend, {task.task_id: task}, {task.task_id: "train"}, max_parallel_builds=1)
    (entry,) = entries
    log = logs[task.task_id]
    assert "service api-server:" in log and entry.image, log[-3000:]
    assert (entry.usable, entry.cause) == (False, "unreachable_host"), (entry, log[-3000:])
    assert entry.fix == "needs astral.sh, which this machine cannot reach"
    box = backend.start(entry.image, {"agentrl.test": "compose"}, **task.limits.kwargs())
    try:
        r = task.run_solution(box)
        items = box.get_file("/app/items.json")
        assert items is not None and b'"harbor"' in items, (r.output, items)
    finally:
        box.close()
