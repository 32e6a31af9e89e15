"""DockerSandbox.get_file over archive streams the engine cut short (a file that changed while it was read), and
exec_run calls the runtime could not start (a sandbox at its pids limit)."""

from __future__ import annotations

import io
import tarfile
from types import SimpleNamespace

import pytest
import requests

from infra.sandbox.base import SandboxInfraError
from infra.sandbox.docker_backend import _CHANGING_FILE_READS, _EXEC_START_ATTEMPTS, DockerSandbox


def _tar(name: str, data: bytes, cut_to: int | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    return raw if cut_to is None else raw[:512 + cut_to]  # header, then only cut_to of the promised bytes


class _Container:
    """What the engine sent for each get_archive call, in order (the last one repeats)."""

    short_id = "fake"

    def __init__(self, streams: list[bytes], cut_chunked: bool = False):
        self.streams, self.calls, self.cut_chunked = streams, 0, cut_chunked

    def get_archive(self, path):
        raw = self.streams[min(self.calls, len(self.streams) - 1)]
        self.calls += 1
        return self._chunks(raw), {}

    def _chunks(self, raw: bytes):
        yield raw[:700]
        if raw[700:]:
            yield raw[700:]
        if self.cut_chunked:  # requests' error when the engine closes a chunked body early
            raise requests.exceptions.ChunkedEncodingError("Connection broken: IncompleteRead")


def test_a_read_cut_short_is_read_again():
    box = DockerSandbox(_Container([_tar("reward.txt", b"1\n", cut_to=0), _tar("reward.txt", b"0\n")]))
    assert box.get_file("/logs/verifier/reward.txt") == b"0\n"
    assert box._container.calls == 2


def test_a_file_that_never_holds_still_reads_as_the_last_read_sent():
    streams = [_tar("log", b"abcdef", cut_to=3)] * (_CHANGING_FILE_READS - 1) + [_tar("log", b"xyzuvw", cut_to=2)]
    box = DockerSandbox(_Container(streams, cut_chunked=True))  # what came before the cut is kept
    assert box.get_file("/log") == b"xy"
    assert box._container.calls == _CHANGING_FILE_READS


def test_reads_cut_before_the_header_are_an_infra_error_not_empty_bytes():
    box = DockerSandbox(_Container([_tar("log", b"abcdef")[:300]], cut_chunked=True))
    with pytest.raises(SandboxInfraError) as err:
        box.get_file("/log")
    assert err.value.reason == "file_unstable"


def test_a_whole_read_is_read_once():
    box = DockerSandbox(_Container([_tar("log", b"abcdef")]))
    assert box.get_file("/log") == b"abcdef" and box._container.calls == 1


_NOT_STARTED = SimpleNamespace(exit_code=126, output=b"OCI runtime exec failed: exec failed: unable to start container "
                                                     b"process: read init-p: connection reset by peer: unknown\r\n")


class _ExecContainer:
    """exec_run answers, in order (the last one repeats); the argv of each call is kept."""

    short_id = "fake"

    def __init__(self, results):
        self.results, self.argvs = results, []

    def exec_run(self, argv):
        self.argvs.append(argv)
        return self.results[min(len(self.argvs) - 1, len(self.results) - 1)]


def test_a_stop_the_runtime_could_not_start_is_started_again(monkeypatch):
    monkeypatch.setattr("infra.sandbox.docker_backend.time.sleep", lambda s: None)
    box = DockerSandbox(_ExecContainer([_NOT_STARTED, _NOT_STARTED, SimpleNamespace(exit_code=0, output=b"1022\n")]))
    box._keep_pids = (1, 7)
    assert box.stop_agent_processes() == 1022 and len(box._container.argvs) == 3


def test_a_stop_that_never_starts_is_an_infra_error_not_zero_killed(monkeypatch):
    monkeypatch.setattr("infra.sandbox.docker_backend.time.sleep", lambda s: None)
    box = DockerSandbox(_ExecContainer([_NOT_STARTED]))
    box._keep_pids = (1, 7)
    with pytest.raises(SandboxInfraError) as err:
        box.stop_agent_processes()
    assert err.value.reason == "exec_start_failed" and "read init-p" in str(err.value)
    assert len(box._container.argvs) == _EXEC_START_ATTEMPTS


def test_a_command_failing_with_126_is_not_started_again():
    box = DockerSandbox(_ExecContainer([SimpleNamespace(exit_code=126, output=b"sh: 1: ./x: Permission denied\n")]))
    assert box._exec_run("exec", ["./x"]).exit_code == 126 and len(box._container.argvs) == 1
