"""Calibration batches as calls: what a batch means (a dict is keyword arguments, a tuple or
list positional ones, anything else the one argument) and its shapes, for any device that
calibrates. The device's own checks and its recording live with the device."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def shape_of(x: Any) -> Any:
    """Shapes and dtypes of a nested batch (what two batches must share)."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype)
    if isinstance(x, dict):
        return {k: shape_of(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return tuple(shape_of(v) for v in x)
    return type(x).__name__


def tensors(x: Any, path: str) -> Iterable[tuple[str, torch.Tensor]]:
    """Every tensor of a nested batch, with where it sits (for error messages)."""
    if isinstance(x, torch.Tensor):
        yield path, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from tensors(v, f"{path}[{k!r}]")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from tensors(v, f"{path}[{i}]")


def call_args(batch: Any) -> tuple[tuple, dict[str, Any]]:
    """A batch as a call's (args, kwargs)."""
    if isinstance(batch, dict):
        return (), batch
    if isinstance(batch, (list, tuple)):
        return tuple(batch), {}
    return (batch,), {}


def call(model: Callable, batch: Any) -> Any:
    args, kwargs = call_args(batch)
    return model(*args, **kwargs)
