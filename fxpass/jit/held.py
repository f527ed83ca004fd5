"""Whether the graph now called on this thread may skip its weight guard: a flag the caller
that knows nothing wrote the weights since the last check sets (``fxpass.hf.steps``), and
``fxpass.jit.guarded`` reads. Its own module: the caller must not import the compiler."""

from __future__ import annotations

import threading


class Held(threading.local):
    """Per thread: whether the graph now called may skip its weight guard (``on``).

    Why: the guard reads every frozen weight's pointer, version, shape and dtype, about 80 us
    per decode step on Qwen3 4 x 512 right after a region has streamed the weights through the
    caches. ``fxpass.hf.steps`` sets ``on`` for a trusted decode step of a ``generate()`` call
    in which nothing but the library's own code runs between steps: the step before checked
    the same weights, and nothing since could have written them."""

    def __init__(self) -> None:
        self.on = False


HELD = Held()
