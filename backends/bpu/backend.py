"""``torch.compile(model, backend="fxpass_bpu")``: the ``torch_dynamo_backends`` entry point."""

from fxpass.jit.backend import backend_for

fxpass_bpu = backend_for("bpu")
