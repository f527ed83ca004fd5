"""The host executor: onnxruntime standing in for the board on any machine. A region's ONNX
model is prepared for onnxruntime's fused CPU kernels (prepare: onnxscript's fusions, weights
read in place, prepacking), with fusions of our own where onnxruntime has a kernel and
onnxscript no pattern (attention, rotary, row_write, output_view; onnx_match is their matcher)."""
