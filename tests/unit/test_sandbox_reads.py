"""DockerSandbox.get_file over archive streams the engine cut short (a file that changed while it was read)."""

from __future__ import annotations

import io
import tarfile

import pytest
import requests

from infra.sandbox.base import SandboxInfraError
from infra.sandbox.docker_backend import _CHANGING_FILE_READS, DockerSandbox


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
