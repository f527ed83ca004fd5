"""``torch.compile(model, backend="fxpass_ort")``: the ``torch_dynamo_backends`` entry point."""

from fxpass.jit.backend import backend_for

fxpass_ort = backend_for("ort")
