"""Regressions found by ``python -m benchmarks.fuzz`` (issue 9, "Fuzzing at scale").

Each test is the minimal form of a fuzz finding and failed before its fix. They compile with
``strict=True`` where the finding was a region that fell back to eager: a fallback is correct
but costs the offload, and strict turns it into the error the fix removes.
"""

from __future__ import annotations

import pytest
import torch

from fxpass.testing import assert_outputs_close


def _compile(fn, strict: bool = True):  # noqa: ANN001, ANN202 - test helper
    torch._dynamo.reset()
    return torch.compile(
        fn, backend="fxpass_bpu", dynamic=False,
        options={"min_compute_macs": 0, "cache": False, "strict": strict},
    )


def _offloaded() -> int:
    import fxpass

    return len(fxpass.compile_reports()[-1].regions)


@pytest.mark.parametrize(
    "reduce",
    [
        lambda y: torch.all(y, dim=-1),
        lambda y: torch.any(y > 0, 0),
        lambda y: y.mean(-1),
        lambda y: torch.softmax(y, 0),
        lambda y: torch.all(y.bool(), dim=-1, keepdim=True),
    ],
    ids=["all", "any", "mean", "softmax", "all_keepdim"],
)
def test_reduction_over_a_0dim_tensor_compiles_and_matches_eager(reduce) -> None:  # noqa: ANN001
    """OpInfo sweep: ``all``/``any``/``mean`` with a dim on a 0-dim tensor (aten allows dim 0
    or -1 there) lowered to ONNX Reduce* with axes=[-1] on a rank-0 input, which ONNX shape
    inference rejects, so the region failed to compile (eager fallback; an error under
    strict). The capability now keeps those reductions on the CPU; the matmul in front is
    still offloaded."""

    def f(x: torch.Tensor) -> torch.Tensor:
        y = (x.reshape(1, 1) @ torch.eye(1)).reshape(())
        return reduce(y)

    x = torch.tensor(0.7)
    with torch.no_grad():
        got = _compile(f)(x)
    assert_outputs_close(f(x), got)
    assert _offloaded() >= 1


def test_plan_hit_returns_real_constants_not_meta_tensors(tmp_path) -> None:  # noqa: ANN001
    """Fuzz (kit stream): a graph whose output is a folded constant (``full``) came back as a
    *meta* tensor from the second compile: the cached plan's constants were loaded with
    ``torch.load`` inside the compile, where ``torch.load`` sees the compile's fake mode
    (through the tracing context) and maps every storage to ``meta``. A wrong answer with no
    data behind it, on every warm compile."""

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((2, 2), -2.5), x @ x + torch.arange(2.0)

    x = torch.randn(2, 2)
    outs = []
    for _ in range(2):  # miss (stores the plan), then hit (loads it)
        torch._dynamo.reset()
        c = torch.compile(f, backend="fxpass_bpu",
                          options={"min_compute_macs": 0, "cache_dir": str(tmp_path)})
        with torch.no_grad():
            outs.append(c(x))
    for got in outs:
        assert all(t.device.type == "cpu" for t in got)
        assert_outputs_close(f(x), got)


@pytest.mark.parametrize(
    ("cache", "pos", "new"),
    [
        (torch.tensor(-8.5), torch.tensor([0]), torch.tensor(-1.75)),  # 0-dim cache
        (torch.randn(5), torch.tensor([3, 1]), torch.randn(2)),  # 1-D cache, two positions
        (torch.randn(5), torch.tensor([2]), torch.randn(1)),  # 1-D cache, one position
    ],
    ids=["0dim", "1d_two_positions", "1d_one_position"],
)
def test_kv_cache_rule_on_low_rank_index_copy(cache, pos, new) -> None:  # noqa: ANN001
    """OpInfo sweep (``index_copy``): the kv_cache_update rule computed ``dim % cache.dim()``
    (ZeroDivisionError on a 0-dim cache) and spread several positions with
    ``movedim(dim, -2)`` (IndexError on a 1-D cache). The RuleError failed the whole
    ``torch.compile``. The rule now leaves those shapes alone, with a reason."""

    def f(c: torch.Tensor, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c = (c.reshape(1, -1) @ torch.eye(max(c.numel(), 1))).reshape(c.shape)
        return torch.index_copy(c, 0, p, v)

    with torch.no_grad():
        got = _compile(f, strict=False)(cache, pos, new)
    assert_outputs_close(f(cache, pos, new), got)


def test_plan_hit_index_constants_have_data(tmp_path) -> None:  # noqa: ANN001
    """OpInfo sweep (``nn.functional.upsample_nearest``): the same plan-cache bug, silently:
    the folded gather indices came back as a meta tensor and ``_unsafe_index`` on the warm
    compile returned garbage (errors of 1e36, NaN) with no error at all."""
    x = torch.randn(2, 3, 4)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = (x.reshape(-1, 4) @ torch.eye(4)).reshape(x.shape)
        return torch.nn.functional.interpolate(y, size=3, mode="nearest")

    for _ in range(2):  # miss, then hit
        torch._dynamo.reset()
        c = torch.compile(f, backend="fxpass_bpu",
                          options={"min_compute_macs": 0, "cache_dir": str(tmp_path)})
        with torch.no_grad():
            assert_outputs_close(f(x), c(x))


def test_cat_skips_legacy_empty_inputs_and_stays_offloaded():
    """OpInfo ``cat``: a legacy empty 1-D tensor beside 2-D ones is skipped by torch.cat; the
    lowering passed it to ONNX Concat (ranks must match), the model was invalid, and the region
    fell back to eager."""
    w = torch.eye(3)

    def fn(x, e):
        return torch.cat([x @ w, e, x], dim=1)

    x, e = torch.randn(2, 3), torch.randn(0)
    got = _compile(fn)(x, e)
    assert_outputs_close(got, fn(x, e))
    assert _offloaded() == 1


@pytest.mark.parametrize("op", [
    lambda y: torch.transpose(y, 0, 0),
    lambda y: torch.transpose(y, 0, -1),
    lambda y: y.t(),
])
def test_transpose_of_a_0dim_tensor_is_the_identity(op):
    """OpInfo ``transpose`` sample 4 (a 0-dim tensor, dims (0, 0)) behind its matmul: the
    lowering computed ``dim % 0`` and raised ZeroDivisionError, so the region fell back."""

    def fn(x):
        return op((x.reshape(-1, 1) @ torch.eye(1)).reshape(x.shape))

    x = torch.randn(())
    got = _compile(fn)(x)
    assert_outputs_close(got, fn(x))
    assert got.shape == ()
    assert _offloaded() == 1
