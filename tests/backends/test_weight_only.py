"""Weight-only int8 / int4 regions on the ``ort`` device (``quantize="w8"`` / ``"w4"``):
onnxruntime's MatMulNBits over block-quantized weights, in the JIT path and in packages.

Tolerances (logit cosine against the float32 model, random weights): w8 >= 0.999 (8-bit
blocks of 32 and int8 activations: ~0.4% relative error per product); w4 >= 0.97 (4-bit blocks:
~7% per weight, averaging out over a 128-wide dot product; 0.984 seen here, 0.97 leaves
room for other CPUs' int8 kernels)."""

from __future__ import annotations

import logging
from pathlib import Path

import onnx
import pytest
import torch

import fxpass
from fxpass.aot.export import export_for_generate
from fxpass.backends.bpu import load
from fxpass.backends.onnx import tied_tables, weight_only
from fxpass.tools import zoo
from tests.backends.test_export import _fresh_process

FLOORS = {"w8": 0.999, "w4": 0.97}


def _model(dtype=torch.float32):
    return zoo.get("qwen3", hidden=128, dtype=dtype)  # every projection >= MIN_ELEMENTS


def _large_linears(model) -> int:
    """What the quantizer must take, counted from the model itself (the LM head included)."""
    return sum(isinstance(m, torch.nn.Linear) and m.weight.numel() >= weight_only.MIN_ELEMENTS
               for m in model.modules())


def _attr(node, name):
    return next(a.i for a in node.attribute if a.name == name)


def _cosine(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(),
                                                       b.flatten().double(), dim=0))


@pytest.mark.parametrize("q", ["w8", "w4"])
def test_weight_only_logits_and_report(opts, q):
    model, kw = _model()
    with torch.no_grad():
        want = model(**kw).logits
        got = torch.compile(model, backend="fxpass_ort",
                            options={**opts, "quantize": q})(**kw).logits
    assert _cosine(got, want) >= FLOORS[q]
    assert not torch.equal(got, want)  # it did quantize
    rep = fxpass.compile_reports()[-1]
    assert len(rep.regions) == 1
    fusions = rep.regions[0].fusions
    assert fusions.get(f"matmul_nbits_{q}") == _large_linears(model), fusions
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean()
    assert top1 >= (0.9 if q == "w8" else 0.6), top1


def test_hqq_quantizes_and_says_it_is_slow_here(opts):
    """algorithm='hqq' runs (onnxruntime's half-quadratic quantizer: float zero points) and
    gives the float model's logits within int4's floor, with a warning that this
    onnxruntime has no fast CPU kernel for it (``benchmarks.probes.w4_quality``)."""
    model, kw = _model()
    with torch.no_grad(), pytest.warns(UserWarning, match="no fast kernel for HQQ"):
        want = model(**kw).logits
        got = torch.compile(model, backend="fxpass_ort",
                            options={**opts, "quantize": "w4", "algorithm": "hqq"})(**kw).logits
    assert _cosine(got, want) >= FLOORS["w4"]
    assert not torch.equal(got, want)
    fusions = fxpass.compile_reports()[-1].regions[0].fusions
    assert fusions.get("matmul_nbits_w4") == _large_linears(model), fusions


def test_small_weights_stay_float_with_a_note(opts):
    model, kw = zoo.get("qwen3", hidden=64)  # k/v projections: 64 x 32 < MIN_ELEMENTS
    with torch.no_grad():
        torch.compile(model, backend="fxpass_ort", options={**opts, "quantize": "w8"})(**kw)
    fusions = fxpass.compile_reports()[-1].regions[0].fusions
    small = sum(isinstance(m, torch.nn.Linear) and m.weight.numel() < weight_only.MIN_ELEMENTS
                for m in model.modules())
    assert small and fusions.get(f"kept_float (fewer than {weight_only.MIN_ELEMENTS} weights)") \
        == small, fusions
    assert fusions["matmul_nbits_w8"] == _large_linears(model)


@pytest.mark.parametrize("options, match", [
    ({"quantize": "w3"}, r"unknown quantize config 'w3'.*or weight-only \['w4', 'w8'\]"),
    ({"quantize": "w4", "block_size": 24}, "power of two of at least 16"),
    ({"quantize": "w4", "block_size": 8}, "power of two of at least 16"),
    ({"block_size": 64}, "only apply to weight-only.*quantize='w4'"),
    ({"quantize": "w8", "algorithm": "hqq"}, "4 bits only"),
    ({"quantize": "w4", "algorithm": "gptq"}, "algorithm must be one of"),
    ({"quantize": "w4", "accuracy_level": 5}, "accuracy_level must be one of"),
])
def test_option_errors_name_the_fix(options, match):
    m = torch.nn.Linear(128, 128)
    with pytest.raises(Exception, match=match):
        torch.compile(m, backend="fxpass_ort", options=options)(torch.randn(2, 128))


def test_the_board_refuses_the_host_format():
    m = torch.nn.Linear(128, 128)
    with pytest.raises(Exception, match="weight-only format, which the board does not run"):
        torch.compile(m, backend="fxpass_bpu", options={"quantize": "w4"})(torch.randn(2, 128))
    with pytest.raises(Exception, match="option .block_size. belongs to weight-only"):
        torch.compile(m, backend="fxpass_bpu", options={"block_size": 32})(torch.randn(2, 128))


def test_bf16_model_quantizes_from_its_bf16_weights(opts):
    """The region computes in float32 from the bf16 weights' exact values; w8 of those is
    as close to the bf16 model as w8 of a float32 model is to it (bf16 tolerances)."""
    model, kw = _model(torch.bfloat16)
    with torch.no_grad():
        want = model.float()(**kw).logits  # the bf16 weights, exactly, computed in float32
        model.to(torch.bfloat16)
        got = torch.compile(model, backend="fxpass_ort",
                            options={**opts, "quantize": "w8"})(**kw).logits
    assert got.dtype == torch.bfloat16
    assert _cosine(got.float(), want) >= 0.995  # w8 plus bf16 rounding of the logits
    fusions = fxpass.compile_reports()[-1].regions[0].fusions
    assert fusions.get("matmul_nbits_w8") == _large_linears(model), fusions


@pytest.mark.slow
def test_w4_package_round_trip_in_a_fresh_process(tmp_path):
    model, _ = _model()
    program = export_for_generate(model, max_cache_len=40, prefill_length=8, device="ort",
                                  options={"min_compute_macs": 0, "quantize": "w4"})
    path = Path(program.save(tmp_path / "w4"))
    ids = torch.randint(3, 500, (1, 11), generator=torch.Generator().manual_seed(1))
    runner = load(path)
    here = runner.generate(ids, max_new_tokens=8)
    fresh = _fresh_process(path, (ids,), {"max_new_tokens": 8}, tmp_path, generate=True)
    assert torch.equal(fresh["out"][0], here)  # the same int4 kernels, loaded afresh
    with torch.no_grad():  # the package's logits near the float model's (greedy tokens on
        got = runner.prefill(ids)[0, -1]  # random weights part at the first near tie)
        want = model(ids).logits[0, -1]
    assert _cosine(got, want) >= FLOORS["w4"]
    # the package holds the int4 blocks, not a float copy: no float MatMul over a large weight
    models = [onnx.load(str(p), load_external_data=False) for p in path.glob("region_*.onnx")]
    large = sum(m.weight.numel() for m in model.modules()
                if isinstance(m, torch.nn.Linear) and m.weight.numel() >= weight_only.MIN_ELEMENTS)

    def quantized(m: onnx.ModelProto) -> int:  # weights behind its MatMulNBits (K x N each)
        return sum(_attr(n, "K") * _attr(n, "N") for n in m.graph.node
                   if n.op_type == "MatMulNBits")

    assert models and all(quantized(m) == large for m in models)
    linear = sum(m.weight.numel() * 4 for m in model.modules()
                 if isinstance(m, torch.nn.Linear))
    embedding = model.get_input_embeddings().weight.numel() * 4
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    # 4 bits + an fp32 scale per 32 = 0.156 of fp32; the embedding stays float (tied to the
    # head here: its float copy is the Gather's); 1 MiB for the graphs, norms and alignment
    assert size <= embedding + 0.2 * linear + 2**20, (size, embedding, linear)


@pytest.mark.slow
def test_quantizing_leaves_the_root_logger_alone():
    """onnxruntime's weight-only quantizer calls logging.basicConfig(level=INFO) when it is
    imported: in a fresh process (pytest's own handlers would hide it), quantizing a model
    must leave the root logger without handlers and at its level."""
    import subprocess
    import sys

    code = (
        "import logging, numpy as np, onnx\n"
        "from onnx import helper, numpy_helper\n"
        "from fxpass.backends.onnx import weight_only as W\n"
        "w = numpy_helper.from_array(np.random.rand(128, 128).astype(np.float32), 'w')\n"
        "g = helper.make_graph([helper.make_node('MatMul', ['x', 'w'], ['y'], name='mm')], 'g',"
        " [helper.make_tensor_value_info('x', 1, [1, 128])],"
        " [helper.make_tensor_value_info('y', 1, [1, 128])], [w])\n"
        "m = helper.make_model(g, opset_imports=[helper.make_opsetid('', 18)])\n"
        "q, s = W.quantize_model(m, W.resolve('w4'))\n"
        "assert s['matmul_nbits'] == 1, s\n"
        "root = logging.getLogger()\n"
        "print(len(root.handlers), root.level)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["0", str(logging.WARNING)], r.stdout


@pytest.mark.slow  # the fast tier's 4-minute budget
def test_each_weight_only_option_has_its_own_cache_entry(opts):
    """The artifact key covers the quantization fields: a second compile with another block
    size in the same cache is a miss (a hit would run the first block size's weights), and
    the same options again are a hit."""
    model, kw = _model()

    def compile_(**extra):
        torch._dynamo.reset()
        with torch.no_grad():
            out = torch.compile(model, backend="fxpass_ort",
                                options={**opts, "quantize": "w4", **extra})(**kw).logits
        return out, fxpass.compile_reports()[-1].regions[0].cached

    first, hit = compile_()
    assert not hit
    other, hit = compile_(block_size=128)
    assert not hit and not torch.equal(first, other)
    again, hit = compile_()
    assert hit and torch.equal(again, first)


def _tied():
    model, kw = _model()
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2's are
    return model, kw


@pytest.mark.parametrize(("q", "tied", "tables"), [
    ("w4", True, 1),  # GenAI's int4 builds store a tied table in int4 blocks too
    # untied: the lookup reads one float row per token (slow tier: the fast tier's budget)
    pytest.param("w4", False, 0, marks=pytest.mark.slow),
    # onnxruntime's quantizer writes GatherBlockQuantized in int4 only
    pytest.param("w8", True, 0, marks=pytest.mark.slow),
])
def test_a_tied_embedding_is_stored_in_int4_blocks(opts, q, tied, tables):
    import logging

    model, kw = _tied() if tied else _model()
    seen = logging.Handler(logging.WARNING)
    seen.records = []
    seen.emit = seen.records.append
    logging.getLogger().addHandler(seen)
    try:
        with torch.no_grad():
            want = model(**kw).logits
            c = torch.compile(model, backend="fxpass_ort", options={**opts, "quantize": q})
            got = c(**kw).logits
    finally:
        logging.getLogger().removeHandler(seen)
    assert _cosine(got, want) >= FLOORS[q]
    # onnxruntime's note that it raises the IR version for int4 tables is not the user's
    assert not [r for r in seen.records if "version of the input model" in r.getMessage()]
    fusions = fxpass.compile_reports()[-1].regions[0].fusions
    assert fusions.get("gather_block_quantized") == tables, fusions
    assert fusions.get("shared_tables") == tables, fusions  # one copy of the blocks
    kept = {k: v for k, v in fusions.items() if "tied embedding" in k}
    assert sum(kept.values()) == (1 if tied and not tables else 0), fusions
    if tables:  # a bad id still raises eager's error through the quantized lookup
        bad = dict(kw, input_ids=kw["input_ids"].clone())
        bad["input_ids"][0, 0] = -1
        with pytest.raises(IndexError), torch.no_grad():
            c(**bad)



def _tied_onnx(rows: int, cols: int, head=None):
    """A region's tied lookup and LM head as ONNX: Gather(table) and MatMul(., table.T)
    (``head``: another matrix for the MatMul, an untied model)."""
    import numpy as np
    from onnx import helper as h

    table = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    head = table if head is None else head
    graph = h.make_graph(
        [h.make_node("Gather", ["table", "ids"], ["e"], name="lookup"),
         h.make_node("MatMul", ["e", "head"], ["y"], name="lm_head")], "tied",
        [h.make_tensor_value_info("ids", onnx.TensorProto.INT64, [rows])],
        [h.make_tensor_value_info("e", onnx.TensorProto.FLOAT, None),
         h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(table, "table"),
         onnx.numpy_helper.from_array(np.ascontiguousarray(head.T), "head")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 10
    return model, table


def _run_onnx(model, rows):
    import numpy as np
    import onnxruntime as ort

    ids = np.arange(rows, dtype=np.int64)[::-1].copy()  # every row
    return ort.InferenceSession(model.SerializeToString()).run(["e", "y"], {"ids": ids})


INT4 = (onnx.TensorProto.INT4, onnx.TensorProto.UINT4)


@pytest.mark.parametrize(("cols", "block", "symmetric"), [
    (576, 32, True), (576, 128, True),  # 576 = 4.5 blocks of 128: rows padded, sliced back
    (512, 128, False), (576, 32, False),  # asymmetric: zero points shared too
    (576, 128, False)])  # ... with an odd number of blocks per row (zero points padded)
def test_a_tied_table_shares_the_lm_heads_blocks(monkeypatch, cols, block, symmetric):
    """The lookup reads the LM head's int4 blocks (one copy, as GenAI's builder stores them).
    A symmetric table looks up what its own copy gave, bit for bit, on every row; an
    asymmetric one too, but for the quantizer's rounding ties (a code one step off)."""
    import numpy as np

    rows = 300
    model, table = _tied_onnx(rows, cols)
    cfg = weight_only.resolve("w4", block_size=block, symmetric=symmetric)
    shared, summary = weight_only.quantize_model(onnx.ModelProto.FromString(
        model.SerializeToString()), cfg)
    monkeypatch.setattr(tied_tables, "share_tied_tables", lambda m: 0)
    apart, _ = weight_only.quantize_model(model, cfg)
    assert summary["shared_tables"] == 1 and summary["gather_block_quantized"] == 1
    assert not [t.name for t in shared.graph.initializer if t.data_type in INT4]
    assert [t.name for t in apart.graph.initializer if t.data_type in INT4]  # the copy
    assert shared.ByteSize() < 0.6 * apart.ByteSize()
    (e, y), (e0, y0) = _run_onnx(shared, rows), _run_onnx(apart, rows)
    assert np.array_equal(y, y0)  # the LM head is untouched
    # one int4 step of a block: at most its range / 15 (asymmetric) or max / 7 (symmetric)
    step = 2 * np.abs(table).max() / 7
    if symmetric:
        assert np.array_equal(e, e0)
    else:
        assert np.abs(e - e0).max() <= step
    assert np.abs(e - table[::-1]).max() <= step  # still the table, within int4 rounding


def _unshared(monkeypatch, cols: int):
    """A tied table and head quantized w4 each on its own (sharing off): the model, its
    initializers, the lookup and the head."""
    monkeypatch.setattr(tied_tables, "share_tied_tables", lambda m: 0)
    q, _ = weight_only.quantize_model(_tied_onnx(300, cols)[0], weight_only.resolve("w4"))
    monkeypatch.undo()
    inits = {t.name: t for t in q.graph.initializer}
    gather = next(n for n in q.graph.node if n.op_type == "GatherBlockQuantized")
    head = next(n for n in q.graph.node if n.op_type == "MatMulNBits")
    return q, inits, gather, head


def test_a_table_is_shared_only_with_its_own_blocks(monkeypatch):
    """The check is the codes, not the shapes: an untied head of the same shape keeps the
    table float (GenAI's choice for an untied lookup), and blocks that differ by more than
    a rounding tie are not read by the lookup."""
    import numpy as np

    head = np.random.default_rng(1).standard_normal((300, 512)).astype(np.float32)
    _, summary = weight_only.quantize_model(_tied_onnx(300, 512, head=head)[0],
                                            weight_only.resolve("w4"))
    assert summary["shared_tables"] == 0 and summary["gather_block_quantized"] == 0
    q, inits, gather, head = _unshared(monkeypatch, 512)
    assert tied_tables._same_lookups(gather, head, inits)  # what onnxruntime reads agrees
    t = inits[head.input[1]]
    raw = bytearray(t.raw_data)
    raw[7] ^= 0x88  # two codes 8 steps away
    t.raw_data = bytes(raw)
    assert not tied_tables._same_values(gather, head, inits)
    assert not tied_tables._same_lookups(gather, head, inits)  # onnxruntime sees it too
    assert tied_tables.share_tied_tables(q) == 0
    assert [t.name for t in q.graph.initializer if t.data_type in INT4]
    raw[7] ^= 0x88  # put back: shared
    t.raw_data = bytes(raw)
    assert tied_tables.share_tied_tables(q) == 1


def test_a_rounding_tie_one_step_off_still_shares_the_blocks(monkeypatch):
    """Weights from a 4-bit grid (SmolLM2's GGUF) tie often, and the quantizer's two paths
    break a tie apart: a code one step off. The table then reads the head's rounding (within
    one step of its own); codes off everywhere are another quantization and keep the copy."""
    import numpy as np

    q, inits, gather, head = _unshared(monkeypatch, 576)
    t = inits[head.input[1]]
    raw = bytearray(t.raw_data)
    raw[7] ^= 0x01  # one code one step off (a tie broken the other way)
    t.raw_data = bytes(raw)
    assert tied_tables._same_values(gather, head, inits)
    assert tied_tables._same_lookups(gather, head, inits)
    many = np.frombuffer(bytes(raw), np.uint8) ^ 0x01  # every low nibble one step off
    t.raw_data = many.tobytes()
    assert tied_tables._same_values(gather, head, inits)  # each code is within one step ...
    assert not tied_tables._same_lookups(gather, head, inits)  # ... but not a tie's rarity
    t.raw_data = bytes(raw)
    assert tied_tables.share_tied_tables(q) == 1
