"""Tiered host sessions (issue 12, warm and cold backend time): a region that prepacks large
weights answers from an in-place-weights session while the prepacked one is built in the
background, then switches; results are eager's in both tiers, cold and from the cache."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import warnings

import pytest
import torch

import fxpass
from fxpass.backends.onnx.host import build as compile_mod
from fxpass.backends.onnx.host import entry as entry_mod
from fxpass.backends.onnx.host import prepare as host
from fxpass.backends.onnx.host.ort import OrtExecutor, TieredExecutor, _tier_pool, settle


class _Tiered(TieredExecutor):
    made: list[_Tiered] = []

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        _Tiered.made.append(self)


def _model(dtype: torch.dtype = torch.float32, hidden: int = 256) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 64, bias=False)
    ).eval().to(dtype)


@pytest.fixture(autouse=True)
def _settled():
    """No test leaves a build running into the next one (digest counters, the pool)."""
    yield
    settle()


@pytest.fixture
def small_tier(monkeypatch):
    """Tier this test's small model (the default bound is 16 MiB of weights read in place)."""
    monkeypatch.setattr(host, "TIER_MIN_BYTES", 64 * 1024)
    monkeypatch.setattr(compile_mod, "TieredExecutor", _Tiered)
    monkeypatch.setattr(entry_mod, "TieredExecutor", _Tiered)
    _Tiered.made = []


@pytest.fixture
def hold_builds():
    """Second tiers queue behind this until it is set (the pool has one worker)."""
    gate = threading.Event()
    _tier_pool().submit(gate.wait, 60)
    yield gate
    gate.set()


def _compile(m, x, tmp_path, **options):
    torch._dynamo.reset()
    c = torch.compile(m, backend="fxpass_bpu", dynamic=False,
                      options={"min_compute_macs": 0, "cache_dir": str(tmp_path), **options})
    with torch.no_grad():
        return c, c(x)


def _prepacks(ex: OrtExecutor) -> bool:
    cfg = ex.session.get_session_options().get_session_config_entry
    try:
        return cfg("session.disable_prepacking") != "1"
    except Exception:  # noqa: BLE001 - onnxruntime raises for an entry never set
        return True


def _meta(tmp_path) -> dict | None:
    found = list(tmp_path.rglob("*.host.json"))
    return json.loads(found[0].read_bytes()) if found else None


def test_cold_compile_returns_before_the_prepacked_session_exists(
    small_tier, tmp_path, monkeypatch
):
    gate = threading.Event()
    build = compile_mod.build_ort

    def held(*a, **k):  # the second tier waits until the first has answered
        assert gate.wait(60)
        return build(*a, **k)

    monkeypatch.setattr(compile_mod, "build_ort", held)
    m, x = _model(), torch.randn(16, 64)
    c, out = _compile(m, x, tmp_path)
    with torch.no_grad():
        ref = m(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)  # float32
    (tier,) = _Tiered.made
    first = tier.current
    assert isinstance(first, OrtExecutor) and not _prepacks(first)
    params = {p.data_ptr() for p in m.parameters() if p.dim() == 2}
    assert {t.data_ptr() for t in first.shared.values()} == params, "weights read in place"
    assert _meta(tmp_path) is None, "the entry is written by the second tier, later"
    rep = fxpass.compile_reports()[-1]
    assert rep.regions[0].first_tier is True and "first tier" in str(rep)

    gate.set()
    second = tier.wait()
    assert rep.regions[0].first_tier is False and "first tier" not in str(rep)
    assert second is not first and _prepacks(second) and not second.shared
    with torch.no_grad():
        torch.testing.assert_close(c(x), ref, rtol=1e-5, atol=1e-5)
    assert tier.current is second
    meta = _meta(tmp_path)
    assert meta["prepack"] is True and len(set(meta["fast"].values())) == 2  # both weights
    assert list(tmp_path.rglob("*.fast.onnx")), "the first tier's model is in the entry"


def test_weight_written_during_the_build_never_reaches_the_cache(
    small_tier, tmp_path, monkeypatch
):
    """The caller has its answer before the second tier writes the weights. A write through
    ``.data`` (no version counter sees it) in between must not be stored under the key of the
    old values: the build checks the weights against the key afterwards and drops the entry."""
    gate = threading.Event()
    build = compile_mod.build_ort

    def held(*a, **k):
        assert gate.wait(60)
        return build(*a, **k)

    monkeypatch.setattr(compile_mod, "build_ort", held)
    m, x = _model(), torch.randn(16, 64)
    c, _ = _compile(m, x, tmp_path)
    (tier,) = _Tiered.made
    with torch.no_grad():
        m[0].weight.data.mul_(-1)
    gate.set()
    with pytest.warns(RuntimeWarning, match="changed while the prepacked session was built"):
        kept = tier.wait()
    assert not _prepacks(kept)
    assert _meta(tmp_path) is None, "no entry under the old values' key"
    with torch.no_grad():  # the first tier reads the weights in place: the new values
        torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)


def test_cache_hit_opens_its_first_tier_from_the_entry(small_tier, tmp_path):
    m, x = _model(), torch.randn(16, 64)
    _compile(m, x, tmp_path)
    settle()  # the entry is complete
    twin = _model()  # same values, other tensors: a hit binds these
    _Tiered.made = []
    c, out = _compile(twin, x, tmp_path)
    assert fxpass.compile_reports()[-1].regions[0].cached is True
    with torch.no_grad():
        ref = twin(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    (tier,) = _Tiered.made
    second = tier.wait()
    assert _prepacks(second)
    with torch.no_grad():
        torch.testing.assert_close(c(x), ref, rtol=1e-5, atol=1e-5)


def test_damaged_weights_file_is_rebuilt_behind_the_first_tier(small_tier, tmp_path):
    """A damaged weights file is refused (never loaded) and the entry dropped; the first tier
    answers meanwhile, and the prepacked session is rebuilt from this graph's own weights and
    stored again, so the next process is a hit."""
    from fxpass.jit.remote import STATS

    m, x = _model(), torch.randn(16, 64)
    _compile(m, x, tmp_path)
    settle()
    (weights,) = tmp_path.rglob("*.host.bin")
    raw = bytearray(weights.read_bytes())
    raw[-5] ^= 0xFF  # inside the last weight
    weights.write_bytes(bytes(raw))
    _Tiered.made = []
    rebuilt = STATS["region_weights_rebuilt"]
    with warnings.catch_warnings(record=True) as seen:  # the build may fail before the call
        warnings.simplefilter("always")
        c, out = _compile(_model(), x, tmp_path)
        (tier,) = _Tiered.made
        kept = tier.wait()
    with torch.no_grad():
        ref = m(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    said = [str(w.message) for w in seen]
    assert any("corrupt" in w and "checksum" in w for w in said), said
    assert STATS["region_weights_rebuilt"] == rebuilt + 1
    assert _prepacks(kept), "the rebuilt prepacked session took over"
    with torch.no_grad():
        torch.testing.assert_close(c(x), ref, rtol=1e-5, atol=1e-5)
    assert _meta(tmp_path) is not None, "stored again"
    _compile(_model(), x, tmp_path)
    assert fxpass.compile_reports()[-1].regions[0].cached is True


def test_tiered_false_builds_the_prepacked_session_first(small_tier, tmp_path):
    m, x = _model(), torch.randn(16, 64)
    _, out = _compile(m, x, tmp_path, tiered=False)
    assert _Tiered.made == []
    meta = _meta(tmp_path)
    # its in-place model is kept only for a process without the weights file (remote tier)
    assert meta["prepack"] is True and meta["tiered"] is False and "fast" in meta
    with torch.no_grad():
        torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)
    # a hit with its weights file opens the prepacked session at once, untiered
    _compile(m, x, tmp_path)
    assert _Tiered.made == [] and fxpass.compile_reports()[-1].regions[0].cached is True
    # without it: the first tier answers while the file is rebuilt, and the entry stays
    # untiered
    from fxpass.jit.remote import STATS

    rebuilt = STATS["region_weights_rebuilt"]
    (weights,) = tmp_path.rglob("*.host.bin")
    weights.unlink()
    c, out = _compile(m, x, tmp_path)
    (tier,) = _Tiered.made
    assert _prepacks(tier.wait())
    assert STATS["region_weights_rebuilt"] == rebuilt + 1
    assert _meta(tmp_path)["tiered"] is False and list(tmp_path.rglob("*.host.bin"))
    with torch.no_grad():
        torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)


def test_small_weights_are_not_tiered(tmp_path, monkeypatch):
    """Below 16 MiB read in place, a second session would save the caller too little."""
    monkeypatch.setattr(compile_mod, "TieredExecutor", _Tiered)
    monkeypatch.setattr(entry_mod, "TieredExecutor", _Tiered)
    _Tiered.made = []
    m, x = _model(), torch.randn(16, 64)
    _, out = _compile(m, x, tmp_path)
    assert _Tiered.made == [] and "fast" not in _meta(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)


def test_bf16_first_tier_casts_the_weights_in_its_graph(small_tier, tmp_path, hold_builds):
    """A BF16 model's host region computes in float32. Its first tier reads the BF16 weights
    in place (an OrtValue over their memory) and casts them per call, so no float32 copy sits
    beside the prepacked one while the second tier builds; both tiers give eager's answer
    within BF16 tolerance, cold and from the cache."""
    m, x = _model(torch.bfloat16, 512), torch.randn(16, 64).to(torch.bfloat16)  # 64 KiB each
    with torch.no_grad():
        ref = m(x).float()
    c, out = _compile(m, x, tmp_path)
    (tier,) = _Tiered.made
    first = tier.current
    bf16 = {p.data_ptr() for p in m.parameters() if p.dim() == 2}
    assert {t.data_ptr() for t in first.shared.values() if t.dtype == torch.bfloat16} == bf16
    assert all(t.dtype == torch.bfloat16 for t in first.shared.values() if t.dim() == 2)
    tol = {"rtol": 1.6e-2, "atol": 1e-2}  # bf16 output rounding
    torch.testing.assert_close(out.float(), ref, **tol)
    hold_builds.set()
    second = tier.wait()
    assert _prepacks(second)
    with torch.no_grad():
        torch.testing.assert_close(c(x).float(), ref, **tol)
    assert len(_meta(tmp_path)["fast"]) == 2

    twin = _model(torch.bfloat16, 512)
    _Tiered.made = []
    hold_builds.clear()
    _tier_pool().submit(hold_builds.wait, 60)
    c, out = _compile(twin, x, tmp_path)
    assert fxpass.compile_reports()[-1].regions[0].cached is True
    (tier,) = _Tiered.made
    assert {t.data_ptr() for t in tier.current.shared.values() if t.dim() == 2} == {
        p.data_ptr() for p in twin.parameters() if p.dim() == 2}
    torch.testing.assert_close(out.float(), ref, **tol)
    hold_builds.set()
    assert _prepacks(tier.wait())
    with torch.no_grad():
        torch.testing.assert_close(c(x).float(), ref, **tol)


def test_failed_build_warns_and_the_first_tier_keeps_answering():
    calls = []

    def first(*t):
        calls.append("first")
        return t

    def boom():
        raise OSError("disk full")

    ex = TieredExecutor(first, boom, "r")
    with pytest.warns(RuntimeWarning, match="OSError: disk full"):
        assert ex.wait() is first
    assert ex(1, 2) == (1, 2) and calls == ["first"]


def test_calls_during_the_build_use_the_first_tier_then_the_second():
    gate = threading.Event()

    def second(*t):
        return ("second",)

    def build():
        assert gate.wait(60)
        return second

    ex = TieredExecutor(lambda *t: ("first",), build, "r")
    assert [ex() for _ in range(3)] == [("first",)] * 3
    gate.set()
    ex.wait()
    assert ex() == ("second",)


@pytest.mark.slow  # a subprocess round trip
def test_a_process_that_exits_right_after_its_first_call_still_stores_the_entry(tmp_path):
    """The second tier builds after the first call; a process that ends then must still write
    its cache entry (the interpreter joins the tier thread), so the next process hits."""
    script = f"""
import torch
from fxpass.backends.onnx.host import prepare as host
host.TIER_MIN_BYTES = 64 * 1024
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                        torch.nn.Linear(256, 64, bias=False)).eval()
with torch.no_grad():
    torch.compile(m, backend="fxpass_bpu", dynamic=False, options={{
        "min_compute_macs": 0, "cache_dir": {str(tmp_path)!r}}})(torch.randn(16, 64))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    meta = _meta(tmp_path)
    assert meta is not None and "fast" in meta, "the entry was stored before the exit"
    assert list(tmp_path.rglob("*.host.bin")) and list(tmp_path.rglob("*.fast.onnx"))


@pytest.mark.parametrize(("dtype", "rows", "in_place"), [
    (torch.float32, 16, False), (torch.bfloat16, 16, False), (torch.float32, 1, False),
    (torch.float32, 1, True),
])
def test_hit_with_weights_in_another_layout_is_not_read_in_place(
    dtype, rows, in_place, small_tier, tmp_path
):
    """The key hashes a weight's values, not its strides: a model holding the same values as
    transposed views hits the entry. Its weights cannot be fed in place (an OrtValue reads a
    BF16 pointer as row-major: the review's reproduction gave an error of 1.34), so the hit
    opens the prepacked model instead, and a one-row entry that reads its weights in place in
    every tier (``prepack_one_row=False``) is a miss; the answer is eager's."""
    opts = {"prepack_one_row": False} if in_place else {}
    x = torch.randn(rows, 64).to(dtype)
    _compile(_model(dtype, 512), x, tmp_path, **opts)
    settle()
    twin = _model(dtype, 512)
    for p in twin.parameters():
        if p.dim() == 2:
            p.data = p.data.t().contiguous().t()  # same values, column-major
    assert not any(p.is_contiguous() for p in twin.parameters() if p.dim() == 2)
    _Tiered.made = []
    c, out = _compile(twin, x, tmp_path, **opts)
    assert fxpass.compile_reports()[-1].regions[0].cached is not in_place
    assert _Tiered.made == []
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {
        "rtol": 1.6e-2, "atol": 1e-2}
    with torch.no_grad():
        torch.testing.assert_close(out.float(), twin(x).float(), **tol)


def test_a_one_row_region_is_built_at_once(small_tier, tmp_path):
    """One row per GEMM (a decode step, a 1-token forward): the first tier would be barely
    slower than the prepacked session, so no build is left running beside the calls."""
    m, x = _model(), torch.randn(1, 64)
    c, out = _compile(m, x, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)  # float32
    assert _Tiered.made == []
    assert _meta(tmp_path)["prepack"] is True  # built, stored, prepacked: before the answer
    assert fxpass.compile_reports()[-1].regions[0].first_tier is None
