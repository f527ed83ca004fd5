"""A loaded program's per-call fast path: position-only ops memoized (``aot.memo``), cache
writes fused and unread state left unwritten (``aot.writes``). Each must give the values the
plain graph gives, on real traced graphs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxpass.aot import memo as M
from fxpass.aot import writes as W

aten = torch.ops.aten


def _rotary_step(inv_freq, pos, x, cache):
    """A decode step's shape: rotary tables and a mask from the position alone, the input
    mixed in, a write into the cache at the position."""
    t = pos.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = t.cos(), t.sin()
    mask = torch.arange(cache.shape[1]) <= pos[:, None]
    y = x * cos + x.flip(-1) * sin
    cache.index_copy_(1, pos, y[:, None, :].expand(cache.shape[0], 1, -1).contiguous())
    return (y.sum(-1, keepdim=True) + mask.to(y.dtype).sum()), t


def _graph():
    inv = torch.rand(8)
    cache = torch.zeros(2, 16, 8)
    gm = make_fx(_rotary_step)(inv, torch.tensor([3]), torch.rand(1, 8), cache)
    return gm, inv


def test_memo_gives_the_plain_graph_values_and_looks_up_repeats():
    gm, inv = _graph()
    ref = copy.deepcopy(gm)
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    memos = M.memoize(gm, [names[1]], {names[0]})
    assert len(memos) == 1
    assert any(n.target is memos[0] for n in gm.graph.nodes)
    for p in [3, 7, 3, 0, 7]:
        x = torch.rand(1, 8)
        c1, c2 = torch.zeros(2, 16, 8), torch.zeros(2, 16, 8)
        got = gm(inv, torch.tensor([p]), x, c1)
        want = ref(inv, torch.tensor([p]), x, c2)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)  # fp32: the same ops, exact
        assert torch.equal(c1, c2)
    assert len(memos[0].table) == 3  # positions 3, 7, 0


def test_memo_never_shares_what_the_caller_gets_or_the_key_it_was_given():
    gm, inv = _graph()
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    M.memoize(gm, [names[1]], {names[0]})
    pos = torch.tensor([5])
    x = torch.rand(1, 8)
    _, t1 = gm(inv, pos, x, torch.zeros(2, 16, 8))
    t1.add_(100.0)  # the caller writes into an output: a later call must not see it
    pos.fill_(6)  # and into the key tensor it passed: the stored entry is a copy
    _, t2 = gm(inv, torch.tensor([5]), x, torch.zeros(2, 16, 8))
    torch.testing.assert_close(t2, torch.tensor([5.0])[:, None] * inv[None, :])


def test_memo_skips_a_key_mixed_with_other_inputs_and_respects_its_budget():
    def f(pos, x):
        return (pos.float() * x).cos().sin().exp()

    gm = make_fx(f)(torch.tensor([1]), torch.rand(3))
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    assert M.memoize(gm, [names[0]], set()) == []  # only the cast depends on pos alone

    def g(pos):
        return pos.float().cos().sin().exp() * torch.ones(4)

    gm = make_fx(g)(torch.tensor([1]))
    (memo,) = M.memoize(gm, [next(iter(gm.graph.find_nodes(op="placeholder"))).name], set(),
                        budget=8)  # two entries of 4 bytes
    for p in range(5):
        torch.testing.assert_close(gm(torch.tensor([p])), g(torch.tensor([p])))
    assert memo.stored == 8 and len(memo.table) == 2


@pytest.mark.parametrize("index", [[4], [0], [15], [2, 3, 4], [7, 1]])
def test_state_writes_equal_the_ops(index):
    idx = torch.tensor(index)
    dsts = [torch.rand(2, 16, 4) for _ in range(3)]
    counter, new_count = torch.zeros(1, dtype=torch.int64), torch.tensor([len(index)])
    want = [d.clone() for d in dsts]
    srcs = [torch.rand(2, len(index), 4) for _ in range(3)]
    w = W.StateWrites((1, None, 1, 1))
    args = [idx, dsts[0], srcs[0], counter, new_count,
            *[x for d, s in zip(dsts[1:], srcs[1:], strict=True) for x in (idx, d, s)]]
    w(*args)
    w(*args)  # the second time from the kept views
    for d, s, ref in zip(dsts, srcs, want, strict=True):
        torch.testing.assert_close(d, ref.index_copy_(1, idx, s), rtol=0, atol=0)
    assert torch.equal(counter, new_count)


@pytest.mark.parametrize("index", [torch.tensor([4]), torch.tensor([-1]),
                                   torch.tensor([1], dtype=torch.int32)],
                         ids=["past-the-end", "negative", "int32"])
def test_state_writes_raise_as_index_copy_does(index):
    d, s = torch.zeros(1, 4, 2), torch.ones(1, 1, 2)
    with pytest.raises((IndexError, RuntimeError)):
        d.clone().index_copy_(1, index, s)  # eager refuses it...
    with pytest.raises((IndexError, RuntimeError)):  # ...and so does the fused call
        W.StateWrites((1, 1))(index, d, s, index, d.clone(), s)
    assert torch.equal(d, torch.zeros(1, 4, 2))


def test_writes_at_different_positions_and_counters_fuse_into_one_call():
    def step(k0, k1, c0, c1, p0, p1, a, b):  # two layers, each its own position and counter
        out = k0.sum() + k1.sum() + c0.sum()
        k0.index_copy_(1, p0, a)
        c0.copy_(p0 + 1)
        k1.index_copy_(1, p1, b)
        c1.copy_(p1 + 1)
        return (out,)

    def late_read(k0, c0, p0, a):  # the counter is read after its write: it stays put
        k0.index_copy_(1, p0, a)
        c0.copy_(p0 + 1)
        return (c0 * 2,)

    ex = [torch.zeros(2, 8, 3), torch.zeros(2, 8, 3), torch.zeros(1, dtype=torch.int64),
          torch.zeros(1, dtype=torch.int64), torch.tensor([2]), torch.tensor([5]),
          torch.rand(2, 1, 3), torch.rand(2, 1, 3)]
    gm = make_fx(step)(*ex)
    ref = copy.deepcopy(gm)
    assert W.fuse_index_writes(gm) == 4
    calls = [n for n in gm.graph.nodes if n.op == "call_function"
             and isinstance(n.target, W.StateWrites)]
    assert len(calls) == 1 and not gm.graph.find_nodes(
        op="call_function", target=aten.copy_.default)
    for p0, p1 in ((0, 7), (3, 3), (0, 7)):
        a = [torch.rand(2, 8, 3), torch.rand(2, 8, 3), torch.zeros(1, dtype=torch.int64),
             torch.zeros(1, dtype=torch.int64)]
        b = [t.clone() for t in a]
        rest = [torch.tensor([p0]), torch.tensor([p1]), torch.rand(2, 1, 3), torch.rand(2, 1, 3)]
        torch.testing.assert_close(gm(*a, *rest)[0], ref(*b, *rest)[0], rtol=0, atol=0)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    lr = make_fx(late_read)(ex[0], ex[2], ex[4], ex[6])
    assert W.fuse_index_writes(lr) == 0  # one write left to fuse: the graph is unchanged


def test_fuse_and_drop_on_a_traced_step():
    def step(k_cache, v_cache, counter, pos, k, v):  # reads, then writes: a runtime graph's order
        out = k_cache.sum(2) + v_cache.sum(2)
        k_cache.index_copy_(2, pos, k)
        v_cache.index_copy_(2, pos, v)
        counter.copy_(pos + 1)
        return (out,)

    shapes = [(1, 2, 8, 4), (1, 2, 8, 4), (1,)]
    gm = make_fx(step)(*[torch.zeros(s) for s in shapes], torch.tensor([2]),
                       torch.rand(1, 2, 1, 4), torch.rand(1, 2, 1, 4))
    ref = copy.deepcopy(gm)
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    assert W.state_reads(gm, names[:3]) == {names[0], names[1]}
    assert W.drop_writes(gm, {names[2]}) == 1
    read_after = make_fx(lambda c, x: (c.copy_(x), c.sum())[1])(torch.zeros(2), torch.ones(2))
    ph = next(iter(read_after.graph.find_nodes(op="placeholder"))).name
    assert W.state_reads(read_after, [ph]) == {ph}  # read through the write's result
    assert W.fuse_index_writes(gm) == 2
    assert not gm.graph.find_nodes(op="call_function", target=aten.index_copy_.default)
    for p in (0, 5, 7):
        k, v = torch.rand(1, 2, 1, 4), torch.rand(1, 2, 1, 4)
        a = [torch.rand(s) for s in shapes]
        b = [t.clone() for t in a]
        out_a = gm(*a, torch.tensor([p]), k, v)
        out_b = ref(*b, torch.tensor([p]), k, v)
        torch.testing.assert_close(out_a[0], out_b[0], rtol=0, atol=0)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert float(b[2]) == p + 1 and float(a[2]) < 1  # the dropped counter is unwritten
