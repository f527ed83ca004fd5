import os

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
