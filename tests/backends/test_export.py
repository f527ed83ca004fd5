"""export -> save -> load: one pipeline with the JIT path, a package verified on load, a fresh
process that runs nothing but the program, and a clear refusal for every bad package or input.

Tolerances: float32 outputs against eager at rtol = atol = 1e-4 (onnxruntime's kernels
reassociate sums; the JIT tests use the same)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpass.aot.package import MANIFEST, PackageError, sign
from fxpass.backends.bpu import export, load
from fxpass.tools import zoo

TOL = {"rtol": 1e-4, "atol": 1e-4}
ROOT = Path(__file__).resolve().parents[2]


def _tensors(x):
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def _assert_eager(model, got, args=(), kwargs=None):
    with torch.no_grad():
        ref = model(*args, **(kwargs or {}))
    exp, act = _tensors(ref), _tensors(got)
    assert len(exp) == len(act) and exp
    for e, a in zip(exp, act, strict=True):
        torch.testing.assert_close(a, e, **TOL)


@pytest.fixture(scope="module")
def bert_package(tmp_path_factory):
    model, kw = zoo.get("bert")
    program = export(model, (), kw)
    path = program.save(tmp_path_factory.mktemp("pkg") / "bert")
    return model, kw, program, Path(path)


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _edit_manifest(path: Path, edit) -> None:
    m = json.loads((path / MANIFEST).read_text())
    edit(m)
    (path / MANIFEST).write_text(json.dumps(sign(m)))


def test_export_is_an_exported_program_with_region_calls_and_matches_eager(bert_package):
    model, kw, program, _ = bert_package
    ep = program.exported_program
    assert isinstance(ep, torch.export.ExportedProgram)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.fxpass.region.default) == len(program.regions) >= 1
    assert not [n for n in ep.graph.nodes if n.op == "call_module"]
    assert program.report.offloaded_macs == program.report.macs  # the whole BERT is a region
    _assert_eager(model, program(**kw), (), kw)


def test_export_runs_the_jit_pipeline(bert_package):
    """One compile function: the report is the JIT backend's, its rules included."""
    _, _, program, _ = bert_package
    assert program.report.rewrites  # the bpu target's rules ran
    assert program.report.regions[0].executor == "onnxruntime"


def test_package_stores_each_weight_once(bert_package):
    model, _, _, path = bert_package
    manifest = json.loads((path / MANIFEST).read_text())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
    files = sum(f["bytes"] for f in manifest["files"].values())
    assert files == sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) - (
        (path / MANIFEST).stat().st_size)
    # a 2-layer 64-wide BERT: the ONNX graph and the program's code are a few % of the weights
    assert files <= 1.1 * weights, (files, weights)


def test_load_in_process_matches_eager(bert_package):
    model, kw, _, path = bert_package
    _assert_eager(model, load(path)(**kw), (), kw)


def test_load_refuses_wrong_input_shape_and_dtype(bert_package):
    _, kw, _, path = bert_package
    program = load(path)
    with pytest.raises(ValueError, match=r"input .*input_ids.* exported for torch.int64\[2, 8\]"):
        program(input_ids=kw["input_ids"][:, :4], attention_mask=kw["attention_mask"][:, :4])
    with pytest.raises(ValueError, match=r"attention_mask.*torch.float32.*exported for"):
        program(input_ids=kw["input_ids"], attention_mask=kw["attention_mask"].float())
    with pytest.raises(ValueError, match="takes 2 input"):
        program(input_ids=kw["input_ids"])


def test_load_refuses_a_truncated_file(bert_package, tmp_path):
    path = _copy(bert_package[3], tmp_path / "p")
    region = path / "weights.bin"
    data = region.read_bytes()
    region.write_bytes(data[: len(data) // 2])
    with pytest.raises(PackageError, match=rf"{region.name} is \d+ bytes, the manifest says"):
        load(path)


def test_load_refuses_an_edited_file(bert_package, tmp_path):
    path = _copy(bert_package[3], tmp_path / "p")
    region = path / "weights.bin"
    data = bytearray(region.read_bytes())
    data[len(data) // 2] ^= 0x40  # one weight's bits: same size, different value
    region.write_bytes(bytes(data))
    with pytest.raises(PackageError, match=rf"{region.name} does not match its checksum"):
        load(path)


def test_load_refuses_an_edited_manifest(bert_package, tmp_path):
    path = _copy(bert_package[3], tmp_path / "p")
    m = json.loads((path / MANIFEST).read_text())
    m["programs"]["main"]["inputs"][0]["shape"] = [1, 8]  # edited by hand, not re-signed
    (path / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(PackageError, match="manifest.json does not match its own digest"):
        load(path)


def test_load_refuses_a_missing_file(bert_package, tmp_path):
    path = _copy(bert_package[3], tmp_path / "p")
    next(path.glob("region_*.onnx")).unlink()
    with pytest.raises(PackageError, match=r"\.onnx is missing from the package"):
        load(path)


def test_load_refuses_another_fxpass_release(bert_package, tmp_path):
    path = _copy(bert_package[3], tmp_path / "p")
    _edit_manifest(path, lambda m: m["versions"].update(fxpass="0.9.0"))
    with pytest.raises(PackageError, match=r"made with fxpass 0.9.0.*Export the model again"):
        load(path)


def _regions(m, **fields):
    for spec in m["programs"].values():
        for r in spec["regions"]:
            r.update(fields)


def test_load_refuses_a_board_package_on_the_host(bert_package, tmp_path):
    """The BPU device's ``can_open`` checks each region entry before anything opens."""
    path = _copy(bert_package[3], tmp_path / "p")
    _edit_manifest(path, lambda m: _regions(m, executor="hbdnn"))
    with pytest.raises(PackageError, match="only the board runtime .* runs: load the package"):
        load(path)
    _edit_manifest(path, lambda m: _regions(m, executor="onnxruntime", march="nash-x"))
    with pytest.raises(PackageError, match="march 'nash-x' is not one this fxpass knows"):
        load(path)


def test_load_refuses_a_directory_that_is_no_package(tmp_path):
    with pytest.raises(PackageError, match="has no manifest.json"):
        load(tmp_path)
    with pytest.raises(PackageError, match=r"nope does not exist; give the directory"):
        load(tmp_path / "nope")
    (tmp_path / "f").write_text("")
    with pytest.raises(PackageError, match=r"f is a file, not a package"):
        load(tmp_path / "f")


def test_save_does_not_replace_an_unrelated_directory(bert_package, tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(PackageError, match="is not an fxpass package: refusing"):
        bert_package[2].save(tmp_path)
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_export_refuses_a_model_that_writes_its_buffers():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("n", torch.zeros(4))

        def forward(self, x):
            self.n.add_(1)
            return x + self.n

    with pytest.raises(RuntimeError, match=r"writes \['n'\] in place.*export_for_generate"):
        export(Counter(), (torch.ones(4),))



def test_a_model_that_returns_its_cache_names_use_cache_false():
    """GPT-2 (and every HF encoder-decoder) returns its cache object unless told not to;
    torch.export refuses that type deep inside its tracer. The error names the fix, and the
    fix works."""
    import transformers

    from fxpass.aot.runtime import ExportError

    torch.manual_seed(0)
    model = transformers.GPT2Model(transformers.GPT2Config(
        vocab_size=512, n_embd=64, n_layer=1, n_head=4, n_positions=64)).eval()
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ExportError, match=r"cannot export GPT2Model: its call returns a "
                       r"transformers cache \(DynamicCache\).*use_cache': False"):
        export(model, (), {"input_ids": ids}, device="ort")
    program = export(model, (), {"input_ids": ids, "use_cache": False}, device="ort",
                     options={"min_compute_macs": 0})  # a region, not CPU torch alone
    assert len(program.report.regions) == 1
    got = program(input_ids=ids, use_cache=False).last_hidden_state
    want = model(input_ids=ids, use_cache=False).last_hidden_state
    assert torch.allclose(got, want, **TOL), (got - want).abs().max()


@pytest.mark.parametrize("device", ["ort", "bpu"])
def test_a_zero_dim_weight_round_trips(device, tmp_path):
    """Scalar parameters and buffers (Apertus' xIELU keeps its beta and eps as 0-dim buffers)
    are weights like any other: saving one once failed on viewing a 0-dim tensor as bytes."""
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(16, 16)
            self.alpha = torch.nn.Parameter(torch.tensor(1.75))
            self.register_buffer("eps", torch.tensor(-1e-6))

        def forward(self, x):  # minimum has no Scalar overload: eps stays a tensor weight
            return torch.expm1(torch.minimum(self.lin(x), self.eps)) * self.alpha

    model, x = Scaled().eval(), torch.randn(2, 16)
    path = export(model, (x,), device=device).save(tmp_path / "p")
    got, want = load(path)(x), model(x)
    assert torch.allclose(got, want, **TOL), (got - want).abs().max()
def test_a_region_program_called_without_load_names_the_fix(bert_package, tmp_path):
    """torch.export.load alone gives a program whose regions are not open: a clear error."""
    from fxpass.aot import runtime as export_mod

    _, kw, program, path = bert_package
    key = program.regions[0].key
    live = export_mod._LIVE.pop(key)
    try:
        ep = torch.export.load(path / "main.pt2")
        low = program.lowered
        with pytest.raises(RuntimeError, match="is not open in this process.*load"):
            ep.module()(*low.weights.values(), *kw.values())
    finally:
        export_mod._LIVE[key] = live


def _fresh_process(path: Path, args, kwargs, tmp_path: Path, generate: bool = False) -> dict:
    inputs, out = tmp_path / "inputs.pt", tmp_path / "out.pt"
    torch.save((args, kwargs), inputs)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-m", "tests.backends.load_child", str(path), str(inputs), str(out),
         *(["generate"] if generate else [])],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "qwen3", "convnet"])
def test_fresh_process_loads_and_runs_nothing_else(name, tmp_path):
    """A fresh process: load + one call equals eager; no rule, partition, region compile or
    Dynamo frame ran there."""
    model, kw = _convnet() if name == "convnet" else zoo.get(name)
    args = ()
    if name == "convnet":
        args, kw = (kw.pop("pixel_values"),), {}
    path = export(model, args, kw).save(tmp_path / name)
    got = _fresh_process(Path(path), args, kw, tmp_path)
    with torch.no_grad():
        ref = _tensors(model(*args, **kw))
    assert len(got["out"]) == len(ref)
    for e, a in zip(ref, got["out"], strict=True):
        torch.testing.assert_close(a, e, **TOL)
    assert got["pass_manager_runs"] == 0
    assert not {k: v for k, v in got["stats"].items()
                if k in ("rules", "partition", "region_compiles", "plan_hit", "plan_miss")}
    assert "frames" not in got["dynamo"] and "stats" not in got["dynamo"], got["dynamo"]


def _convnet():
    """A stock transformers ResNet (2 stages) with random weights."""
    import transformers

    cfg = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                    layer_type="basic", num_channels=3)
    torch.manual_seed(0)
    model = transformers.ResNetModel(cfg).eval()
    return model, {"pixel_values": torch.randn(1, 3, 32, 32)}


# ---- a property: any small generated graph exports, saves, loads and matches eager ----------


@st.composite
def _small_models(draw):
    """A random stack of Linear/Conv and activations, often with a residual."""
    kind = draw(st.sampled_from(["mlp", "conv"]))
    width = draw(st.sampled_from([8, 16, 24]))
    depth = draw(st.integers(1, 3))
    acts = [draw(st.sampled_from(["relu", "gelu", "silu", "tanh", "sigmoid"]))
            for _ in range(depth)]
    residual = draw(st.booleans())
    torch.manual_seed(draw(st.integers(0, 1000)))

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            make = (lambda: torch.nn.Linear(width, width)) if kind == "mlp" else (
                lambda: torch.nn.Conv2d(width, width, 3, padding=1))
            self.layers = torch.nn.ModuleList(make() for _ in range(depth))

        def forward(self, x):
            y = x
            for layer, act in zip(self.layers, acts, strict=True):
                y = getattr(torch.nn.functional, act)(layer(y))
            return (y + x if residual else y), y.sum(-1)

    batch = draw(st.integers(1, 3))
    shape = (batch, width) if kind == "mlp" else (batch, width, 6, 6)
    return M().eval(), torch.randn(shape)


@settings(max_examples=6, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(_small_models())
def test_property_generated_models_round_trip(tmp_path_factory, case):
    model, x = case
    program = export(model, (x,), options={"min_compute_macs": 0})
    assert program.regions  # min_compute_macs=0: every model here has a region
    path = program.save(tmp_path_factory.mktemp("prop") / "p")
    _assert_eager(model, load(path)(x), (x,))


def test_cli_export_then_run(tmp_path, capsys):
    from fxpass.cli import main

    assert main(["export", "bert", str(tmp_path / "pkg")]) == 0
    out = capsys.readouterr()
    assert "region compile" in out.err and "package" in out.out and "1 region(s)" in out.out
    assert main(["run", str(tmp_path / "pkg"), "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "output 0: torch.float32[2, 8, 64]" in out and "median of 2 calls" in out
    assert main(["run", str(tmp_path / "nope")]) == 2
    assert "nope does not exist" in capsys.readouterr().err
