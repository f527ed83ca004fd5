"""docs/generation.md: its example runs as written (tokens equal eager, 2 graphs, 1 region)."""

import re
from pathlib import Path

import fxpass.report

DOC = Path(__file__).resolve().parents[2] / "docs" / "generation.md"


def test_generation_doc_example_runs(monkeypatch):
    (block,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    # the example counts reports from a fresh process; start this one's list empty
    monkeypatch.setattr(fxpass.report, "COMPILE_REPORTS", [])
    import fxpass.backends.bpu.backend as backend

    monkeypatch.setattr(backend, "REPORTS", fxpass.report.COMPILE_REPORTS)
    exec(compile(block, str(DOC), "exec"), {})
