"""Tools over the backend: the demo, ``explain`` (what goes where, and why), the CLI verbs for
export and generation (deploy), and the zoo of small stock models the demo and benchmarks use."""
