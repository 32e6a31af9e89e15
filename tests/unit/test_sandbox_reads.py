"""DockerSandbox.get_file over archive streams the engine cut short (a file that changed while it was read)."""

from __future__ import annotations

import io
import tarfile

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

    def __init__(self, streams: list[bytes]):
        self.streams, self.calls = streams, 0

    def get_archive(self, path):
        raw = self.streams[min(self.calls, len(self.streams) - 1)]
        self.calls += 1
        return iter([raw[:700], raw[700:]]), {}


def test_a_read_cut_short_is_read_again():
    box = DockerSandbox(_Container([_tar("reward.txt", b"1\n", cut_to=0), _tar("reward.txt", b"0\n")]))
    assert box.get_file("/logs/verifier/reward.txt") == b"0\n"
    assert box._container.calls == 2


def test_a_file_that_never_holds_still_reads_as_what_was_sent():
    box = DockerSandbox(_Container([_tar("log", b"abcdef", cut_to=3)]))
    assert box.get_file("/log") == b"abc"
    assert box._container.calls == _CHANGING_FILE_READS


def test_a_whole_read_is_read_once():
    box = DockerSandbox(_Container([_tar("log", b"abcdef")]))
    assert box.get_file("/log") == b"abcdef" and box._container.calls == 1
