from pathlib import Path

WANT = ["London", "Wilmslow", "Arlington", "Helsinki", "Boston"]


def test_cities_file_exists():
    assert Path("/app/cities.txt").is_file()


def test_cities_in_order():
    assert Path("/app/cities.txt").read_text().split("\n")[:5] == WANT
    assert [c for c in Path("/app/cities.txt").read_text().splitlines() if c.strip()] == WANT
