"""An onnxruntime ``IOBinding`` for the host executor's per-call path (``OrtExecutor._bound``)."""

from __future__ import annotations

import functools
from typing import Any


class Binding:
    """An onnxruntime ``IOBinding`` whose per-call binds and run go straight to its C object.

    Why: the Python wrapper makes a device object for every bind and checks WebGPU graph
    capture on every run: about 2 us a call warm, and more in a decode step, where each call
    follows a run that left the CPU's caches full of weights; a decode step
    binds its token, its position's inputs and its logits every time. An onnxruntime
    without those private attributes gets the wrapper's own methods (so does every binding
    with ``fast`` False)."""

    fast = True

    def __init__(self, session: Any):
        self.py = b = session.io_binding()
        c, sess = getattr(b, "_iobinding", None), getattr(session, "_sess", None)
        try:
            from onnxruntime.capi.onnxruntime_inference_collection import OrtDevice

            cpu = OrtDevice.make("cpu", 0)._get_c_device()
        except Exception:  # noqa: BLE001 - another onnxruntime: the wrapper's path
            c = None
        if not self.fast or c is None or sess is None or getattr(b, "_is_webgpu_session", False):
            self.cpu = "cpu"  # (name, device, dtype, shape, pointer), as the C methods take
            self.bind_input = lambda n, _, dtype, shape, ptr: b.bind_input(n, "cpu", 0, dtype,
                                                                           shape, ptr)
            self.bind_output = lambda n, _, dtype, shape, ptr: b.bind_output(n, "cpu", 0, dtype,
                                                                             shape, ptr)
            self.run = functools.partial(session.run_with_iobinding, b)
            return
        self.cpu, self.bind_input, self.bind_output = cpu, c.bind_input, c.bind_output
        self.run = functools.partial(sess.run_with_iobinding, c, None)
