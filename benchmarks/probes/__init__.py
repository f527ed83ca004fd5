"""One-question probes: each answers one question once (the answer is cited where the code acts
on it); rerun one when what it measures moves. ``python -m benchmarks.probes.<name>``; results in
``benchmarks/probes/results/``."""

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def paired_md(r: dict, columns: list[tuple[str, str, str]]) -> str:
    """A one-row markdown table of an A/B probe's result ``r``: ``(header, key, format)``; a
    format ending in ``x`` is a ratio (``".2fx"``: 0.95x)."""
    def cell(v: object, f: str) -> str:
        return format(v, f[:-1]) + "x" if f.endswith("x") else format(v, f)

    head = "| " + " | ".join(h for h, _, _ in columns) + " |\n"
    rule = "|" + "---|" * len(columns) + "\n"
    return head + rule + "| " + " | ".join(cell(r[k], f) for _, k, f in columns) + " |\n"


def save(name: str, r: dict, md: str) -> None:
    """Write ``results/<name>.json`` and ``results/<name>.md`` and print the table."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(r, indent=1) + "\n")
    (RESULTS / f"{name}.md").write_text(md)
    print(md)


def paired_cli(doc: str, run: Callable[[int, int], dict], name: str,
               columns: list[tuple[str, str, str]], rounds: int, tokens: int,
               argv: list[str] | None = None) -> None:
    """The command line of a paired A/B probe: ``--rounds`` and ``--tokens``, then
    ``run(rounds, tokens)`` saved as ``name`` with ``columns`` (:func:`paired_md`)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--tokens", type=int, default=tokens)
    args = ap.parse_args(argv)
    r = run(args.rounds, args.tokens)
    save(name, r, paired_md(r, columns))


def paired_decode(gen: Callable[[int], Any], switch: Callable[[bool], None], rounds: int,
                  tokens: int) -> tuple[dict[bool, list[float]], dict[bool, Any]]:
    """Decode ms/token of A (``switch(True)``) and B (``switch(False)``), alternating which
    goes first each round: (t(1 + N) - t(1)) / N, each after a warm-up ``gen(2)``. Returns the
    per-round figures and each side's last output (``gen(n)``: generate n new tokens)."""
    per: dict[bool, list[float]] = {True: [], False: []}
    out: dict[bool, Any] = {}
    for r in range(rounds):
        for side in ((True, False) if r % 2 else (False, True)):
            switch(side)
            gen(2)
            t = time.perf_counter()
            gen(1)
            one = time.perf_counter() - t
            t = time.perf_counter()
            out[side] = gen(tokens + 1)
            per[side].append((time.perf_counter() - t - one) / tokens * 1e3)
    return per, out


def paired_ratio(per: dict[bool, list[float]]) -> float:
    """The median of the rounds' A/B ratios."""
    return statistics.median(a / b for a, b in zip(per[True], per[False], strict=True))
