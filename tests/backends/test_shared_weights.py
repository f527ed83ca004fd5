"""Host regions read the model's weights in place: no copy in the model, the cache or
onnxruntime (issue 12, "no extra copy of the weights"), where they do not prepack: a first tier,
and one row per GEMM (a decode step) with ``prepack_one_row=False``."""

from __future__ import annotations

import gc
import json

import numpy as np
import onnx
import pytest
import torch

import fxpass
from fxpass.backends.onnx.host import build as compile_mod
from fxpass.backends.onnx.host import entry as entry_mod
from fxpass.backends.onnx.host.ort import OPT_LEVEL


class _Recording(compile_mod.OrtExecutor):
    made: list[_Recording] = []

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        _Recording.made.append(self)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64, bias=False)
    ).eval()


def _compile(m, x, tmp_path, monkeypatch, one_row_in_place=True):
    """Compiled with ``prepack_one_row=False`` unless told otherwise: one-row regions then read
    their weights in place, the form these tests are about (by default they prepack too)."""
    _Recording.made = []
    monkeypatch.setattr(compile_mod, "OrtExecutor", _Recording)
    monkeypatch.setattr(entry_mod, "OrtExecutor", _Recording)
    torch._dynamo.reset()
    opts = {"min_compute_macs": 0, "cache_dir": str(tmp_path)}
    if one_row_in_place:
        opts["prepack_one_row"] = False
    c = torch.compile(m, backend="fxpass_bpu", dynamic=False, options=opts)
    with torch.no_grad():
        return c, c(x)


def _entry(tmp_path) -> tuple[onnx.ModelProto, dict, int]:
    (model,) = [p for p in tmp_path.rglob("*.host.onnx")]
    (meta,) = [p for p in tmp_path.rglob("*.host.json")]
    proto = onnx.load(str(model), load_external_data=False)
    return proto, json.loads(meta.read_bytes()), model.stat().st_size


def test_linear_weights_are_read_in_place_not_copied(tmp_path, monkeypatch):
    m, x = _model(), torch.randn(1, 64)
    _, out = _compile(m, x, tmp_path, monkeypatch)
    with torch.no_grad():
        torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)  # float32
    (ex,) = _Recording.made
    pinned = {t.data_ptr() for t in ex.shared.values()}
    assert pinned == {m[0].weight.data_ptr(), m[2].weight.data_ptr()}
    proto, meta, size = _entry(tmp_path)
    gemms = [n for n in proto.graph.node if n.op_type == "Gemm"]  # the stored (lowering's) model
    assert len(gemms) == 2 and all(
        {a.name: a.i for a in n.attribute if a.type == onnx.AttributeProto.INT}["transB"] == 1
        for n in gemms)
    assert not [n for n in proto.graph.node if n.op_type == "Transpose"]
    fed = {i.name for i in proto.graph.input if not i.name.startswith("in_")}
    assert fed == set(meta["shared"]) and len(fed) == 2  # graph inputs, fed from the tensors
    assert not fed & {i.name for i in proto.graph.initializer}
    weight_bytes = sum(p.numel() * 4 for p in m.parameters())
    assert size < weight_bytes / 50, "the cached model holds no weight data"


def test_session_sees_the_weights_memory(tmp_path, monkeypatch):
    """Proof that onnxruntime reads the tensor itself: a write through ``.data`` (which the
    weight guard cannot see, and which a copy would miss) shows up in the region's result."""
    m, x = _model(), torch.randn(1, 64)
    c, _ = _compile(m, x, tmp_path, monkeypatch)
    graphs = len(fxpass.compile_reports())
    m[2].weight.data.mul_(-3.0)
    with torch.no_grad():
        out = c(x)
        torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)
    assert len(fxpass.compile_reports()) == graphs, "no recompile: the same session read it"


@pytest.mark.parametrize(("tokens", "in_place", "prepack"),
                         [(1, True, False), (1, False, True), (16, True, True)])
def test_prepacking_only_where_asked(tokens, in_place, prepack, tmp_path, monkeypatch):
    """One row per GEMM (a decode step) prepacks by default (1.2x faster, a packed copy of the
    weights); ``prepack_one_row=False`` reads them in place. More rows always prepack."""
    m, x = _model(), torch.randn(tokens, 64)
    _, out = _compile(m, x, tmp_path, monkeypatch, one_row_in_place=in_place)
    with torch.no_grad():
        torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)
    assert _entry(tmp_path)[1]["prepack"] is prepack


def test_cached_entry_reads_the_new_process_weights(tmp_path, monkeypatch):
    """A hit binds the shared initializers to this graph's own weights (not the first
    process's: it has none), and the answer is right."""
    m, x = _model(), torch.randn(1, 64)
    _compile(m, x, tmp_path, monkeypatch)
    twin = _model()  # same values, other tensors: same key, a hit
    _, out = _compile(twin, x, tmp_path, monkeypatch)
    assert fxpass.compile_reports()[-1].regions[0].cached is True
    (ex,) = _Recording.made
    assert {t.data_ptr() for t in ex.shared.values()} == {
        twin[0].weight.data_ptr(), twin[2].weight.data_ptr()}
    with torch.no_grad():
        torch.testing.assert_close(out, twin(x), rtol=1e-5, atol=1e-5)


def _entry_files(tmp_path) -> dict[str, object]:
    return {p.name.split(".", 1)[1]: p for p in tmp_path.rglob("*.host.*")}


def test_prefill_entry_keeps_its_weights_in_a_file_beside_the_model(tmp_path, monkeypatch):
    """A region that prepacks (more than one row per GEMM) bakes its weights in. They go to
    the cache as external data (``.host.bin``, prepacked copies included), not inside the
    model's protobuf: the cold compile serializes no weight, and a new process maps the
    prepacked weights instead of repacking them. The hit must give eager's answer."""
    m, x = _model(), torch.randn(16, 64)
    _, out = _compile(m, x, tmp_path, monkeypatch)
    with torch.no_grad():
        torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)  # float32
    files = _entry_files(tmp_path)
    assert {"host.onnx", "host.bin", "host.json"} <= set(files)
    proto, meta, size = _entry(tmp_path)
    assert meta["prepack"] is True and meta["weights"] == ".host.bin"
    weight_bytes = sum(p.numel() * 4 for p in m.parameters() if p.dim() == 2)
    assert size < weight_bytes / 20, "the model holds no weight data"
    assert files["host.bin"].stat().st_size >= weight_bytes
    external = [t for t in proto.graph.initializer
                if t.data_location == onnx.TensorProto.EXTERNAL]
    locations = {e.value for t in external for e in t.external_data if e.key == "location"}
    assert locations == {files["host.bin"].name}, "named relative to the model, as cached"

    twin, y = _model(), torch.randn(16, 64)  # same values, other tensors: a hit
    c, _ = _compile(twin, y, tmp_path, monkeypatch)
    assert fxpass.compile_reports()[-1].regions[0].cached is True
    with torch.no_grad():
        torch.testing.assert_close(c(y), twin(y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fault", ["damaged", "missing"])
def test_prefill_entry_without_its_weights_file_is_rebuilt(fault, tmp_path, monkeypatch):
    """The weights file is verified like the model: a damaged one (a flipped byte) is
    reported and deleted; then, as for a missing one (evicted, or never published by a remote
    tier), the entry's models run from this graph's own weights while the weights file is
    rebuilt from them; never a wrong answer."""
    from fxpass.backends.bpu import settle
    from fxpass.jit.remote import STATS

    m, x = _model(), torch.randn(16, 64)
    _compile(m, x, tmp_path, monkeypatch)
    weights = _entry_files(tmp_path)["host.bin"]
    if fault == "missing":
        weights.unlink()
    else:
        raw = bytearray(weights.read_bytes())
        raw[-5] ^= 0xFF  # inside the last weight
        weights.write_bytes(bytes(raw))
    twin = _model()
    rebuilt = STATS["region_weights_rebuilt"]
    if fault == "damaged":
        with pytest.warns(UserWarning, match="corrupt"):
            c, out = _compile(twin, x, tmp_path, monkeypatch)
    else:
        c, out = _compile(twin, x, tmp_path, monkeypatch)
    settle()
    assert fxpass.compile_reports()[-1].regions[0].cached is True  # its models
    assert STATS["region_weights_rebuilt"] == rebuilt + 1
    with torch.no_grad():
        torch.testing.assert_close(out, twin(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c(x), twin(x), rtol=1e-5, atol=1e-5)  # prepacked again
    assert _entry_files(tmp_path)["host.bin"].stat().st_size > 0, "stored again"


def test_entry_parts_from_two_stores_are_a_miss(tmp_path, monkeypatch):
    """Two processes compiling the same key at once each store a model and a weights file. A
    hit must not pair one's model with the other's weights file: here the weights file is
    replaced through the cache itself (a valid manifest, other values at the same offsets),
    which the parts' checksums in ``.host.json`` catch; it is rebuilt, and the answer is
    eager's."""
    from fxpass.jit.cache import ArtifactCache

    m, x = _model(), torch.randn(16, 64)
    _compile(m, x, tmp_path, monkeypatch)
    weights = _entry_files(tmp_path)["host.bin"]
    key = weights.name[: -len(".host.bin")]
    other = tmp_path / "other.bin"
    raw = bytearray(weights.read_bytes())
    raw[-5] ^= 0x40  # a valid float, another value
    other.write_bytes(bytes(raw))
    assert ArtifactCache(tmp_path).put_file(key, ".host.bin", other) is not None
    twin = _model()
    c, out = _compile(twin, x, tmp_path, monkeypatch)
    assert fxpass.compile_reports()[-1].regions[0].cached is False
    with torch.no_grad():
        torch.testing.assert_close(out, twin(x), rtol=1e-5, atol=1e-5)


def _bf16_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64, bias=False)
    ).to(torch.bfloat16).eval()


def test_bf16_weights_are_cast_in_memory_not_written(tmp_path, monkeypatch):
    """A BF16 model on the host computes in float32 (no BF16 kernels in onnxruntime), so its
    weights are cast. At one row per GEMM the float32 copies are made from the weights and
    fed in place: the cache holds none of them (it used to write twice the BF16 bytes to disk
    and read them back), a new process makes them again from its own weights, and an
    in-place update of a weight is seen (the weight guard recompiles)."""
    m, x = _bf16_model(), torch.randn(1, 64, dtype=torch.bfloat16)
    _, out = _compile(m, x, tmp_path, monkeypatch)
    with torch.no_grad():  # float32 inside, BF16 at the edges: BF16 rounding of the result
        torch.testing.assert_close(out, m(x), rtol=2e-2, atol=2e-2)
    (ex,) = _Recording.made
    casts = {n: t for n, t in ex.shared.items() if t.dtype == torch.float32}
    assert len(casts) == 2
    assert sorted(t.shape for t in casts.values()) == sorted(p.shape for p in
                                                            (m[0].weight, m[2].weight))
    for t in casts.values():
        w = m[0].weight if t.shape == m[0].weight.shape else m[2].weight
        assert torch.equal(t, w.float())
    _, meta, _ = _entry(tmp_path)
    assert set(meta["casts"]) == set(casts) and not meta["shared"]
    f32_bytes = sum(p.numel() * 4 for p in m.parameters() if p.dim() == 2)
    assert _entry_files(tmp_path)["host.bin"].stat().st_size < f32_bytes / 20

    twin = _bf16_model()  # same values, other tensors: a hit that casts its own weights
    c, out = _compile(twin, x, tmp_path, monkeypatch)
    assert fxpass.compile_reports()[-1].regions[0].cached is True
    (ex,) = _Recording.made
    assert {t.shape for t in ex.shared.values()} == {twin[0].weight.shape, twin[2].weight.shape}
    with torch.no_grad():
        torch.testing.assert_close(out, twin(x), rtol=2e-2, atol=2e-2)
        twin[2].weight.mul_(-2.0)  # a tracked write: the copies are stale, the guard sees it
        with pytest.warns(UserWarning, match="changed after compile; recompiling"):
            again = c(x)
        torch.testing.assert_close(again, twin(x), rtol=2e-2, atol=2e-2)


def test_store_interleaved_with_another_process_is_never_mixed(tmp_path, monkeypatch):
    """Found in review: the parts' checksums were read back from the manifests after both
    stores, so another process storing its weights file between them got paired with this
    process's model. Here another "process" stores a weights file with one other value right
    after this one stores its own: this process must keep answering from its own weights, and
    the entry it leaves must be a miss, not a hit over the other weights file."""
    from fxpass.jit.cache import ArtifactCache

    real = ArtifactCache.put_file

    def racing(self, key, suffix, src, keep=(), checksum=None):
        out = real(self, key, suffix, src, keep, checksum)
        if suffix == ".host.bin" and out is not None:
            raw = bytearray(out.read_bytes())
            raw[-5] ^= 0x40  # a valid float, another value
            other = tmp_path / "other.bin"
            other.write_bytes(bytes(raw))
            real(self, key, suffix, other)
        return out

    monkeypatch.setattr(ArtifactCache, "put_file", racing)
    m, x = _model(), torch.randn(16, 64)
    c, out = _compile(m, x, tmp_path, monkeypatch)
    with torch.no_grad():
        torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(ArtifactCache, "put_file", real)
    twin = _model()
    _, out = _compile(twin, x, tmp_path, monkeypatch)
    assert fxpass.compile_reports()[-1].regions[0].cached is False
    with torch.no_grad():
        torch.testing.assert_close(out, twin(x), rtol=1e-5, atol=1e-5)


def test_cold_session_maps_the_stored_entry_not_a_deleted_build_file(tmp_path, monkeypatch):
    """Found in review: the compiling process's session mapped the build directory's
    weights.bin, which is deleted when the build ends, so its blocks stayed allocated on the
    cache's disk (unseen by the cache's size bound) for the model's lifetime. The session now
    runs from the stored entry, which is what it maps."""
    from pathlib import Path

    m, x = _model(), torch.randn(16, 64)
    c, out = _compile(m, x, tmp_path, monkeypatch)
    assert len(_Recording.made) == 2, "the build's session, then the stored entry's"
    _Recording.made = []  # the recording alone kept the build's session alive
    gc.collect()
    maps = "\n".join(ln for ln in Path("/proc/self/maps").read_text().splitlines()
                     if str(tmp_path) in ln)  # this test's files (earlier tests may map theirs)
    assert "weights.bin (deleted)" not in maps
    assert _entry_files(tmp_path)["host.bin"].name in maps, "mapped from the cache entry"
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)


def test_prepacked_weights_are_saved_only_for_the_tested_forms():
    """onnxruntime 1.31 segfaulted loading a saved Wav2Vec2 region (``If`` subgraphs, Convs)
    with its prepacked weights (the architecture test caught it); Gemm/MatMul models load."""
    from onnx import TensorProto, helper

    from fxpass.backends.onnx.host.prepare import saves_prepacked

    def model(*nodes):
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])
        return helper.make_model(helper.make_graph(list(nodes), "g", [x], [y]))

    branch = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "b", [],
                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])])
    gemm = helper.make_node("Gemm", ["x", "x"], ["y"], transB=1)
    assert saves_prepacked(model(gemm))
    assert saves_prepacked(model(helper.make_node("MatMul", ["x", "x"], ["y"])))
    assert not saves_prepacked(model(helper.make_node("Conv", ["x", "x"], ["y"])))
    assert not saves_prepacked(model(gemm, helper.make_node(
        "If", ["c"], ["y"], then_branch=branch, else_branch=branch)))


@pytest.mark.parametrize("rows", [1, 16])
def test_entry_without_saved_prepacked_weights_is_the_lowering_in_one_session(
    rows, tmp_path, monkeypatch
):
    """Where onnxruntime saves no prepacked weights (one row: the weights are fed in place;
    more rows with ``saves_prepacked`` false, as for a region with ``If`` subgraphs), its
    optimized model would cost the cold compile a second write of the weights and a second
    session for nothing a later process needs. The entry is the lowering's own model, the
    cold compile opens one session, which runs from the files moved into the cache, and a
    hit (a new process's twin model) runs onnxruntime's optimizer at load and gives eager's
    answer."""
    import onnxruntime as ort

    monkeypatch.setattr(compile_mod, "saves_prepacked", lambda proto: False)
    m, x = _model(), torch.randn(rows, 64)
    c, out = _compile(m, x, tmp_path, monkeypatch)
    with torch.no_grad():
        torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)  # float32
    assert len(_Recording.made) == 1, "one session, no optimized model written"
    proto, meta, _ = _entry(tmp_path)
    assert meta["optimized"] is False and meta["prepack"] is (rows > 1)
    if rows > 1:  # the baked weights: mapped from the entry, never from a deleted build file
        _Recording.made = []
        gc.collect()
        mine = [ln for ln in _maps() if str(tmp_path) in ln]
        assert mine and not [ln for ln in mine if "(deleted)" in ln]
        assert any(_entry_files(tmp_path)["host.bin"].name in ln for ln in mine)
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)

    twin, y = _model(), torch.randn(rows, 64)
    c, _ = _compile(twin, y, tmp_path, monkeypatch)
    assert fxpass.compile_reports()[-1].regions[0].cached is True
    (hit,) = _Recording.made
    level = hit.session.get_session_options().graph_optimization_level
    assert level == getattr(ort.GraphOptimizationLevel, OPT_LEVEL), "optimized at load"
    with torch.no_grad():
        torch.testing.assert_close(c(y), twin(y), rtol=1e-5, atol=1e-5)


def _maps() -> list[str]:
    from pathlib import Path

    return Path("/proc/self/maps").read_text().splitlines()


def test_small_written_weights_are_packed_large_ones_page_aligned(tmp_path):
    """Found in review: every written weight started at a 64 KiB boundary, so a decode
    entry's file (a few norm weights) was mostly zeros, hashed on every hit. Small weights
    are packed; a large one still starts on a boundary (onnxruntime maps it)."""
    from fxpass.backends.onnx.lowering.driver import (
        EXTERNAL_ALIGN,
        Weights,
        write_weights_file,
    )

    arrays = {"a": np.ones(16, np.float32), "b": np.full(3, 2.0, np.float32),
              "big": np.arange(EXTERNAL_ALIGN // 4, dtype=np.float32)}
    weights = Weights()
    for name, a in arrays.items():
        weights[name] = (onnx.TensorProto.FLOAT, list(a.shape), lambda a=a: a)
    seen = bytearray()
    layout = write_weights_file(weights, str(tmp_path / "w.bin"), seen.extend)
    assert layout["a"] == (0, 64) and layout["b"] == (64, 12)
    assert layout["big"] == (EXTERNAL_ALIGN, EXTERNAL_ALIGN)
    raw = (tmp_path / "w.bin").read_bytes()
    assert raw == bytes(seen) and len(raw) == 2 * EXTERNAL_ALIGN
    for name, (offset, length) in layout.items():
        assert np.frombuffer(raw[offset:offset + length], np.float32).tolist() == \
            arrays[name].tolist()


def test_prepacked_session_takes_its_weights_from_the_parameters(tmp_path, monkeypatch):
    """A region that prepacks hands onnxruntime the parameters' memory (``add_initializer``)
    instead of its weights file, cold and on a hit: onnxruntime packs from them and holds the
    packed copy only. Read from the file, each weight's pages sat beside its packed copy while
    it was packed (Qwen3 4 x 1024 at 128 tokens: compile peak 1.32x -> 1.13x the weights,
    ``benchmarks.probes.compile_memory``)."""
    monkeypatch.setattr(compile_mod, "saves_prepacked", lambda proto: False)
    m, x = _model(), torch.randn(16, 64)
    c, out = _compile(m, x, tmp_path, monkeypatch)
    with torch.no_grad():
        torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)  # float32
    (ex,) = _Recording.made
    weights = {m[0].weight.data_ptr(), m[2].weight.data_ptr()}
    assert {t.data_ptr() for t, _ in ex._initializers} == weights
    _, meta, _ = _entry(tmp_path)
    assert meta["prepack"] is True and len(meta["inits"]) == 2

    twin, y = _model(), torch.randn(16, 64)
    c, _ = _compile(twin, y, tmp_path, monkeypatch)
    assert fxpass.compile_reports()[-1].regions[0].cached is True
    (hit,) = _Recording.made
    assert {t.data_ptr() for t, _ in hit._initializers} == {
        twin[0].weight.data_ptr(), twin[2].weight.data_ptr()}
    with torch.no_grad():
        torch.testing.assert_close(c(y), twin(y), rtol=1e-5, atol=1e-5)


def test_executor_initializers_replace_the_files_data(tmp_path):
    """What ``OrtExecutor(initializers=...)`` relies on: onnxruntime takes an initializer given
    with ``add_initializer`` instead of the external data the model names (here a file holding
    other values), and prepacks it (the run is a Gemm over the given weight)."""
    from onnx import TensorProto, helper

    from fxpass.backends.onnx.host.ort import OrtExecutor

    w = torch.randn(32, 16)
    (tmp_path / "w.bin").write_bytes((w * -7).numpy().tobytes())  # not the weight
    init = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[32, 16])
    init.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "w.bin"), ("offset", "0"), ("length", str(w.numel() * 4))):
        init.external_data.add(key=k, value=v)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 32])], [init])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                ir_version=9), str(path))
    x = torch.randn(8, 16)
    from_file = OrtExecutor(str(path), ["x"])
    torch.testing.assert_close(from_file(x)[0], x @ (w * -7).t(), rtol=1e-5, atol=1e-4)
    given = OrtExecutor(str(path), ["x"], initializers={"w": w})
    torch.testing.assert_close(given(x)[0], x @ w.t(), rtol=1e-5, atol=1e-5)


class _Twin(torch.nn.Module):
    """Two weights read in an order set at construction: twins with equal weights give the
    same region (and region key) with their graph placeholders in swapped order."""

    def __init__(self, b_first: bool):
        super().__init__()
        self.b_first = b_first
        self.a = torch.nn.Parameter(torch.randn(256, 64))
        self.b = torch.nn.Parameter(torch.randn(256, 64))
        self.conv = torch.nn.Conv1d(4, 4, 3, padding=1)  # not saves_prepacked: inits on a hit

    def forward(self, x):
        if self.b_first:
            b = self.b
            b.sum()
            a = self.a
        else:
            a, b = self.a, self.b
        y = x @ a.t() + torch.relu(x @ b.t()) * 2
        return self.conv(y.view(4, 4, -1) if x.shape[0] == 16 else y.view(1, 4, -1))


@pytest.mark.parametrize("rows", [1, 16], ids=["in-place-inputs", "prepacked-inits"])
def test_a_hit_binds_weights_by_region_attribute_not_placeholder(rows, tmp_path, monkeypatch):
    """Found in review: an entry named the graph placeholder each in-place weight came from,
    which the region key does not cover. A twin whose placeholders come in another order got
    the same key and the other weight: error 14.9 (one row, weights fed as inputs, since
    2026-12-01) and 18.2 (prepacked initializers). Entries now name region attributes."""
    torch.manual_seed(0)
    m1 = _Twin(False).eval()
    m2 = _Twin(True).eval()
    m2.load_state_dict(m1.state_dict())
    x = torch.randn(rows, 64)
    for m in (m1, m2):
        c, out = _compile(m, x, tmp_path, monkeypatch)
        with torch.no_grad():
            torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)
    assert fxpass.compile_reports()[-1].regions[0].cached is True


def test_bf16_one_row_reads_a_float32_cast_made_once_by_default(tmp_path, monkeypatch):
    """BF16 weights at one row are not tiered even though one-row regions prepack by default:
    a first tier would cast every weight on every call (10x slower). The executor casts them
    once and reads the copies in place; the answer is eager's."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 256)).eval().to(torch.bfloat16)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    _, out = _compile(m, x, tmp_path, monkeypatch, one_row_in_place=False)
    with torch.no_grad():  # bf16 computed in float32 on the host: bf16 tolerance
        torch.testing.assert_close(out.float(), m(x).float(), rtol=1.6e-2, atol=1e-2)
    (ex,) = _Recording.made  # one session: no first tier
    assert ex.shared and _entry(tmp_path)[1]["prepack"] is False

