import threading

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """A fresh Dynamo, and no compile reports from earlier tests: tests count the reports
    their compiles add, and the list keeps the last 256 only."""
    from fxpass.report import COMPILE_REPORTS

    torch._dynamo.reset()
    COMPILE_REPORTS.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _threads_of_earlier_tests():
    """Vouch for the threads earlier tests left alive (importing openvino starts a thread
    pool worker that idles for good): none calls a compiled function, and a test that counts
    generate()'s trusted steps (``fxpass.hf.steps.alone``) must see only its own threads."""
    from fxpass.hf.steps import ignore_thread

    for t in threading.enumerate():
        if t is not threading.current_thread():
            ignore_thread(t)


@pytest.fixture
def opts(tmp_path):
    """Backend options for tiny test models: no MAC threshold, a private cache."""
    return {"min_compute_macs": 0, "cache_dir": str(tmp_path / "cache")}
