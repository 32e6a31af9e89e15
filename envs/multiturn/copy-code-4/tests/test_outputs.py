from pathlib import Path

CODE = "2961"  # only in /app/code.txt: the agent has to read it first


def test_answer():
    assert Path("/app/answer.txt").read_text().strip() == CODE


def test_code_untouched():
    assert Path("/app/code.txt").read_text().strip() == CODE
