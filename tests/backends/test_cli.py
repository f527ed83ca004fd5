"""`fxpass demo` and `fxpass explain` (the README's first command and the explain tool)."""

import json
import textwrap

import pytest

from fxpass.cli import main
from tests.backends.blockers import block


def test_demo_checks_against_eager_and_reports(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FXPASS_CACHE_DIR", str(tmp_path))
    assert main(["demo", "--layers", "1", "--hidden", "128", "--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "-> OK" in out and "speedup" in out
    assert "1 region(s)" in out and "on CPU x1: aten.embedding" in out


def test_explain_json_and_svg(capsys, tmp_path):
    svg = tmp_path / "g.svg"
    assert main(["explain", "qwen3-tiny", "--json", "--svg", str(svg)]) == 0
    info = json.loads(capsys.readouterr().out)
    g = info["graphs"][0]
    assert g["rewrites"]["sdpa_decomposition"] == 2
    assert len(g["regions"]) == 1 and g["offloaded_macs"] == g["macs"] > 0
    assert any("embedding" in why for why in g["cpu"])
    text = svg.read_text()
    assert text.startswith("<svg") and "region 0" in text and text.count("<rect") > 100


def test_explain_user_factory(capsys, tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        textwrap.dedent("""
        import torch
        def make():
            m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 256)).eval()
            return m, {"input": torch.randn(8, 256)}
    """)
    )
    assert main(["explain", f"{f}:make"]) == 0
    out = capsys.readouterr().out
    assert "1 region(s)" in out and "region 0:" in out
    assert main(["explain", f"{f}:make", "--device", "ort"]) == 0  # another device's rules
    out = capsys.readouterr().out  # and capability
    assert out.startswith(f"{f}:make on ort: 1 graph(s)") and "1 region(s)" in out


def test_bad_arguments_are_usage_errors_not_tracebacks(capsys, tmp_path):
    """Found by a probe: each of these printed a traceback (some after the whole run, from
    deep inside transformers or Dynamo)."""
    import pytest

    cases = [
        (["demo", "--tokens", "0"], "--tokens: must be an integer >= 1"),
        (["demo", "--hidden", "7"], "--hidden: must be a multiple of 64"),
        (["demo", "--layers", "-1"], "--layers: must be an integer >= 1"),
        (["explain", "qwen3-tiny", "--march", "nash-x"], "unknown march 'nash-x'"),
        (["explain", "qwen3-tiny", "--quantize", "w4a4"], "unknown quantize config"),
        (["explain", "qwen3-tiny", "--svg", str(tmp_path / "no" / "g.svg")], "does not exist"),
        (["explain", "qwen3-tiny", "--min-compute-macs", "-5"], "must be an integer >= 0"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
        assert message in capsys.readouterr().err, argv
    with pytest.raises(SystemExit, match="no such file"):
        main(["explain", str(tmp_path / "missing.py") + ":f"])


@pytest.mark.parametrize("argv, model", [
    (["demo", "--layers", "1", "--hidden", "64", "--tokens", "4"], "Qwen3ForCausalLM"),
    (["demo", "--export", "--layers", "1", "--hidden", "64", "--tokens", "4"],
     "Qwen3ForCausalLM"),
])
def test_demo_without_transformers_is_one_line_naming_the_extra(capsys, monkeypatch, argv, model):
    """A plain install (no extras) has the backend but not transformers: the demo's model is a
    transformers Qwen3. Was a traceback ending in an ImportError with an editable-install
    command; CI checks the real plain install too (.ci/plain_install.py)."""
    block(monkeypatch, "transformers")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"fxpass demo: {model} is a transformers model, and transformers is not "
                   'installed; install it with pip install "fxpass[demo]"')


@pytest.mark.parametrize("verb", ["explain", "export"])
def test_a_builtin_hf_model_without_transformers_names_the_extra(monkeypatch, tmp_path, verb):
    block(monkeypatch, "transformers")
    argv = [verb, "bert"] + ([str(tmp_path / "pkg")] if verb == "export" else [])
    with pytest.raises(SystemExit, match=r'^bert: BertModel is a transformers model, and '
                       r'transformers is not installed; install it with pip install '
                       r'"fxpass\[demo\]"$'):
        main(argv)


def test_rules_lists_the_installed_devices(capsys):
    assert main(["rules"]) == 0
    out = capsys.readouterr().out
    assert "device bpu (plugin=fxpass:bpu): backend fxpass_bpu, target bpu" in out
    assert "device ort (plugin=fxpass:ort)" in out and "march" not in out.split("device ort")[1]
