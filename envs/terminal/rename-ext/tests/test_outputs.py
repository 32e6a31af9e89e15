from pathlib import Path

D = Path("/app/docs")
EXPECTED = {
    "intro": "Project intro.",
    "install": "How to install.",
    "usage": "Usage notes.",
    "faq": "Frequently asked questions.",
}


def test_no_txt_left():
    assert sorted(p.name for p in D.glob("*.txt")) == []


def test_md_files_with_content():
    for stem, text in EXPECTED.items():
        p = D / f"{stem}.md"
        assert p.is_file(), f"missing {p}"
        assert p.read_text().strip() == text


def test_other_files_untouched():
    assert (D / "notes.rst").read_text().strip() == "keep me"
