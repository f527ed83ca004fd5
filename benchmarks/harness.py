"""Shared timing and reporting helpers for the benchmarks.

Why this shape: on a 2-core machine, frequency scaling, page cache and background work drift
over seconds, so contenders measured one after another are not comparable. ``interleave``
runs every contender in the same process, one sample each per round (rotating the start
order), so drift hits all of them alike; medians with min/max and the IQR show the spread.
Sub-millisecond calls are batched (``number`` calls per sample, as ``timeit`` does) so timer
resolution and loop overhead do not dominate. Results go to JSON (the record), a markdown
table (for docs) and a PNG chart of latency ratios vs eager.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import itertools
import json
import math
import os
import platform
import signal
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class Stats:
    """Seconds per call over ``n`` samples (each the mean of ``number`` back-to-back calls)."""

    median: float
    min: float
    max: float
    q1: float
    q3: float
    n: int
    number: int

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def summarize(samples: Sequence[float], number: int = 1) -> Stats:
    """Median, min/max and quartiles of per-call times."""
    s = sorted(samples)
    if len(s) >= 2:
        q1, _, q3 = statistics.quantiles(s, n=4, method="inclusive")
    else:
        q1 = q3 = s[0]
    return Stats(statistics.median(s), s[0], s[-1], q1, q3, len(s), number)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall time of one call (e.g. a first call that includes compilation) and its result."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def interleave(
    contenders: dict[str, Callable[[], Any]],
    *,
    warmup: int = 3,
    repeats: int = 20,
    budget_s: float = 10.0,
    min_repeats: int = 3,
    min_sample_s: float = 1e-3,
    settle_s: float = 0.2,
    rewarm: int = 1,
) -> dict[str, Stats]:
    """Time every contender side by side: warm-up, then round-robin samples.

    Each contender gets ``repeats`` samples, fewer if that would exceed ``budget_s`` (but at
    least ``min_repeats``); calls faster than ``min_sample_s`` are batched into one sample.
    Before each sample the contender runs untimed: at least ``rewarm`` calls and at least
    ``settle_s`` seconds. Measured here (Qwen3 4x1024, 1 token): an onnxruntime session timed
    right after another session's run was 1.4-1.7x slower than alone, even after a 20 ms pause
    and one re-warm call (the other pool's threads still spin); after a 200 ms pause it matched
    its standalone time. Torch eager right after onnxruntime was ~1.5x slower without a re-warm
    call. The pause is spent calling the contender rather than sleeping, because under load a
    sleeping process lost its cores and the next sample paid for it.
    """
    from fxpass.backends.bpu import settle

    settle()  # steady state: every tiered host region has its prepacked session
    number: dict[str, int] = {}
    todo: dict[str, int] = {}
    for name, fn in contenders.items():
        t0 = time.perf_counter()
        for _ in range(max(1, warmup)):
            fn()
        per_call = max((time.perf_counter() - t0) / max(1, warmup), 1e-9)
        number[name] = max(1, math.ceil(min_sample_s / per_call))
        fit = int(budget_s / (per_call * number[name] + max(settle_s, per_call * rewarm)))
        todo[name] = max(min_repeats, min(repeats, fit))
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    rnd = 0
    while any(len(samples[n]) < todo[n] for n in names):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for name in order:
            if len(samples[name]) >= todo[name]:
                continue
            fn, k = contenders[name], number[name]
            t_end = time.perf_counter() + settle_s
            for i in itertools.count():  # untimed: >= ``rewarm`` calls and >= settle_s
                if i >= rewarm and time.perf_counter() >= t_end:
                    break
                fn()
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            samples[name].append((time.perf_counter() - t0) / k)
        rnd += 1
    return {name: summarize(samples[name], number[name]) for name in names}


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return sum(vals), idle


class OtherLoad:
    """Share of all CPUs used by *other* processes during a ``with`` block (Linux).

    Why: on a shared 2-core machine, one busy neighbour stalls every 2-thread kernel at its
    barrier; recording this next to each timing says which numbers to trust.
    """

    share: float | None = None

    def __enter__(self) -> OtherLoad:
        try:
            self._t0, self._i0 = _cpu_times()
        except OSError:
            self._t0 = None
        self._own0 = sum(os.times()[:2])
        return self

    def __exit__(self, *exc: object) -> None:
        if self._t0 is None:
            return
        t1, i1 = _cpu_times()
        total = max(1, t1 - self._t0)
        busy = total - (i1 - self._i0)
        own = (sum(os.times()[:2]) - self._own0) * os.sysconf("SC_CLK_TCK")
        self.share = min(1.0, max(0.0, (busy - own) / total))


def background_busy(interval_s: float = 1.0) -> float | None:
    """Fraction of all cores busy while this process sleeps, i.e. used by other work."""
    try:
        t0, i0 = _cpu_times()
        time.sleep(interval_s)
        t1, i1 = _cpu_times()
    except OSError:  # not Linux
        return None
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_for_quiet(threshold: float = 0.15, max_wait_s: float = 60.0) -> float | None:
    """Wait (up to ``max_wait_s``) until other processes use < ``threshold`` of the CPUs.

    On a 2-core machine one busy neighbour stalls every 2-thread kernel at its barrier, so
    timings taken then are mostly scheduler noise. Returns the last busy fraction measured,
    which the results record next to the numbers.
    """
    deadline = time.monotonic() + max_wait_s
    busy = background_busy()
    while busy is not None and busy >= threshold and time.monotonic() < deadline:
        busy = background_busy()
    return busy


class TimeLimit(Exception):
    """Raised inside a ``time_limit`` block that ran out of time."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Interrupt the block after ``seconds`` (SIGALRM; main thread, Unix) with ``TimeLimit``.

    Why: a super-linear peer at the next graph size can take hours; capping it keeps a run
    bounded and still records that it was capped. Pure-Python loops are interrupted promptly.
    """
    if not hasattr(signal, "setitimer"):
        yield
        return

    def _raise(signum: int, frame: Any) -> None:
        raise TimeLimit(f"over {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def environment() -> dict[str, Any]:
    """What the numbers depend on: versions, threads, cores, date."""
    import torch

    env: dict[str, Any] = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "loadavg_1_5_15min": os.getloadavg(),  # other work on the machine skews every number
    }
    for mod in ("transformers", "onnx", "onnxruntime", "onnxscript"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    return env


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON (non-JSON values via ``str``); creates the directory."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return p


def write_results(out: str | Path, stem: str, data: Any, md: str) -> None:
    """``out/stem.json`` and ``out/stem.md``, and the markdown printed: how every benchmark
    leaves its results."""
    out = Path(out)
    write_json(out / f"{stem}.json", data)
    (out / f"{stem}.md").write_text(md + "\n")
    print(md)


def publish(out: str | Path, stem: str, result: dict[str, Any],
            to_markdown: Callable[[dict[str, Any]], str]) -> None:
    """:func:`write_results` for a measured ``result``, stamped with the machine it ran on
    (:func:`environment`): how the small A/B benchmarks leave theirs."""
    write_results(out, stem, {"env": environment(), **result}, to_markdown(result))


def _cell(v: Any) -> str:
    s = "" if v is None else str(v)
    return s.replace("|", "\\|").replace("\n", " ")


def decode_ms_per_token(runners: dict[str, Callable[[int], Any]], new_tokens: Sequence[int],
                        repeats: int, budget_s: float = 30.0
                        ) -> tuple[dict[str, dict[int, float]], dict[str, float]]:
    """Each generator's decode ms/token at each N: ``(t(1 + N) - t(1)) / N`` from medians of
    round-robin samples (:func:`interleave`), so the prompt's cost cancels out; and each
    one's ms for the prompt and one token, t(1)."""
    times: dict[int, dict[str, float]] = {}
    for length in (1, *(n + 1 for n in new_tokens)):
        stats = interleave({c: (lambda f=f, length=length: f(length)) for c, f in runners.items()},
                           warmup=1, repeats=repeats, budget_s=budget_s, min_repeats=3,
                           settle_s=0.1)
        times[length] = {c: s.median for c, s in stats.items()}
    return ({c: {n: (times[n + 1][c] - times[1][c]) / n * 1e3 for n in new_tokens}
             for c in runners}, {c: times[1][c] * 1e3 for c in runners})


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A GitHub markdown table of ``rows`` (already formatted values) in ``columns`` order."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def fmt_ms(seconds: float | None) -> str:
    """Milliseconds with 3 significant figures, or an empty cell."""
    if seconds is None:
        return ""
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def ratio_chart(
    cases: Sequence[str],
    ratios: dict[str, Sequence[float | None]],
    path: str | Path,
    title: str = "latency / eager latency (lower is faster; median)",
) -> Path:
    """Grouped horizontal bars of latency ratios vs eager, one group per case, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    k = max(1, len(ratios))
    height = 0.8 / k
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(cases) * max(1, k / 2) + 1.5))
    seen: list[float] = [1.0]
    for j, (name, vals) in enumerate(ratios.items()):
        ys = [i + (j - (k - 1) / 2) * height for i in range(len(cases))]
        xs = [v if v is not None and v > 0 else math.nan for v in vals]
        # bars grow from 1.0 (eager): left is faster, right is slower
        ax.barh(ys, [x - 1.0 for x in xs], left=1.0, height=height, label=name)
        for y, x in zip(ys, xs, strict=True):
            if math.isnan(x):
                ax.text(1.0, y, f" {name} failed", va="center", fontsize=7, color="dimgray")
                continue
            left = x < 1.0
            ax.text(
                x,
                y,
                f"{x:.2f}x " if left else f" {x:.2f}x",
                va="center",
                fontsize=7,
                color="dimgray",
                ha="right" if left else "left",
            )
            seen.append(x)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    lo, hi = min(seen) / 1.8, max(seen) * 1.8
    ax.set_xlim(lo, hi)
    ticks = [t for t in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50) if lo <= t <= hi]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.minorticks_off()
    ax.set_yticks(range(len(cases)))
    ax.set_yticklabels(cases, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("latency ratio vs eager (log scale; < 1x is faster than eager)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="best")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p
