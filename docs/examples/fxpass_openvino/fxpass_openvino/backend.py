"""``torch.compile(model, backend="fxpass_openvino")``: the ``torch_dynamo_backends`` entry."""

from fxpass.jit.backend import backend_for

fxpass_openvino = backend_for("openvino")
