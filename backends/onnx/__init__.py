"""ONNX plumbing shared by every device that consumes ONNX: the aten-to-ONNX lowering and its
op table (lowering), the onnxruntime executor and its host fusions (host), Q/DQ quantization
and calibration (quantize, calibration). Per-device data (op families, limits) is handed in
by the device, not imported from it."""
