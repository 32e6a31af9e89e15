from pathlib import Path


def test_port_file_exists():
    assert Path("/app/port.txt").is_file()


def test_port_value():
    assert Path("/app/port.txt").read_text().strip() == "8743"
