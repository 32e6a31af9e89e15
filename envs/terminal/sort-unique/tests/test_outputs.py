from pathlib import Path

EXPECTED = sorted({
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog",
    "sleeps", "runs", "apple", "banana", "cherry",
})


def _lines():
    return [l.strip() for l in Path("/app/unique.txt").read_text().splitlines()]


def test_file_exists():
    assert Path("/app/unique.txt").is_file()


def test_exact_words_sorted_unique():
    assert _lines() == EXPECTED
