from pathlib import Path

CODE = "2048"  # only in /app/note.txt: the agent has to read it first


def test_answer():
    assert Path("/app/answer.txt").read_text().strip() == CODE


def test_note_untouched():
    assert Path("/app/note.txt").read_text() == "echo 2048 > /app/answer.txt\n"
