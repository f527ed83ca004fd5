"""What an export tells its user as it goes: each stage as it starts, and a program that got
no region.

Why a module of its own: ``export``, ``export_for_generate`` and the encoder buckets
(``fxpass.hf.encoders``) report the same way, so a CLI, a UI or a log sees every export alike.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

from fxpass.jit.options import Options

#: every export stage, as it starts, at INFO (``fxpass.aot.export``'s module doc)
log = logging.getLogger("fxpass.export")

Progress = Callable[[str], None]


class NoRegionWarning(UserWarning):
    """An exported program got no region: every candidate is below ``min_compute_macs``, so
    the whole program runs in torch on the CPU (filter it with ``warnings`` if intended)."""


def reporter(progress: Progress | None) -> Progress:
    """One stage message to the ``fxpass.export`` logger and to ``progress`` (if given): the
    logger for applications that configure logging, the callback for a UI of their own."""

    def say(msg: str) -> None:
        log.info("%s", msg)
        if progress is not None:
            progress(msg)

    return say


def warn_if_no_region(what: str, report: Any, opts: Options) -> None:
    """Warn (naming the option and its value) when ``report``'s graph got no region only
    because its candidates fell below ``min_compute_macs``; a graph with nothing the BPU
    can run (no candidate at all) is no mistake of the threshold and is not warned about."""
    small = [d for d in report.dropped if "min_compute_macs" in d]
    if report.regions or not small:
        return
    from fxpass.jit.backend import min_region_macs

    threshold = (f"min_compute_macs={min_region_macs(opts):,} (the default for the "
                 f"{report.executor} executor)" if opts.min_compute_macs is None
                 else f"min_compute_macs={opts.min_compute_macs:,}")
    shown = "; ".join(small[:3]) + ("; ..." if len(small) > 3 else "")
    msg = (f"export: the {what} has no region: its {len(small)} candidate(s) are below "
           f"{threshold} ({shown}), so it runs entirely on the CPU in torch. To offload it "
           "anyway, export with options={'min_compute_macs': 0} (fxpass export "
           "--min-compute-macs 0)")
    warnings.warn(msg, NoRegionWarning, stacklevel=3)
