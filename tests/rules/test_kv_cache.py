"""kv_cache_update: the static-cache write becomes device-placeable and writes only new slots."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from fxpass import PassManager
from fxpass.rules import kv_cache_update
from fxpass.testing import T, check_rule, traced_graphs

aten = torch.ops.aten


def _step(cache, new, q, *, pos, dim, write_back):
    """One attention step over a static cache, in AOTAutograd's kept-mutation form."""
    upd = aten.index_copy.default(cache, dim, torch.tensor(pos), new)
    keys = upd.movedim(dim, -2)  # [..., S, D]
    out = torch.softmax(q @ keys.transpose(-1, -2), -1) @ keys
    if write_back:
        cache.copy_(upd)
        return out
    return out, upd


@st.composite
def _cache_cases(draw, write_back=True):
    batch = draw(st.sampled_from([1, 2]))
    heads, size, d = (
        draw(st.integers(1, 3)),
        draw(st.integers(2, 12)),
        draw(st.sampled_from([4, 8])),
    )
    n = draw(st.sampled_from([1, 1, 2, 3, size]))  # decode steps dominate; prefill too
    n = min(n, size)
    where = draw(st.sampled_from(["start", "end", "any"]))
    if where == "start":
        pos = list(range(n))
    elif where == "end":
        pos = list(range(size - n, size))
    else:
        pos = draw(st.permutations(range(size)))[:n]
    dim = draw(st.sampled_from([1, 2]))  # [B, S, H, D] or [B, H, S, D]
    dtype = draw(st.sampled_from([torch.float32, torch.float16]))
    shape = [batch, heads, d]
    shape.insert(dim, size)
    new_shape = list(shape)
    new_shape[dim] = n
    # keys.movedim(dim, -2) is [B, H, S, D] for either layout
    specs = [T(tuple(shape), dtype), T(tuple(new_shape), dtype), T((batch, heads, 1, d), dtype)]
    return specs, {"pos": pos, "dim": dim, "write_back": write_back}


def test_kv_cache_update_property():
    # positions at the start and the end of the cache, a batch of 2, decode and prefill widths:
    # outputs, the cache left behind, meta, idempotence and termination all checked
    fired = check_rule(kv_cache_update, traced_graphs(_step, _cache_cases()), max_examples=60)
    assert fired >= 30


def _graph(write_back: bool, size: int = 6):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        fakes = [torch.empty(2, 2, size, 4), torch.empty(2, 2, 1, 4), torch.empty(2, 2, 1, 4)]
        return make_fx(lambda *xs: _step(*xs, pos=[size - 1], dim=2, write_back=write_back))(*fakes)


def test_write_back_writes_only_the_new_slots_in_place():
    gm = _graph(write_back=True)
    PassManager([kv_cache_update], check=True).run(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.index_copy.default not in targets and aten.copy_.default not in targets
    assert targets.count(aten.index_copy_.default) == 1
    assert aten.where.self in targets
    cache = torch.randn(2, 2, 6, 4)
    new = torch.randn(2, 2, 1, 4)
    ptr = cache.data_ptr()
    gm(cache, new, torch.randn(2, 2, 1, 4))
    assert cache.data_ptr() == ptr
    torch.testing.assert_close(cache[:, :, 5:], new, rtol=0, atol=0)


def test_update_returned_from_an_input_is_left_alone_with_a_reason():
    gm = _graph(write_back=False)
    report = PassManager([kv_cache_update], check=True).run(gm)
    assert report.total_rewrites == 0
    (why,) = report.skip_reasons("kv_cache_update")
    assert "graph output aliasing an input" in why
