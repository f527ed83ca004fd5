"""``fxpass export`` / ``run`` / ``generate`` from a shell: the numbers they report and the
one-line errors (cause and fix, exit status 2, no traceback) for a user's mistakes.

In process (``fxpass.cli.main``) on two tiny packages made once per module through the
``file.py:factory`` form, which returns ``(model, args)`` or ``(model, kwargs)``, with
``--generate`` too (issue 45, item 9)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from fxpass.backends.bpu import load
from fxpass.cli import main

#: a generation package's cache and prefill chunk: small, so a 70-token prompt overflows it
CACHE, CHUNK = 32, 8

FACTORY = '''
import torch


def mlp():
    """(model, args): the plain form."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 16)).eval()
    return model, (torch.randn(4, 64),)


def lm():
    """(model, kwargs), with --generate too: the inputs are unused there, the contract holds."""
    from fxpass.tools import zoo

    return zoo.get("qwen3", layers=1, hidden=64, vocab=128)
'''


@pytest.fixture(scope="module")
def factory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("factory") / "models.py"
    path.write_text(textwrap.dedent(FACTORY))
    return path


@pytest.fixture(scope="module")
def mlp_package(factory: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mlp") / "pkg"
    assert main(["export", f"{factory}:mlp", str(out), "--min-compute-macs", "0"]) == 0
    return out


@pytest.fixture(scope="module")
def lm_package(factory: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lm") / "pkg"
    assert main(["export", f"{factory}:lm", str(out), "--generate", "--max-cache-len",
                 str(CACHE), "--prefill-length", str(CHUNK), "--min-compute-macs", "0"]) == 0
    return out


def _one_line_error(capsys: pytest.CaptureFixture[str], verb: str) -> str:
    """stderr, asserted to be one ``fxpass VERB: ...`` line."""
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fxpass {verb}: ") and "\n" not in err, err
    assert "Traceback" not in err
    return err


def test_generate_names_the_requested_max_new_tokens(lm_package, capsys):
    """Found as a new user: 70 ids with --max-new-tokens 4 reported "plus max_new_tokens (1)",
    the CLI's one-token warm-up, not the user's request."""
    ids = ",".join(["5"] * 70)
    assert main(["generate", str(lm_package), "--prompt-ids", ids, "--max-new-tokens", "4"]) == 2
    err = _one_line_error(capsys, "generate")
    assert "the prompt (70 tokens) plus max_new_tokens (4) is 74" in err
    assert f"past the cache of {CACHE}" in err and "max_cache_len" in err


def test_generate_prints_the_tokens_of_the_python_api_and_their_times(lm_package, capsys):
    capsys.readouterr()
    assert main(["generate", str(lm_package), "--prompt-ids", "5,6,7",
                 "--max-new-tokens", "4"]) == 0
    res = capsys.readouterr()
    toks = [int(t) for t in res.out.strip().splitlines()[-1].split(",")]
    assert toks == load(lm_package).generate(torch.tensor([[5, 6, 7]]), 4)[0, 3:].tolist()
    assert "(prefill of 3 tokens), 4 tokens, decode" in res.err and "ms/token" in res.err


def test_run_inputs_of_another_shape_is_one_line(mlp_package, tmp_path, capsys):
    """Was a full traceback (the program's ValueError) while every other error is one line."""
    f = tmp_path / "in.pt"
    torch.save(((torch.randn(3, 64),), {}), f)
    capsys.readouterr()
    assert main(["run", str(mlp_package), "--inputs", str(f)]) == 2
    err = _one_line_error(capsys, "run")
    assert "torch.float32[3, 64]" in err and "exported for torch.float32[4, 64]" in err
    assert "export again" in err  # the fix


@pytest.mark.parametrize("content, cause, fix", [
    (None, "no such file", "leave --inputs out"),
    (b"not a torch file", "not a torch.save file", "torch.save((args, kwargs), path)"),
    ([torch.randn(4, 64)], "holds list, not (args, kwargs)", "torch.save((args, kwargs), path)"),
    ((torch.randn(4, 64), {}), "holds tuple, not (args, kwargs)", "torch.save(((x,), {}), path)"),
])
def test_run_inputs_file_errors_are_one_line(mlp_package, tmp_path, capsys, content, cause, fix):
    f = tmp_path / "in.pt"
    if isinstance(content, bytes):
        f.write_bytes(content)
    elif content is not None:
        torch.save(content, f)
    capsys.readouterr()
    assert main(["run", str(mlp_package), "--inputs", str(f)]) == 2
    err = _one_line_error(capsys, "run")
    assert cause in err and fix in err


def test_run_inputs_of_the_exported_shape(mlp_package, tmp_path, capsys):
    f = tmp_path / "in.pt"
    torch.save(((torch.randn(4, 64),), {}), f)
    capsys.readouterr()
    assert main(["run", str(mlp_package), "--inputs", str(f), "--repeat", "1"]) == 0
    assert "output 0: torch.float32[4, 16]" in capsys.readouterr().out


def test_export_prints_stages_and_warns_of_no_region_in_one_line(factory, tmp_path, capsys):
    """The default min_compute_macs leaves this small MLP without a region: the package would
    run all in torch. The shell user gets a one-line warning naming the flag."""
    assert main(["export", f"{factory}:mlp", str(tmp_path / "pkg")]) == 0
    res = capsys.readouterr()
    assert "0 region(s)" in res.out
    warning = [ln for ln in res.err.splitlines() if "warning" in ln]
    assert len(warning) == 1, res.err
    assert warning[0].startswith("fxpass export: warning: export: the program has no region")
    assert "min_compute_macs=500,000 (the default" in warning[0]
    assert "--min-compute-macs 0" in warning[0]
    for stage in ("building", "torch.export (non-strict)", "region compile", "writing", "done"):
        assert stage in res.err, stage


def test_export_with_a_region_does_not_warn(mlp_package, factory, tmp_path, capsys):
    capsys.readouterr()
    assert main(["export", f"{factory}:mlp", str(tmp_path / "pkg"),
                 "--min-compute-macs", "0"]) == 0
    res = capsys.readouterr()
    assert "1 region(s)" in res.out and "warning" not in res.err


def test_export_and_run_take_the_device(mlp_package, factory, tmp_path, capsys):
    """--device: the ort device exports and runs its own package; a package made for another
    device, or a BPU flag on another device, is one line naming both and the fix."""
    out = tmp_path / "ort"
    assert main(["export", f"{factory}:mlp", str(out), "--device", "ort",
                 "--min-compute-macs", "0"]) == 0
    assert "fxpass_ort graph" in capsys.readouterr().out
    assert main(["run", str(out), "--device", "ort", "--repeat", "1"]) == 0
    assert "output 0: torch.float32[4, 16]" in capsys.readouterr().out
    assert main(["run", str(mlp_package), "--device", "ort"]) == 2
    err = _one_line_error(capsys, "run")
    assert "exported for device 'bpu', not 'ort'" in err and "--device bpu" in err
    assert main(["export", f"{factory}:mlp", str(tmp_path / "x"), "--device", "ort",
                 "--march", "nash-p"]) == 2
    assert "device 'ort' has no march" in _one_line_error(capsys, "export")


def test_score_prints_agreement_against_another_package(lm_package, tmp_path, capsys):
    """``fxpass score PKG --against REF``: one stdout line of the measures of
    ``fxpass.aot.quality.agreement`` over the package's own logits (``Runner.score``); a
    package against itself agrees everywhere. Ids from a file (commas or spaces) too."""
    from fxpass.aot.quality import agreement

    ids = [5, 9, 17, 3, 44, 61, 2, 8, 8, 100, 7, 12]
    assert main(["score", str(lm_package), "--against", str(lm_package), "--prompt-ids",
                 ",".join(map(str, ids))]) == 0
    q = agreement(*[load(lm_package).score(torch.tensor([ids]))] * 2, torch.tensor([ids]))
    out = capsys.readouterr().out.strip()
    assert out == (f"top-1 1.000, cosine 1.0000, perplexity {q['perplexity']:.2f} against "
                   f"{q['perplexity']:.2f}, over 12 positions"), out
    f = tmp_path / "ids.txt"
    f.write_text(" ".join(map(str, ids[:7])) + "\n")
    assert main(["score", str(lm_package), "--ids-file", str(f)]) == 0
    assert capsys.readouterr().out.strip().endswith("over 7 positions")


@pytest.mark.parametrize(("argv", "says"), [
    (["--prompt-ids", "5"], "at least 2 token ids"),
    (["--prompt-ids", "5,x"], "integers separated by commas or spaces"),
    (["--prompt-ids", ",".join(["5"] * 40)], f"past the cache of {CACHE}"),
    (["--ids-file", "/nonexistent/ids.txt"], "integers separated by commas or spaces"),
])
def test_score_errors_are_one_line(lm_package, capsys, argv, says):
    assert main(["score", str(lm_package), *argv]) == 2
    assert says in _one_line_error(capsys, "score")


def test_score_refuses_a_package_that_does_not_generate(mlp_package, capsys):
    assert main(["score", str(mlp_package), "--prompt-ids", "1,2"]) == 2
    assert "is not a generation package" in _one_line_error(capsys, "score")


def test_export_takes_device_options_and_score_compares_the_packages(factory, lm_package,
                                                                      tmp_path, capsys):
    """``-o NAME=VALUE`` hands any device option to export (values parsed as Python literals,
    else strings): a w4 package from the shell, scored against the float one."""
    from fxpass.aot.package import read_manifest

    out = tmp_path / "w4"
    assert main(["export", f"{factory}:lm", str(out), "--generate", "--device", "ort",
                 "-o", "quantize=w4", "-o", "block_size=32", "--max-cache-len", str(CACHE),
                 "--prefill-length", str(CHUNK), "--min-compute-macs", "0"]) == 0
    opts = read_manifest(out)["device_options"]
    assert opts["quantize"] == "w4" and opts["block_size"] == 32
    capsys.readouterr()
    assert main(["score", str(out), "--against", str(lm_package), "--prompt-ids",
                 "5,9,17,3,44,61,2,8,8,100,7,12"]) == 0
    line = capsys.readouterr().out
    cosine = float(line.split("cosine ")[1].split(",")[0])
    assert 0.9 < cosine < 1.0, line  # quantized: close to the float package, not equal


@pytest.mark.parametrize(("option", "says"), [
    ("quantize", "--option takes NAME=VALUE"),
    ("nonsense=1", "unknown option(s) ['nonsense']"),
    ("quantize=w5", "or weight-only ['w4', 'w8']"),
])
def test_export_option_errors_are_one_line(factory, tmp_path, capsys, option, says):
    assert main(["export", f"{factory}:mlp", str(tmp_path / "p"), "--device", "ort",
                 "-o", option]) == 2
    assert says in _one_line_error(capsys, "export")
