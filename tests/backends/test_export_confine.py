"""A package stays inside its directory: a manifest its author re-seals (with the package's own
``sign``, as a hostile author would) may name nothing outside the package, import nothing but
the modules of its call signature's types, and call nothing but torch operators.

Each hostile package below passes the integrity checks (digest, sizes, checksums): what
refuses it is confinement, named in one line."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import onnx
import pytest
import torch

from fxpass.aot import confine
from fxpass.aot.package import MANIFEST, PackageError, _file_digest, sign
from fxpass.backends.bpu import export, load
from fxpass.jit.digest import HASH_NAME
from fxpass.tools import zoo


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """A BERT package: one region (its weights external data in weights.bin) and an output
    type of transformers' (``imports`` names its module)."""
    model, kw = zoo.get("bert")
    path = Path(export(model, (), kw).save(tmp_path_factory.mktemp("pkg") / "bert"))
    return path, kw


@pytest.fixture
def copy(package, tmp_path):
    """A fresh copy of the package, one level down (so ``..`` has somewhere to lead)."""
    return Path(shutil.copytree(package[0], tmp_path / "inside" / "bert"))


def _reseal(path: Path, edit) -> None:
    """Edit the manifest, refresh every file's size and checksum, and sign it again."""
    m = json.loads((path / MANIFEST).read_text())
    edit(m)
    for rel, entry in m["files"].items():
        f = path / rel
        if f.is_file() and ".." not in rel and not rel.startswith("/"):
            entry.update({"bytes": f.stat().st_size, HASH_NAME: _file_digest(f)})
    (path / MANIFEST).write_text(json.dumps(sign(m)))


def _region(m: dict) -> dict:
    return m["programs"]["main"]["regions"][0]


def test_the_untouched_copy_loads(copy, package):
    load(copy)(**package[1])


def test_a_file_name_with_dotdot_is_refused(copy):
    outside = copy.parent / "x.onnx"
    shutil.copy(copy / _region(json.loads((copy / MANIFEST).read_text()))["model"], outside)

    def edit(m):
        name = _region(m)["model"]
        m["files"]["../x.onnx"] = m["files"][name]
        _region(m)["model"] = "../x.onnx"

    _reseal(copy, edit)
    with pytest.raises(PackageError, match=r"names '\.\./x\.onnx', which leads out of the "
                                           r"package directory: refusing it"):
        load(copy)


def test_an_absolute_file_name_is_refused(copy):
    outside = copy.parent / "graph.json"
    shutil.copy(copy / "main.graph.json", outside)

    def edit(m):
        m["files"][str(outside)] = m["files"]["main.graph.json"]
        m["programs"]["main"]["graph"] = str(outside)

    _reseal(copy, edit)
    with pytest.raises(PackageError, match=rf"names '{outside}', an absolute path outside the "
                                           "package"):
        load(copy)


def test_a_listed_file_outside_is_refused_before_it_is_read(copy):
    """The file list itself: checksumming /dev/zero would never end."""
    _reseal(copy, lambda m: m["files"].update({"/dev/zero": {"bytes": 0, HASH_NAME: ""}}))
    with pytest.raises(PackageError, match="file list names '/dev/zero', an absolute path"):
        load(copy)


def test_a_symlink_leading_out_is_refused(copy):
    outside = copy.parent / "weights.bin"
    shutil.move(copy / "weights.bin", outside)
    (copy / "weights.bin").symlink_to(outside)  # same bytes: the checksum alone passes it
    with pytest.raises(PackageError, match=r"names 'weights.bin', a symlink to .*, outside the "
                                           "package"):
        load(copy)


def test_a_manifest_linked_from_outside_is_refused(copy):
    outside = copy.parent / MANIFEST
    shutil.move(copy / MANIFEST, outside)
    (copy / MANIFEST).symlink_to(outside)
    with pytest.raises(PackageError, match=r"the manifest names 'manifest.json', a symlink to "):
        load(copy)


def test_a_region_model_whose_external_data_points_outside_is_refused(copy):
    shutil.copy(copy / "weights.bin", copy.parent / "stolen.bin")
    name = _region(json.loads((copy / MANIFEST).read_text()))["model"]
    model = onnx.load(copy / name, load_external_data=False)
    moved = 0
    for t in model.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = "../stolen.bin"
                moved += 1
    assert moved
    onnx.save(model, copy / name)
    _reseal(copy, lambda m: None)
    with pytest.raises(PackageError, match=rf"region model {name}, tensor '.*'s external data "
                                           r"names '\.\./stolen\.bin', which leads out"):
        load(copy)


def test_external_data_in_an_unlisted_file_is_refused(copy):
    name = _region(json.loads((copy / MANIFEST).read_text()))["model"]
    shutil.copy(copy / "weights.bin", copy / "extra.bin")  # inside, but never checksummed
    model = onnx.load(copy / name, load_external_data=False)
    for t in model.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = "extra.bin"
    onnx.save(model, copy / name)
    _reseal(copy, lambda m: None)
    with pytest.raises(PackageError, match="names 'extra.bin', which the manifest's file list "
                                           "does not checksum"):
        load(copy)


@pytest.mark.parametrize("module", ["os", "this"])
def test_an_unrelated_import_is_refused_before_it_runs(copy, module):
    """``this`` prints the Zen of Python when imported: a side effect the refusal must
    prevent, not follow."""
    had = module in sys.modules
    _reseal(copy, lambda m: m["imports"].append(module))
    with pytest.raises(PackageError, match=rf"'imports' names '{module}', which defines none of "
                                           r"the container types .*BaseModelOutput"):
        load(copy)
    assert (module in sys.modules) == had


def test_a_graph_calling_python_outside_torch_is_refused(copy):
    g = json.loads((copy / "main.graph.json").read_text())
    node = next(n for n in g["nodes"] if n[0] == "call_function")
    node[2] = "py:os:system"
    (copy / "main.graph.json").write_text(json.dumps(g))
    _reseal(copy, lambda m: None)
    with pytest.raises(PackageError, match=r"calls 'py:os:system', which is neither a "
                                           "registered torch operator nor a pure function"):
        load(copy)


# ---- the wire-format reader against onnx's own -----------------------------------------------


def test_onnx_field_numbers_are_onnx_protos():
    d = {m: getattr(onnx, m).DESCRIPTOR.fields_by_name for m in (
        "ModelProto", "GraphProto", "NodeProto", "AttributeProto", "FunctionProto",
        "SparseTensorProto", "TensorProto", "TrainingInfoProto")}
    assert {d["ModelProto"][f].number for f in ("graph", "functions", "training_info")} == set(
        confine._MODEL)
    assert {d["GraphProto"][f].number for f in ("node", "initializer", "sparse_initializer")} == (
        set(confine._GRAPH))
    assert {d["AttributeProto"][f].number for f in ("t", "g", "tensors", "graphs",
                                                    "sparse_tensor", "sparse_tensors")} == set(
        confine._ATTRIBUTE)
    assert {d["FunctionProto"][f].number for f in ("node", "attribute_proto")} == set(
        confine._FUNCTION)
    assert d["NodeProto"]["attribute"].number in confine._NODE
    assert {d["SparseTensorProto"][f].number for f in ("values", "indices")} == set(
        confine._SPARSE)
    assert set(confine._TRAINING) == {d["TrainingInfoProto"][f].number
                                      for f in ("initialization", "algorithm")}
    assert (d["TensorProto"]["name"].number, d["TensorProto"]["external_data"].number) == (
        confine._TENSOR_NAME, confine._TENSOR_EXTERNAL)


def _external(name: str, location: str) -> onnx.TensorProto:
    t = onnx.helper.make_tensor(name, onnx.TensorProto.FLOAT, [2], b"\0" * 8, raw=True)
    onnx.external_data_helper.set_external_data(t, location, offset=0, length=8)
    t.ClearField("raw_data")
    t.data_location = onnx.TensorProto.EXTERNAL
    return t


def test_external_locations_find_every_tensor_onnx_would_read():
    """Initializers, a Constant node's tensor, a subgraph's initializer and a function's
    Constant: each external location found, with the tensor's name."""
    h = onnx.helper
    x = h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    y = h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])
    sub = h.make_graph([h.make_node("Add", ["x", "s"], ["z"])], "sub", [],
                       [h.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [2])],
                       initializer=[_external("s", "sub.bin")])
    nodes = [
        h.make_node("Constant", [], ["c"], value=_external("c", "../const.bin")),
        h.make_node("If", ["cond"], ["y"], then_branch=sub, else_branch=sub),
    ]
    fn = onnx.FunctionProto(name="f", domain="d", input=[], output=["k"])
    fn.node.append(h.make_node("Constant", [], ["k"], value=_external("k", "/abs.bin")))
    graph = h.make_graph(nodes, "g", [x], [y], initializer=[_external("w", "weights.bin")])
    model = h.make_model(graph)
    model.functions.append(fn)
    got = sorted(confine.external_locations(model.SerializeToString()))
    assert got == sorted([("w", "weights.bin"), ("c", "../const.bin"), ("s", "sub.bin"),
                          ("s", "sub.bin"), ("k", "/abs.bin")])
    ref = sorted((t.name, next(e.value for e in t.external_data if e.key == "location"))
                 for t in onnx.external_data_helper._get_all_tensors(model)
                 if onnx.external_data_helper.uses_external_data(t))
    assert set(ref) <= set(got)


def test_member_accepts_names_inside(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "a" / "f")  # a link inside: fine
    assert confine.member(tmp_path, "a/f", "x") == tmp_path / "a" / "f"
    assert confine.member(tmp_path, "link", "x") == tmp_path / "link"
    with pytest.raises(PackageError, match="not a file name"):
        confine.member(tmp_path, None, "x")
    with pytest.raises(PackageError, match="not checksum"):
        confine.member(tmp_path, "a/f", "x", listed={})


def test_check_graph_takes_the_graphs_a_package_holds(package):
    path, _ = package
    confine.check_graph(json.loads((path / "main.graph.json").read_text()), "main")
    bad = {"nodes": [["call_function", "n", "op:load_library.x.y", {"t": []}, {"d": []}]]}
    with pytest.raises(PackageError, match="neither a registered torch operator"):
        confine.check_graph(bad, "g")
    bad = {"nodes": [["call_function", "n", "op:aten.add.Tensor", {"t": [{"dtype": "load"}]},
                      {"d": []}]]}
    with pytest.raises(PackageError, match=r"names torch.load as a dtype"):
        confine.check_graph(bad, "g")
    with pytest.raises(PackageError, match="is not a node a package holds"):
        confine.check_graph({"nodes": [["call_module", "m", "x", [], {}]]}, "g")
    assert torch.ops.aten.add.Tensor  # the registry lookup above imported nothing new


def test_an_import_that_registers_no_type_of_the_signature_is_refused(copy):
    """A spec naming ``os.Thing`` makes ``os`` the module of a named type; importing it
    registers nothing, and the load stops there."""

    def edit(m):
        spec = m["programs"]["main"]["out_spec"]
        m["programs"]["main"]["out_spec"] = spec.replace(
            "transformers.modeling_outputs.BaseModelOutputWithPoolingAndCrossAttentions",
            "os.Thing")
        m["imports"] = ["os"]

    _reseal(copy, edit)
    with pytest.raises(PackageError, match=r"of types \['os.Thing'\], which no module the "
                                           "manifest imports registers"):
        load(copy)
