from pathlib import Path

EXPECTED = 5  # lines containing ERROR in the shipped app.log


def test_count_file_exists():
    assert Path("/app/count.txt").is_file()


def test_count_value():
    assert Path("/app/count.txt").read_text().strip() == str(EXPECTED)


def test_log_untouched():
    lines = Path("/app/app.log").read_text().splitlines()
    assert sum("ERROR" in l for l in lines) == EXPECTED
