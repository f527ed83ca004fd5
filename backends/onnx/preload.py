"""Import onnxruntime on a background thread while AOTAutograd traces the graph.

Why: a host device needs it (its keys name the version, its regions run in it), and loading
its native module took 0.03-0.3 s of the backend's own time in a fresh process (0.3 s after a
Qwen3 trace: ``python -m benchmarks.compile_time --profile``), most of a warm plan hit.
Loading it while the main thread traces uses the other core; the first import in the main
thread then waits for this one (Python's import lock) or finds it done. A failure here is
ignored: the real import raises it where it is needed."""

from __future__ import annotations

import contextlib
import sys
import threading

_PRELOAD: list[threading.Thread] = []


def preload_onnxruntime() -> None:
    if _PRELOAD or "onnxruntime" in sys.modules:
        return

    def load() -> None:
        with contextlib.suppress(Exception):
            import onnxruntime  # noqa: F401

    t = threading.Thread(target=load, name="fxpass-preload", daemon=True)
    _PRELOAD.append(t)
    t.start()
