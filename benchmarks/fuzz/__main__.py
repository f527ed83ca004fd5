"""``python -m benchmarks.fuzz``."""

from benchmarks.fuzz import main

main()
