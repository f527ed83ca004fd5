"""Artifact cache: reused by a second process, corruption detected and rebuilt, keys honest."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import fxpass
from fxpass.backends.bpu.cache import ArtifactCache, region_key
from tests.conftest import trace

SCRIPT = textwrap.dedent(
    """
    import json, sys, time, torch
    # the model only; the backend is found through its entry point
    import fxpass.backends.bpu.zoo as zoo
    model, kw = zoo.get("qwen3", layers=1)
    t = time.perf_counter()
    with torch.no_grad():
        out = torch.compile(model, backend="fxpass_bpu", dynamic=False,
                            options={"min_compute_macs": 0, "cache_dir": sys.argv[1]})(**kw)
        ref = model(**kw)
    import fxpass
    r = fxpass.compile_reports()[-1]
    print(json.dumps({"cached": [g.cached for g in r.regions], "regions": len(r.regions),
                      "err": (out.logits - ref.logits).abs().max().item(),
                      "seconds": time.perf_counter() - t}))
    """
)


def _run(cache_dir):
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(cache_dir)], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_second_process_reuses_artifacts_and_corruption_is_rebuilt(tmp_path):
    first = _run(tmp_path)
    assert first["regions"] == 1 and first["cached"] == [False] and first["err"] < 1e-4
    second = _run(tmp_path)
    assert second["cached"] == [True] and second["err"] < 1e-4
    # corrupt every artifact: detected, rebuilt, still correct
    arts = [p for p in tmp_path.rglob("*.onnx")]
    assert arts
    for p in arts:
        p.write_bytes(p.read_bytes()[:-7] + b"garbage")
    third = _run(tmp_path)
    assert third["cached"] == [False] and third["err"] < 1e-4


def test_cache_key_covers_node_arguments_and_full_weights():
    x = torch.randn(4, 8)
    k1 = region_key(trace(lambda a: torch.nn.functional.layer_norm(a, (8,), eps=1e-5), x))
    k2 = region_key(trace(lambda a: torch.nn.functional.layer_norm(a, (8,), eps=1e-6), x))
    assert k1 != k2  # eps is a node argument
    m = torch.nn.Linear(64, 64)
    g = torch.fx.symbolic_trace(m)
    a = region_key(g, march="nash-p")
    with torch.no_grad():
        m.weight[63, 63] += 1  # one element, far from any sample
    assert region_key(g, march="nash-p") != a
    assert region_key(g, march="nash-e") != region_key(g, march="nash-p")


def test_corrupt_manifest_and_atomic_put(tmp_path):
    c = ArtifactCache(tmp_path)
    c.put("abcd", ".bin", b"payload")
    assert c.get("abcd", ".bin") == b"payload"
    art, man = c._paths("abcd", ".bin")
    man.write_text("{not json")
    with pytest.warns(UserWarning, match="corrupt"):
        assert c.get("abcd", ".bin") is None
    assert not art.exists()
    assert not list(tmp_path.rglob("*.tmp"))  # no temp files left behind
    fxpass.compile_reports()  # public accessor exists
