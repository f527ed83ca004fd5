import os
import threading

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

os.environ.setdefault("FXPASS_CHECK", "1")  # contract checks are always on in tests


def trace(fn, *inputs):
    """An aten GraphModule of ``fn`` with meta['val'] on every node."""
    return make_fx(fn, tracing_mode="fake")(*inputs)


@pytest.fixture
def tracer():
    return trace


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers on a 2-core machine: each keeps torch's own ops on one thread, so neither
    # spins OpenMP workers on the core the other is using (tests that need more set it)
    torch.set_num_threads(1)
    # execnet's I/O thread (started below `threading`) never calls a compiled function: it
    # must not keep generate()'s decode steps on every guard (fxpass.hf.steps)
    import sys

    from fxpass.hf.steps import ignore_thread

    for ident in sys._current_frames():
        if ident != threading.get_ident():
            ignore_thread(ident)
