"""The device API's contract, through a device registered as a third-party plugin would be.

The device under test, ``tp_toy``, really runs its regions: its executor is the region's own
graph run by torch (a device whose "compiler" is the identity). That is enough to exercise what
the framework owes a device (partition by its capability, its compile, splicing, keys by its
identity) and what it checks of one: a capability that raises, an executor with the wrong
output count, a compile that returns the wrong thing; each error names the device.
"""

from __future__ import annotations

import importlib
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import fxpass
from fxpass import plugins
from fxpass.device import DeviceError
from fxpass.jit.backend import backend_for
from tests.fxpass.test_plugin_in_compile import fresh  # noqa: F401, F811 - the fixture
from tests.fxpass.test_plugin_isolation import make_dist

TOY = textwrap.dedent(
    '''
    from dataclasses import dataclass

    import torch
    from fxpass.device import Artifact, Device
    from fxpass.plugins import Target

    aten = torch.ops.aten
    MODE = {"mode": "ok"}   # the tests flip it to break the contract


    @dataclass(frozen=True)
    class ToyOptions:
        extra_outputs: int = 0


    class Toy(Device):
        name = "toy"
        target = "toy"
        Options = ToyOptions
        modules = ("tp_toy",)

        def reject(self, node, opts):
            if MODE["mode"] == "raise" and node.target is aten.relu.default:
                raise KeyError("no table entry")
            ok = (aten.mm.default, aten.addmm.default, aten.relu.default, aten.t.default)
            return None if node.target in ok else f"{node.target} is not a toy op"

        def compile(self, region, ctx):
            gm, extra = region.gm, ctx.device_options.extra_outputs
            if MODE["mode"] == "junk":
                return "not an artifact"

            def run(*xs):
                out = list(gm(*xs))
                return out + out[:1] * extra   # a broken executor returns too many

            return Artifact(run, size=sum(p.numel() for p in gm.buffers()))


    def fxpass_devices():
        return [Toy()]


    def fxpass_targets():
        return [Target(name="toy", description="a toy device")]
    '''
)


@pytest.fixture
def toy(fresh: Path) -> Iterator[object]:  # noqa: F811 - the imported fixture
    """The toy device installed as its own distribution, in a fresh registry."""
    make_dist(fresh, "tp-toy", "tp_toy", TOY)
    yield importlib.import_module("tp_toy")


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 8)).eval()


def _run(options: dict) -> tuple[torch.Tensor, torch.Tensor]:
    m, x = _model(), torch.randn(4, 32)
    with torch.no_grad():
        got = torch.compile(m, backend=backend_for("toy"), options=options)(x)
        return got, m(x)


def test_a_plugin_device_gets_regions_it_runs(toy: object) -> None:
    assert fxpass.load().devices["toy"].plugin == "tp-toy:tp_toy"
    got, want = _run({"min_compute_macs": 0})
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # float32, the same ops
    rep = fxpass.compile_reports()[-1]
    assert rep.device == "toy" and len(rep.regions) == 1 and rep.regions[0].fallback is None
    assert rep.summary().startswith("fxpass_toy graph")


def test_a_device_option_is_its_own_and_checked_by_it(toy: object) -> None:
    with pytest.raises(Exception, match="fxpass_toy option 'extra_outputs'.*int"):
        _run({"extra_outputs": "two"})
    with pytest.raises(Exception, match="unknown option.*'march'.*extra_outputs"):
        _run({"march": "nash-p"})  # another device's option is not this one's


def test_a_capability_that_raises_names_the_device_and_node(toy: object) -> None:
    toy.MODE["mode"] = "raise"
    with pytest.raises(Exception, match=r"device toy \(tp-toy:tp_toy\): its capability raised "
                       r"on node relu.*KeyError"):
        _run({"min_compute_macs": 0, "strict": True})


def test_an_executor_with_the_wrong_output_count_falls_back_naming_the_device(toy) -> None:
    with pytest.warns(UserWarning, match="fxpass_toy region .* 2 outputs, compiled for 1"):
        got, want = _run({"min_compute_macs": 0, "extra_outputs": 1})
    torch.testing.assert_close(got, want)  # the region's eager graph answered
    torch._dynamo.reset()
    with pytest.raises(Exception, match="fxpass_toy region .* 2 outputs, compiled for 1"):
        _run({"min_compute_macs": 0, "extra_outputs": 1, "strict": True})


def test_a_compile_that_returns_no_artifact_names_the_device(toy: object) -> None:
    toy.MODE["mode"] = "junk"
    with pytest.raises(Exception, match="device toy: compile.. returned 'not an artifact'"):
        _run({"min_compute_macs": 0, "strict": True})


def test_editing_a_device_module_changes_its_keys(toy: object) -> None:
    """The cache-key bug this guards: keys hashed fxpass and the BPU backend only, so a device
    in a distribution of its own could change its lowering and keep stale artifacts."""
    from fxpass.jit.backend import compile_region
    from fxpass.jit.digest import source_digest
    from fxpass.jit.options import from_options
    from fxpass.partition.partition import partition
    from fxpass.partition.region import extract

    dev = fxpass.load().devices["toy"]
    opts = from_options({"min_compute_macs": 0, "cache": False}, "toy")
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.nn.functional.linear(x, w, b))

    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(
        torch.randn(4, 32), torch.randn(32, 32), torch.randn(32))
    part = partition(gm, dev.capability(opts.dev), min_compute_macs=0)
    rg = extract(gm, part.regions[0])
    before_id, before_key = dev.identity(opts.dev), compile_region(rg, "r", opts, None).key
    src = Path(toy.__file__)
    src.write_text(src.read_text() + "\n# a one-line edit\n")
    source_digest.cache_clear()  # a new process would read the file again
    after_id, after_key = dev.identity(opts.dev), compile_region(rg, "r", opts, None).key
    assert before_id["source"] != after_id["source"]
    assert before_key != after_key


def test_an_unknown_device_names_the_fix() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(DeviceError, match="'nosuch' is not installed.*install the plugin"):
            plugins.get_device("nosuch")


def test_a_device_missing_its_compile_or_capability_is_refused_at_registration() -> None:
    from fxpass.device import Device, check_device

    class NoCompile(Device):
        name, target = "nocompile", "nocompile"

        def reject(self, node, opts):  # noqa: ANN001, ANN201
            return None

    class NoCapability(Device):
        name, target = "nocap", "nocap"

        def compile(self, region, ctx):  # noqa: ANN001, ANN201
            raise AssertionError("never called")

    with pytest.raises(DeviceError, match="device nocompile: implements no compile"):
        check_device(NoCompile())
    with pytest.raises(DeviceError, match="device nocap: implements neither reject"):
        check_device(NoCapability())
    with pytest.raises(TypeError, match="want fxpass.device.Device"):
        check_device(object())
