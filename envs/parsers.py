"""Terminal-Bench 1.x test-output parsers: what ``run-tests.sh`` printed -> per-test pass/fail.

The same semantics as upstream's ``terminal_bench/parsers/`` (terminal-bench 0.2.18), one function
per ``parser_name`` of task.yaml:

- ``pytest`` (``pytest_parser.py``, ``PytestParser``): the text after the first
  ``=== short test summary info ===`` line (case-insensitive) holds one line per test
  (``pytest -rA``): ``PASSED``, ``XFAIL`` and ``SKIPPED`` count as passed, ``FAILED``, ``XPASS`` and
  ``ERROR`` as failed; a ``FAILED ... - description`` line loses its last `` - `` part; other lines
  are ignored. No summary line at all is a parse error.
- ``swebench`` / ``sweperf`` (``swebench_parser.py``, ``sweperf_parser.py``): the block between
  ``SWEBench results starts here`` and ``... ends here`` (``SWE-Perf`` for sweperf) must be
  exactly ``PASSED``; missing markers are a parse error.
- ``mlebench`` (``mlebench_parser.py``): the block between its markers (missing markers: the
  whole text) must be exactly ``ALL TESTS PASSED``.
- ``swelancer`` (``swelancer_parser.py``): passed when the text contains ``swe lancer success``,
  or no ``swe lancer failure`` but both ``user_tool`` and ``completed`` (case-insensitive).

Upstream parses the tmux pane; here the parsers read the script's merged stdout and stderr,
with terminal escape codes removed first (``tmux capture-pane`` drops them too). Upstream does
not re-join lines tmux wrapped at the pane width; the plain output here has no such wrapping.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from infra.task_faults import strip_ansi

__all__ = ["PARSERS", "ParseError", "parse_test_output"]


class ParseError(ValueError):
    """The output holds no result section the parser recognises (upstream: ``FailureMode.PARSE_ERROR``)."""


# pytest_parser.py: PytestTestStatus, SHORT_TEST_SUMMARY_INFO_PATTERN, FAILED_DESCRIPTION_DELIMETER
_PYTEST_PASSED = frozenset({"PASSED", "XFAIL", "SKIPPED"})
_PYTEST_FAILED = frozenset({"FAILED", "XPASS", "ERROR"})
_SUMMARY = re.compile(r"=+\s*short test summary info\s*=+", re.IGNORECASE)
_DESCRIPTION = " - "


def _pytest_line(line: str) -> tuple[str, bool] | None:
    """``(test name, passed)`` of one summary line, None when it is not a result line (``_parse_result_line``)."""
    if line.startswith("FAILED"):
        parts = line.split(_DESCRIPTION)
        if len(parts) > 1:
            line = _DESCRIPTION.join(parts[:-1])
    parts = line.split(maxsplit=1)
    if len(parts) <= 1:
        return None
    status = parts[0].strip().strip(":")
    if status not in _PYTEST_PASSED | _PYTEST_FAILED:
        return None
    name = parts[1].strip().split("::", maxsplit=1)[-1]
    if not name:
        return None
    return name, status in _PYTEST_PASSED


def parse_pytest(text: str) -> dict[str, bool]:
    """Upstream ``PytestParser.parse``: test name -> passed, from the short test summary.

    Tests with the same name (``a.py::test_x`` and ``b.py::test_x``) collapse into one entry, the
    later line winning, as upstream's dict does.

    Raises:
        ParseError: no ``short test summary info`` line.
    """
    parts = _SUMMARY.split(text, maxsplit=1)
    if len(parts) < 2:
        raise ParseError("no 'short test summary info' section in the test output (did pytest run with -rA?)")
    results: dict[str, bool] = {}
    for line in parts[1].splitlines():
        parsed = _pytest_line(line)
        if parsed is not None:
            results[parsed[0]] = parsed[1]
    return results


def _between(text: str, start: str, end: str, required: bool) -> str:
    if required and (start not in text or end not in text):
        raise ParseError(f"no result block between {start!r} and {end!r} in the test output")
    return text.split(start, 1)[-1].rsplit(end, 1)[0].strip()


def parse_swebench(text: str) -> dict[str, bool]:
    """Upstream ``SWEBenchParser.parse``: one result, passed iff the marked block is ``PASSED``.

    Raises:
        ParseError: either marker is missing.
    """
    return {"tests": _between(text, "SWEBench results starts here", "SWEBench results ends here", True) == "PASSED"}


def parse_sweperf(text: str) -> dict[str, bool]:
    """Upstream ``SWEPerfParser.parse``: one result, passed iff the marked block is ``PASSED``.

    Raises:
        ParseError: either marker is missing.
    """
    return {"tests": _between(text, "SWE-Perf results starts here", "SWE-Perf results ends here", True) == "PASSED"}


def parse_mlebench(text: str) -> dict[str, bool]:
    """Upstream ``MLEBenchParser.parse``: one result, passed iff the block is ``ALL TESTS PASSED`` (never raises)."""
    block = _between(text, "MLEBench results starts here", "MLEBench results ends here", False)
    return {"tests": block == "ALL TESTS PASSED"}


def parse_swelancer(text: str) -> dict[str, bool]:
    """Upstream ``SWELancerParser.parse``: one result from the success/failure phrases (never raises)."""
    low = text.lower()
    if "swe lancer success" in low:
        return {"swelancer_task": True}
    if "swe lancer failure" in low:
        return {"swelancer_task": False}
    return {"swelancer_task": "user_tool" in low and "completed" in low}


PARSERS: dict[str, Callable[[str], dict[str, bool]]] = {
    "pytest": parse_pytest, "swebench": parse_swebench, "swelancer": parse_swelancer,
    "mlebench": parse_mlebench, "sweperf": parse_sweperf,
}
"""``parser_name`` -> parser, as upstream's ``ParserFactory.PARSER_NAME_TO_CLASS``."""


def parse_test_output(parser_name: str, text: str) -> dict[str, bool]:
    """Per-test results of ``text`` (escape codes removed) under the named parser.

    Raises:
        KeyError: ``parser_name`` is not one of :data:`PARSERS` (the loader checks this first).
        ParseError: the output holds no result section for this parser.
    """
    return PARSERS[parser_name](strip_ansi(text))
