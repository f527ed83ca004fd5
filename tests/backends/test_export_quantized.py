"""Quantized and board regions ahead of time: ``export(..., calibration=...)`` calibrates the
exported program, the package holds the quantized artifact (the host's QDQ model, or the
board's ``.hbm`` through the hbdk4 contract fake) and ``load`` runs it with nothing compiled.

Tolerances: quantized outputs against eager float by cosine (w8a16, measured 0.99994 on
qwen3-tiny's last-token logits); a loaded package against the exported program it came from
exactly (the same artifact on the same executor)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from fxpass.aot.package import PackageError
from fxpass.aot.runtime import ExportError
from fxpass.backends.bpu import export, export_for_generate, load
from fxpass.tools import zoo
from tests.backends import fake_hbdk4
from tests.backends.test_hbdk4_contract import _batches, _model

OPTS = {"min_compute_macs": 0}


def _ids(seed, tokens=8):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 512, (1, tokens), generator=g), "use_cache": False}


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


def test_host_quantized_export_saves_the_qdq_model_and_loads_it(tmp_path):
    m, _ = zoo.get("qwen3")
    prog = export(m, (), _ids(0), options={**OPTS, "quantize": "w8a16"},
                  calibration=[_ids(s) for s in range(1, 7)])
    (r,) = prog.regions
    assert r.quantizing.info.state == "calibrated" and r.quantizing.info.batches == 6
    held = _ids(99)
    with torch.no_grad():
        ref = m(**held).logits[:, -1]
        got = prog(**held).logits[:, -1]
    assert _cos(got, ref) >= 0.9995
    path = prog.save(tmp_path / "pkg")
    manifest = json.loads((tmp_path / "pkg" / "manifest.json").read_text())
    (entry,) = manifest["programs"]["main"]["regions"]
    assert entry["executor"] == "onnxruntime" and entry["quantize"]["config"] == "w8a16"
    assert entry["quantize"]["cosine"] >= 0.9995
    loaded = load(path)
    torch.testing.assert_close(loaded(**held).logits[:, -1], got, rtol=0, atol=0)


def test_board_export_compiles_the_hbm_without_a_board_and_loads_on_one(tmp_path, monkeypatch):
    rec = fake_hbdk4.install(monkeypatch)
    board_runtime = __import__("sys").modules.pop("hbm_runtime")  # a workstation: hbdk4 only
    m, x = _model(), _batches(1, seed=9)[0]
    prog = export(m, (x,), options={**OPTS, "executor": "hbdnn", "march": "nash-m"},
                  calibration=_batches())
    kinds = [c[0] for c in rec.calls]
    assert kinds == ["export", "convert", "compile"] * len(prog.regions)  # no runtime call
    assert ("convert", "nash-m") in rec.calls
    with torch.no_grad():
        ref, host = m(x), prog(x)
    assert _cos(host, ref) >= 0.999  # the QDQ model hbdk4 compiled, run on the host
    path = prog.save(tmp_path / "pkg")
    names = os.listdir(path)
    assert sum(n.endswith(".hbm") for n in names) == len(prog.regions) and not any(
        n.startswith("region_") and n.endswith(".onnx") for n in names)
    with pytest.raises(PackageError, match="board runtime.*load the package on the board"):
        load(path)  # no hbm_runtime here
    monkeypatch.setitem(__import__("sys").modules, "hbm_runtime", board_runtime)
    loaded = load(path)
    torch.testing.assert_close(loaded(x), host, rtol=0, atol=0)
    assert ("runtime", next(n for n in names if n.endswith(".hbm"))) in rec.calls
    assert rec.calls[-1][0] == "run"  # the fake board runtime ran it, checking names/dtypes


def test_quantized_export_without_calibration_or_with_wrong_shapes_is_refused():
    m, x = _model(), _batches(1)[0]
    with pytest.raises(ExportError, match="need calibration data"):
        export(m, (x,), options={**OPTS, "quantize": "w8a8"})
    with pytest.raises(ExportError, match="exported for"):
        export(m, (x,), options={**OPTS, "quantize": "w8a8"},
               calibration=[torch.randn(2, 16)])
    with pytest.raises(ExportError, match="nothing is quantized"):
        export(m, (x,), options=OPTS, calibration=[x])


def test_quantized_generate_export_calibrates_prefill_and_decode(tmp_path):
    m, _ = zoo.get("qwen3")
    prompts = [torch.randint(3, 500, (1, 6), generator=torch.Generator().manual_seed(s))
               for s in range(3)]
    prog = export_for_generate(m, max_cache_len=32, prefill_length=8,
                               options={**OPTS, "quantize": "w8a16"}, calibration=prompts,
                               calibration_tokens=6)
    infos = [r.quantizing.info for p in (prog.prefill, prog.decode) for r in p.regions]
    assert len(infos) == 2 and all(i.state == "calibrated" and i.cosine >= 0.999 for i in infos)
    runner = load(prog.save(tmp_path / "gen"))
    ids = torch.randint(3, 500, (1, 7), generator=torch.Generator().manual_seed(42))
    got = runner.generate(ids, max_new_tokens=8)
    with torch.no_grad():
        ref = m.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static")
    assert got.shape == ref.shape and torch.equal(got[:, :7], ids)
    # w8a16 may flip a near-tie among random-weight logits; most tokens must agree
    assert (got[:, 7:] == ref[:, 7:]).float().mean() >= 0.5


def test_quantized_encoder_buckets_each_calibrate_on_inputs_of_their_size(tmp_path):
    from fxpass.backends.bpu import export_for_encoder

    m, _ = zoo.get("bert")

    def enc(n, seed):
        g = torch.Generator().manual_seed(seed)
        return {"input_ids": torch.randint(5, 500, (1, n), generator=g),
                "attention_mask": torch.ones(1, n, dtype=torch.long)}

    opts = {**OPTS, "quantize": "w8a16"}
    with pytest.raises(ExportError, match="saw none of the calibration data"):
        export_for_encoder(m, buckets={"seq": [8, 16]}, options=opts, calibration=[enc(5, 0)])
    prog = export_for_encoder(m, buckets={"seq": [8, 16]}, options=opts,
                              calibration=[enc(n, s) for s, n in enumerate([5, 7, 12, 16])])
    runner = load(prog.save(tmp_path / "enc"))
    for n in (6, 13):
        x = enc(n, 100 + n)
        with torch.no_grad():
            ref = m(**x).last_hidden_state
        assert _cos(runner(**x).last_hidden_state, ref) >= 0.999
