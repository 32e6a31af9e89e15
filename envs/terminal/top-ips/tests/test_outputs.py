from pathlib import Path

EXPECTED = [(9, "10.0.0.5"), (7, "192.168.1.20"), (5, "172.16.4.2")]


def _rows():
    rows = []
    for line in Path("/app/top3.txt").read_text().splitlines():
        if line.strip():
            count, ip = line.split()
            rows.append((int(count), ip))
    return rows


def test_file_exists():
    assert Path("/app/top3.txt").is_file()


def test_top3():
    assert _rows() == EXPECTED
