"""The device path: what the BPU can run (capability, cost), which subgraphs go to it
(partition, region), how a region becomes an ONNX model for hbdk4 (lowering), integer
quantization and calibration, and the board's compile and executor (board).

Nothing here imports the host executor (``fxpass.backends.bpu.host``): the host stands in for
the board, not the other way round."""
