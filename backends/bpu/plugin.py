"""The BPU target, registered through the ``fxpass`` entry point group."""

from __future__ import annotations

from fxpass.plugins import Target


def fxpass_targets() -> list[Target]:
    return [
        Target(
            name="bpu",
            description="Horizon/D-Robotics BPU (hbdk4); no BF16, static shapes only",
            enable=("bf16_promotion", "bf16_cast_cancel"),
        )
    ]
