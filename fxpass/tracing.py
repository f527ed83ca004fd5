"""Trace a function to an aten graph under a clean mode: the core's one tracer.

Why here, in the core: :func:`fxpass.pattern.pattern_from` traces its example at import time of
the rule module that calls it, and a built-in rule (``rms_norm``) does; so tracing cannot live in
the property-testing kit, which needs Hypothesis (``fxpass.testing`` re-exports :func:`trace`).

Why a clean mode: a plugin may be first imported anywhere, and that is often *inside*
``torch.compile`` (the backend loads the plugin registry while Dynamo's tracing context and its
fake mode are active). Dynamo's fake mode is then the one ``detect_fake_mode`` reports, and a
trace made there mixes its tensors with ours ("Mixing fake modes NYI"). :func:`clean_mode` steps
outside both for the duration, so the trace is the same wherever it runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.fx import GraphModule

__all__ = ["clean_mode", "trace"]


@contextlib.contextmanager
def clean_mode() -> Iterator[None]:
    """No ambient fake mode and no Dynamo tracing context until the block ends (both restored
    after it): what importing a plugin, or tracing an example, should see wherever it runs."""
    from torch._guards import tracing
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), tracing(None):
        yield


def trace(fn: Callable[..., Any], *examples: torch.Tensor) -> GraphModule:
    """``fn``'s aten graph, traced with make_fx on fake copies of ``examples`` under one fake
    mode (what the rewriter needs: ``make_fx`` on real tensors gives each node its own mode),
    under :func:`clean_mode`. Only the examples' shapes, dtypes and strides matter."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with clean_mode(), FakeTensorMode() as mode:
        return make_fx(fn, pre_dispatch=False)(*[mode.from_tensor(e) for e in examples])
