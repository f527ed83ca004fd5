"""Run in a fresh process by test_export: load a package, call it, report what ran.

argv: package directory, inputs file (torch.save of (args, kwargs)), output file, and
optionally "generate" (call ``program.generate(*args, **kwargs)`` instead). Writes
torch.save of {"out": the flattened outputs, "stats": backend counters, "dynamo": Dynamo's
frame counters, "modules": whether the compile pipeline's modules were imported}."""

import sys
import time

import torch
import torch.utils._pytree as pytree


def main() -> None:
    pkg, inputs, out = sys.argv[1:4]
    # imported first, so that any compile load() ran would count here
    from fxpass.jit.backend import STATS
    from fxpass.passmanager import PassManager

    runs = []
    real_run = PassManager.run
    PassManager.run = lambda self, *a, **k: (runs.append(1), real_run(self, *a, **k))[1]
    t0 = time.perf_counter()
    from fxpass.backends.bpu import load

    program = load(pkg)
    args, kwargs = torch.load(inputs)
    with torch.no_grad():
        call = program.generate if sys.argv[4:5] == ["generate"] else program
        result = call(*args, **kwargs)
    seconds = time.perf_counter() - t0
    from torch._dynamo.utils import counters

    torch.save({
        "pass_manager_runs": len(runs),
        "out": [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)],
        "stats": dict(STATS),
        "dynamo": {k: dict(v) for k, v in counters.items() if v},
        "seconds": seconds,
    }, out)


if __name__ == "__main__":
    main()
