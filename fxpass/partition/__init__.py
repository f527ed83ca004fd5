"""Which subgraphs go to a device: the linear convex partitioner (partition), the cost model
(cost: MACs of mm, bmm, addmm, linear, matmul, baddbmm, convolution) and region extraction
and splicing (region). The device hands in its capability; nothing here knows one."""
