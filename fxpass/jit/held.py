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
    that runs none of the caller's code between steps (``fxpass.hf.quiet``): the step before
    checked the same weights. The first guarded graph called takes the flag (sets it back to
    False): a trusted forward runs one graph, and any graph called from inside it checks its
    own weights.

    ``tap``: a list while ``fxpass.hf.replay`` watches a forward call (None otherwise): every
    guarded graph called appends (itself, its arguments, its outputs), so the watcher learns
    which compiled graph a decode step ran and with what."""

    def __init__(self) -> None:
        self.on = False
        self.tap: list | None = None


HELD = Held()
