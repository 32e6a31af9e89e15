from pathlib import Path

EXPECTED = 1065  # 120+75+300+42+150+90+63+225


def test_total_file_exists():
    assert Path("/app/total.txt").is_file()


def test_total_value():
    text = Path("/app/total.txt").read_text().strip()
    assert float(text) == EXPECTED  # accepts "1065" or "1065.0"
