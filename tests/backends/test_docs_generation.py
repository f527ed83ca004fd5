"""docs/generation.md: its example runs as written (tokens equal eager, 2 graphs, 1 region)."""

import re
from pathlib import Path

import pytest

import fxpass.report

DOC = Path(__file__).resolve().parents[2] / "docs" / "generation.md"


@pytest.mark.slow  # the fast tier's 4-minute budget
def test_generation_doc_example_runs():
    (block,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    # The example counts reports from a fresh process: empty this one's list for it, in
    # place. (Swapping in a new list left the backend, when this test imported it first,
    # appending to the swapped-in list after the swap was undone: later tests then saw
    # compile_reports() empty.)
    reports = fxpass.report.COMPILE_REPORTS
    before = list(reports)
    reports.clear()
    try:
        exec(compile(block, str(DOC), "exec"), {})
    finally:
        reports[:0] = before
