"""Contract fake of hbdk4 (compiler) and hbm_runtime (board runtime), the one sanctioned fake.

It checks every call against the documented API (docs/bpu-facts.md) and records it:
``onnx.export`` takes a loaded ModelProto with shapes recorded on every value;
``convert(module, march)`` takes export's module and a known march, and places each op as the
real one does: a tensor-engine op (Conv/ConvTranspose/MatMul/Gemm) whose data inputs are not
dequantized (no Q/DQ) is float, which the real ``convert`` places on the CPU
("external_cpu", docs/bpu-facts.md); the fake reports that as a ``FloatMacError`` (a
board-bound model must never do it), and with ``advice=True`` writes the per-op placement to
``advice_path``;
``compile(module, path, march, opt=2)`` takes convert's module, the same march and a
``.hbm`` path in an existing directory. The "compiled" artifact embeds the ONNX model, and
the fake runtime runs it with onnxruntime after checking input names, dtypes and shapes as
the board runtime does, so results are real numbers, not canned ones.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
import types
from dataclasses import dataclass, field

import numpy as np
import onnx

MAGIC = b"FAKEHBM1"
MARCHES = {"nash-e", "nash-m", "nash-p", "nash-h"}


TENSOR_ENGINE = {"Conv", "ConvTranspose", "MatMul", "Gemm"}


class FloatMacError(AssertionError):
    """A MAC op without Q/DQ on its inputs reached convert(): it would run on the board's CPU."""


@dataclass
class Recorder:
    calls: list[tuple] = field(default_factory=list)
    fail_compile: bool = False
    placement: list[dict] = field(default_factory=list)  # convert()'s per-op placement


REC = Recorder()


class Module:
    def __init__(self, proto: onnx.ModelProto, stage: str, march: str | None = None):
        self.proto, self.stage, self.march = proto, stage, march


def _static(vi: onnx.ValueInfoProto) -> bool:
    dims = vi.type.tensor_type.shape.dim
    return vi.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims)


def export(proto, *, name=None):
    assert isinstance(proto, onnx.ModelProto), (
        f"export takes a loaded ModelProto, got {type(proto)}"
    )
    g = proto.graph
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        assert _static(vi), f"value {vi.name} has no static shape recorded"
    produced = {o for n in g.node for o in n.output}
    described = {vi.name for vi in list(g.value_info) + list(g.output)}
    assert produced <= described | {o for o in produced if o == ""}, (
        f"values without value_info: {sorted(produced - described)[:5]}"
    )
    REC.calls.append(("export", name))
    return Module(proto, "exported")


def placement(proto: onnx.ModelProto) -> list[dict]:
    """Per op: "bpu", or "external_cpu" with the reason, for tensor-engine ops."""
    g = proto.graph
    producer = {o: n for n in g.node for o in n.output}
    out = []
    for n in g.node:
        where, why = "bpu", ""
        if n.op_type in TENSOR_ENGINE:
            floats = [
                i
                for i in n.input[:2]
                if getattr(producer.get(i), "op_type", "") != "DequantizeLinear"
            ]
            if floats:
                where, why = "external_cpu", f"float input(s) {floats}: no Q/DQ"
        out.append({"op": n.op_type, "name": n.name or n.output[0], "place": where, "why": why})
    return out


def convert(module, march, advice=False, advice_path=""):
    assert isinstance(module, Module) and module.stage == "exported", (
        "convert takes export()'s module"
    )
    assert march in MARCHES, f"unknown march {march!r}"
    assert isinstance(advice, bool) and isinstance(advice_path, str)
    REC.calls.append(("convert", march))
    REC.placement = placement(module.proto)
    if advice and advice_path:
        with open(advice_path, "w") as f:
            json.dump(REC.placement, f)
    cpu = [p for p in REC.placement if p["place"] == "external_cpu"]
    if cpu:
        raise FloatMacError(
            f"{len(cpu)} MAC op(s) would be placed on the CPU, not the BPU: "
            + "; ".join(f"{p['op']} {p['name']}: {p['why']}" for p in cpu[:5])
        )
    return Module(module.proto, "converted", march)


def compile(module, path, march, opt=2, jobs=4, **kw):  # noqa: A001 - hbdk4's name
    assert isinstance(module, Module) and module.stage == "converted", (
        "compile takes convert()'s module"
    )
    assert march == module.march, f"compile march {march!r} != convert march {module.march!r}"
    assert str(path).endswith(".hbm"), f"compile writes a .hbm, got {path}"
    assert os.path.isdir(os.path.dirname(str(path))), "output directory must exist"
    assert opt == 2, f"expected opt=2, got {opt}"
    REC.calls.append(("compile", os.path.basename(str(path)), march, opt))
    if REC.fail_compile:
        raise RuntimeError("fake hbdk4: op not placeable on BPU (injected failure)")
    with open(path, "wb") as f:
        f.write(MAGIC + module.proto.SerializeToString())
    return object()


class HB_HBMRuntime:  # noqa: N801 - the board runtime's name
    def __init__(self, path):
        import onnxruntime as ort

        with open(path, "rb") as f:
            data = f.read()
        assert data.startswith(MAGIC), f"{path} is not an artifact of compile()"
        proto = onnx.load_from_string(data[len(MAGIC) :])
        self.session = ort.InferenceSession(
            proto.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        m = proto.graph.name or "model"
        self.model_names = [m]
        ins = self.session.get_inputs()
        self.input_names = {m: [i.name for i in ins]}
        self.input_shapes = {m: {i.name: list(i.shape) for i in ins}}
        types_ = {
            "tensor(float)": np.float32,
            "tensor(float16)": np.float16,
            "tensor(bool)": np.bool_,
            "tensor(int32)": np.int32,
            "tensor(int8)": np.int8,
            "tensor(int16)": np.int16,
        }
        self.input_dtypes = {m: {i.name: types_.get(i.type) for i in ins}}
        self.output_names = {m: [o.name for o in self.session.get_outputs()]}
        REC.calls.append(("runtime", os.path.basename(str(path))))

    def run(self, feeds, model_name=None):
        m = model_name or self.model_names[0]
        assert set(feeds) == set(self.input_names[m]), (
            f"inputs must be bound by name: got {sorted(feeds)}, want {self.input_names[m]}"
        )
        for k, v in feeds.items():
            assert list(v.shape) == self.input_shapes[m][k], f"{k}: shape {v.shape}"
            assert v.dtype == self.input_dtypes[m][k], f"{k}: dtype {v.dtype}"
        outs = self.session.run(self.output_names[m], feeds)
        REC.calls.append(("run", m))
        return {m: dict(zip(self.output_names[m], outs, strict=True))}


def install(monkeypatch) -> Recorder:
    """Put the fakes in sys.modules (with specs, so importlib.util.find_spec sees them)."""
    REC.calls.clear()
    REC.fail_compile = False
    REC.placement = []

    def mod(name):
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        return m

    hbdk4, compiler, onnx_mod, runtime = (
        mod("hbdk4"),
        mod("hbdk4.compiler"),
        mod("hbdk4.compiler.onnx"),
        mod("hbm_runtime"),
    )
    onnx_mod.export = export
    compiler.onnx, compiler.convert, compiler.compile = onnx_mod, convert, compile
    hbdk4.compiler = compiler
    hbdk4.__version__ = "fake-0"
    runtime.HB_HBMRuntime = HB_HBMRuntime
    for name, m in [
        ("hbdk4", hbdk4),
        ("hbdk4.compiler", compiler),
        ("hbdk4.compiler.onnx", onnx_mod),
        ("hbm_runtime", runtime),
    ]:
        monkeypatch.setitem(sys.modules, name, m)
    return REC
