from pathlib import Path

P = Path("/app/hello.txt")


def test_file_exists():
    assert P.is_file(), "/app/hello.txt does not exist"


def test_content():
    assert P.read_text().strip() == "hello world"
