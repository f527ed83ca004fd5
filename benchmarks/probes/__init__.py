"""One-question probes: each answers one question once (the answer is cited where the code acts
on it); rerun one when what it measures moves. ``python -m benchmarks.probes.<name>``; results in
``benchmarks/probes/results/``."""
