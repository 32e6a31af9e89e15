"""What a task's image build context holds (infra/sandbox/docker_backend._context_tar): logic only, no engine."""

import io
import tarfile

from infra.sandbox.docker_backend import _context_tar, copied_hidden


def _names(raw: bytes) -> list[str]:
    return sorted(tarfile.open(fileobj=io.BytesIO(raw)).getnames())


def test_hidden_files_stay_out_unless_the_dockerfile_copies_them(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "deps").mkdir()
    for rel in ("tests/test_outputs.py", "tests/create_dataset.py", "solution.sh", "run-tests.sh", "deps/a.txt"):
        (tmp_path / rel).write_text(rel)
    (tmp_path / "Dockerfile").write_text("FROM x\nCOPY deps/ ./\n")
    assert _names(_context_tar(tmp_path)[0]) == ["Dockerfile", "deps/a.txt"]
    # as mnist-learning-fix's Dockerfile (upstream builds from the whole folder): the named file, not the tests
    (tmp_path / "Dockerfile").write_text("FROM x\nCOPY deps/ ./\nCOPY tests/create_dataset.py ./\n")
    assert _names(_context_tar(tmp_path)[0]) == ["Dockerfile", "deps/a.txt", "tests/create_dataset.py"]


def test_copied_hidden_reads_copy_and_add_sources_not_destinations():
    text = ('COPY . /app\nCOPY ["tests/a.py", "tests/b/", "/x/"]\nADD --chown=1 ./solution.sh /s\n'
            "COPY --from=build /app/documents /app/documents\nCOPY deps/ /tests/\n")
    assert copied_hidden(text) == {"tests/a.py", "tests/b", "solution.sh"}
