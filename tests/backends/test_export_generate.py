"""export_for_generate -> save -> load(path).generate(): HF's static-cache export module through
the BPU pipeline, a prefill and a decode program over one cache, a lean loop of our own.

Greedy tokens are compared with eager HF ``generate(cache_implementation="static")`` exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fxpass.backends.bpu import export_for_generate, load
from fxpass.tools import zoo
from tests.backends.test_export import _fresh_process

CACHE, CHUNK = 48, 8


@pytest.fixture(scope="module",
                params=["qwen3", pytest.param("llama", marks=pytest.mark.slow)])
def decoder(request, tmp_path_factory):
    model, _ = zoo.get(request.param)
    # min_compute_macs=0: the tiny decode step (0.1 MMACs) still gets its region
    program = export_for_generate(model, max_cache_len=CACHE, prefill_length=CHUNK,
                                  options={"min_compute_macs": 0})
    path = program.save(tmp_path_factory.mktemp("gen") / request.param)
    return model, program, path, load(path)


def _prompt(n, seed=0, batch=1):
    return torch.randint(3, 500, (batch, n), generator=torch.Generator().manual_seed(seed))


def _hf(model, ids, n, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=kw.pop("min_new", 0),
                              do_sample=False, cache_implementation="static", **kw)


def test_one_region_per_program(decoder):
    _, program, _, runner = decoder
    assert [len(p.report.regions) for p in (program.prefill, program.decode)] == [1, 1]
    assert set(runner.package.programs) == {"prefill", "decode"}


def test_decode_steps_take_the_fast_path(decoder):
    """Position-only ops memoized, the cache writes fused, the tokens still HF's (above)."""
    _, _, _, runner = decoder
    dec = runner.package.programs["decode"]
    assert dec.memos
    assert not dec.gm.graph.find_nodes(op="call_function",
                                       target=torch.ops.aten.index_copy_.default)
    dec.memos[0].table.clear()
    runner.generate(_prompt(5), max_new_tokens=6)
    assert len(dec.memos[0].table) == 5  # one entry per decode position, 5..9


@pytest.mark.parametrize("length", [5, 8, 19])
@pytest.mark.parametrize("tail", ["pad", "decode"])
def test_greedy_tokens_equal_hf_static_cache(decoder, length, tail):
    """Shorter than a chunk, exactly one, and two chunks plus a tail."""
    model, _, _, runner = decoder
    ids = _prompt(length, seed=length)
    assert torch.equal(runner.generate(ids, max_new_tokens=12, tail=tail), _hf(model, ids, 12))


def test_a_second_generate_does_not_see_the_first(decoder):
    model, _, _, runner = decoder
    a, b = _prompt(19, seed=1), _prompt(6, seed=2)
    runner.generate(a, max_new_tokens=20)
    assert torch.equal(runner.generate(b, max_new_tokens=10), _hf(model, b, 10))


def test_eos_stops_like_hf(decoder):
    model, _, _, runner = decoder
    ids = _prompt(9, seed=3)
    free = runner.generate(ids, max_new_tokens=10)
    eos = int(free[0, 9 + 4])  # the fifth generated token
    got = runner.generate(ids, max_new_tokens=10, eos_token_id=eos)
    ref = _hf(model, ids, 10, min_new=0, eos_token_id=eos)
    assert torch.equal(got, ref) and got.shape[1] < free.shape[1]


def test_sampling_is_reproducible_with_a_seed(decoder):
    _, _, _, runner = decoder
    ids = _prompt(7, seed=4)
    kw = dict(max_new_tokens=10, do_sample=True, temperature=0.8, top_k=50, top_p=0.9)
    a = runner.generate(ids, seed=11, **kw)
    assert torch.equal(a, runner.generate(ids, seed=11, **kw))
    assert not torch.equal(a, runner.generate(ids, seed=12, **kw))
    greedy = runner.generate(ids, max_new_tokens=10)
    assert torch.equal(runner.generate(ids, max_new_tokens=10, do_sample=True, top_k=1, seed=5),
                       greedy)  # top-k 1 is greedy: the sampling path keeps the right logits


def test_streamer_sees_the_prompt_then_each_token(decoder):
    _, _, _, runner = decoder

    class Recorder:
        def __init__(self):
            self.seen, self.ended = [], False

        def put(self, t):
            self.seen.append(t.clone())

        def end(self):
            self.ended = True

    rec, ids = Recorder(), _prompt(5, seed=6)
    out = runner.generate(ids, max_new_tokens=4, streamer=rec)
    assert rec.ended and torch.equal(rec.seen[0], ids) and len(rec.seen) == 5
    assert torch.equal(torch.cat(rec.seen, 1), out)


def test_clear_errors(decoder):
    _, _, _, runner = decoder
    with pytest.raises(ValueError, match=r"prompt \(40 tokens\) plus max_new_tokens \(9\) is 49, "
                                         r"past the cache of 48"):
        runner.generate(_prompt(40), max_new_tokens=9)
    with pytest.raises(ValueError, match="exported for batch size 1, got 2.*batch_size=2"):
        runner.generate(_prompt(5, batch=2), max_new_tokens=2)
    with pytest.raises(ValueError, match="empty prompt"):
        runner.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match="2-D integer tensor"):
        runner.generate(torch.zeros(5, dtype=torch.long), max_new_tokens=2)


def test_export_for_generate_refuses_bad_sizes():
    model, _ = zoo.get("qwen3")
    with pytest.raises(RuntimeError, match="prefill_length 64 is longer than the cache"):
        export_for_generate(model, max_cache_len=32, prefill_length=64)
    with pytest.raises(RuntimeError, match="max_cache_len must be an int >= 2"):
        export_for_generate(model, max_cache_len=0, prefill_length=1)


def _family(name: str, **kw):
    """A one-layer model of a family from its own config class (sizes only)."""
    import transformers

    cfg = getattr(transformers, f"{name}Config")(
        vocab_size=512, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=128, **kw)
    torch.manual_seed(0)
    return getattr(transformers, f"{name}ForCausalLM")(cfg).eval()


def test_a_model_that_reads_its_positions_from_the_cache_exports_with_explicit_ones(
        tmp_path, capsys):
    """OPT slices its positions at the cache's length read into Python, which torch.export
    refuses; exported again with ``position_ids`` (the cache position), its package gives HF's
    tokens at every prompt length, past the traced positions. The graph torch prints for the
    refused trace is not shown: the retry answered it."""
    model = _family("OPT", ffn_dim=128, word_embed_proj_dim=64)
    said = []
    program = export_for_generate(model, max_cache_len=32, prefill_length=8, device="ort",
                                  options={"min_compute_macs": 0}, progress=said.append)
    assert any("position_ids = cache_position" in m for m in said), said
    assert "def forward(" not in capsys.readouterr().err
    # the check at the cache's last positions (random rows) leaves the caches as they were
    caches = [t for t in program.prefill.state.values() if t.is_floating_point()]
    assert caches and not any(t.any() for t in caches)
    runner = load(program.save(tmp_path / "opt"))
    for n, seed in ((5, 0), (13, 1)):
        ids = _prompt(n, seed)
        assert torch.equal(runner.generate(ids, max_new_tokens=10),
                           _hf(model, ids, 10, cache_config={"max_cache_len": 32}))


def test_a_program_torch_export_fixed_at_the_traced_position_is_refused():
    """BioGpt also sizes its mask by the length it reads, and torch.export fixes that size at
    position 0 silently (its decode attended slot 0 alone); the program is checked against
    the model at the cache's last positions and refused, naming the model and the fix."""
    from fxpass.aot.runtime import ExportError

    model = _family("BioGpt", intermediate_size=128)
    with pytest.raises(ExportError, match=r"cannot export BioGptForCausalLM: torch\.export's "
                       r"program, traced at positions 0\.\.7, gives other logits than the model "
                       r"at positions 24\.\.31 .*compile_for_generate"):
        export_for_generate(model, max_cache_len=32, prefill_length=8, device="ort")


@pytest.mark.slow
def test_fresh_process_generates_hf_tokens_without_compiling(decoder, tmp_path):
    model, _, path, _ = decoder
    ids = _prompt(19, seed=7)
    got = _fresh_process(path, (ids,), {"max_new_tokens": 16}, tmp_path, generate=True)
    assert torch.equal(got["out"][0], _hf(model, ids, 16))
    assert got["pass_manager_runs"] == 0
    assert not {k: v for k, v in got["stats"].items()
                if k in ("rules", "partition", "region_compiles")}
    assert "frames" not in got["dynamo"] and "stats" not in got["dynamo"], got["dynamo"]


@pytest.mark.slow  # the fast tier's 4-minute budget
def test_cli_export_generate_then_generate(tmp_path, capsys):
    from fxpass.cli import main

    out = tmp_path / "pkg"
    assert main(["export", "qwen3-tiny", str(out), "--generate", "--max-cache-len", "32",
                 "--prefill-length", "8", "--min-compute-macs", "0"]) == 0
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt-ids", "5,6,7", "--max-new-tokens", "4"]) == 0
    res = capsys.readouterr()
    toks = [int(t) for t in res.out.strip().splitlines()[-1].split(",")]
    model, _ = zoo.get("qwen3-tiny")
    assert toks == _hf(model, torch.tensor([[5, 6, 7]]), 4)[0, 3:].tolist()
    assert "decode" in res.err and "ms/token" in res.err
    assert main(["generate", str(out), "--prompt-ids", "5,6", "--max-new-tokens", "40"]) == 2
    assert "past the cache of 32" in capsys.readouterr().err


def test_threads_sharing_one_runner_each_get_their_own_tokens(decoder):
    """4 threads x 3 generations on one loaded runner, started together: each result equals
    the same call made alone (each call runs on a KV cache of its own)."""
    import threading

    _, _, _, runner = decoder
    jobs = {(t, g): (_prompt(3 + 4 * t + g, seed=10 * t + g), 14 + g)
            for t in range(4) for g in range(3)}
    alone = {k: runner.generate(ids, max_new_tokens=n) for k, (ids, n) in jobs.items()}
    got, errors = {}, []
    start = threading.Barrier(4)

    def work(t):
        try:
            start.wait()
            for g in range(3):
                ids, n = jobs[t, g]
                got[t, g] = runner.generate(ids, max_new_tokens=n)
        except Exception as e:  # noqa: BLE001 - reported below, with the thread
            errors.append((t, e))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    wrong = [k for k in jobs if not torch.equal(got[k], alone[k])]
    assert not wrong, f"threads x generations with other tokens than alone: {wrong}"
    assert runner.slots >= 2  # the calls did overlap, each on a cache of its own


def test_a_runner_is_not_called_like_a_function(decoder):
    _, _, _, runner = decoder
    with pytest.raises(TypeError, match=r"is a generation package: call runner\.generate\("):
        runner(_prompt(4))


def test_a_token_id_past_the_vocabulary_names_its_size(decoder):
    model, _, _, runner = decoder
    vocab = model.config.vocab_size
    assert runner.vocab_size == vocab
    ids = _prompt(5)
    ids[0, 2] = vocab
    with pytest.raises(ValueError, match=rf"token id {vocab}, outside the model's vocabulary of "
                                         rf"{vocab} \(ids 0 to {vocab - 1}\)"):
        runner.generate(ids, max_new_tokens=2)
    ids[0, 2] = -1
    with pytest.raises(ValueError, match=r"token id -1, outside the model's vocabulary"):
        runner.generate(ids, max_new_tokens=2)


def test_a_decoder_too_small_for_regions_stores_each_weight_once(tmp_path):
    """Default options: the 8-token prefill gets a region, the one-token decode step is below
    min_compute_macs and stays on the CPU. The region reads the weights as ONNX initializers,
    the decode program as torch tensors: one copy in weights.bin all the same."""
    import warnings

    model, _ = zoo.get("qwen3", vocab=4096, hidden=32, heads=2, kv_heads=1, layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the decode program's NoRegionWarning
        program = export_for_generate(model, max_cache_len=16, prefill_length=8)
    assert [len(p.report.regions) for p in (program.prefill, program.decode)] == [1, 0]
    path = Path(program.save(tmp_path / "pkg"))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    stored = (path / "weights.bin").stat().st_size
    assert stored <= 1.1 * weights, (stored, weights)  # page alignment: a few % at most
    total = sum(f.stat().st_size for f in path.iterdir())
    assert total <= 1.5 * weights, (total, weights)


def test_a_bf16_decoder_generates_greedily_from_its_package(tmp_path):
    """A bf16 checkpoint's package returns bf16 logits (the dtype eager gives), which numpy,
    where the greedy loop takes its argmax, cannot hold: the loop reads them as float32
    (exact). Greedy tokens equal eager's bf16 static-cache ones on this seeded model (the
    ort region computes in float32, so equality is checked, not promised, token by token)."""
    model, _ = zoo.get("qwen3")
    model = model.to(torch.bfloat16)
    program = export_for_generate(model, max_cache_len=CACHE, prefill_length=CHUNK,
                                  device="ort")
    runner = load(program.save(tmp_path / "bf16"))
    ids = _prompt(6)
    got = runner.generate(ids, max_new_tokens=4, eos_token_id=[])
    want = _hf(model, ids, 4, min_new=4)
    assert torch.equal(got, want), (got, want)


def _device_class(path):
    """The class of the device that opens the package at ``path`` (to patch its ``open``)."""
    import fxpass.aot.package as pkg

    return type(pkg._read(Path(path))[1])


def test_load_reads_the_programs_while_the_regions_open(decoder, monkeypatch):
    """The regions' executors open on threads while the loader reads the programs (opening
    an onnxruntime session is most of a load): each open here waits until both programs are
    read, which the old order (open everything, then read) never reached. Streamlining
    generates each program's code once: two code generations per program graph (the old
    code generated it again after each streamlining step)."""
    import threading

    import fxpass.aot.package as pkg

    model, _, path, _ = decoder
    read, waited = threading.Event(), []
    real_init = pkg.LoadedProgram.__init__
    programs: list[str] = []

    def init(self, root, name, *a):
        real_init(self, root, name, *a)
        programs.append(name)
        if len(programs) == 2:
            read.set()

    device_cls = _device_class(path)
    real_open = device_cls.open

    def slow_open(self, entry, files):
        waited.append(read.wait(30))
        return real_open(self, entry, files)

    generated = []
    real_recompile = torch.fx.GraphModule.recompile

    def recompile(self):
        generated.append(self)
        return real_recompile(self)

    monkeypatch.setattr(pkg.LoadedProgram, "__init__", init)
    monkeypatch.setattr(device_cls, "open", slow_open)
    monkeypatch.setattr(torch.fx.GraphModule, "recompile", recompile)
    runner = load(path)
    assert waited == [True, True] and sorted(programs) == ["decode", "prefill"]
    for program in runner.package.programs.values():  # decoded, then streamlined
        assert sum(g is program.gm for g in generated) == 2
    ids = _prompt(5)
    assert torch.equal(runner.generate(ids, max_new_tokens=6), _hf(model, ids, 6, min_new=6))


def test_a_dropped_package_or_program_closes_its_regions(tmp_path):
    """A loaded package and an exported program hold their regions' executors (onnxruntime
    sessions and their packed weights) as long as they live, and no longer: the registry of
    open regions kept every one for the life of the process, so loading new versions of a
    package, or exporting in a loop, grew by a model each time. Another load of the same
    package (the same region keys) stays open and generates."""
    import gc
    import weakref

    from fxpass.aot import runtime

    model, _ = zoo.get("qwen3")
    program = export_for_generate(model, max_cache_len=CACHE, prefill_length=CHUNK,
                                  options={"min_compute_macs": 0})
    path = program.save(tmp_path / "p")
    keys = [r.key for low in (program.prefill, program.decode) for r in low.regions]
    exported = [weakref.ref(runtime._LIVE[k][-1]) for k in keys]

    def count() -> list[int]:  # open regions of these keys beyond what others opened before
        return [len(runtime._LIVE.get(k, [])) - before[k] for k in keys]

    before = {k: len(runtime._LIVE[k]) - 1 for k in keys}  # (another test's same model)
    first, second = load(path), load(path)
    opened = [weakref.ref(r.executor) for r in first.package.regions]
    assert count() == [3] * len(keys)
    ids = _prompt(5)
    want = _hf(model, ids, 4, min_new=4)
    del first, program
    gc.collect()
    assert [e() for e in opened + exported] == [None] * (len(opened) + len(exported))
    assert count() == [1] * len(keys)
    assert torch.equal(second.generate(ids, max_new_tokens=4), want)
    del second
    gc.collect()
    assert count() == [0] * len(keys)
    assert all(k not in runtime._LIVE for k in keys if not before[k])


def test_a_load_that_fails_reading_its_programs_names_that_error(decoder, monkeypatch):
    """The programs are read while the regions open: when reading fails, that error is the
    one raised (as when it was read first), not a region's that failed to open meanwhile,
    and every open has ended by then."""
    import fxpass.aot.package as pkg

    _, _, path, _ = decoder
    device_cls = _device_class(path)
    ended = []

    def failing_open(self, entry, files):
        ended.append(entry["model"])
        raise RuntimeError("the board is unplugged")

    def unreadable(self, *a):
        raise pkg.PackageError("program graph unreadable")

    monkeypatch.setattr(device_cls, "open", failing_open)
    monkeypatch.setattr(pkg.LoadedProgram, "__init__", unreadable)
    with pytest.raises(pkg.PackageError, match="program graph unreadable"):
        load(path)
    assert len(ended) == 2
    monkeypatch.undo()
    monkeypatch.setattr(device_cls, "open", failing_open)
    with pytest.raises(pkg.PackageError, match="cannot open it: the board is unplugged"):
        load(path)


@pytest.mark.parametrize("length", [5, 8, 19, 44, 48])
def test_score_is_the_float_models_logits_at_every_position(decoder, length):
    """``Runner.score``: every position's logits through the package's own programs (whole
    chunks, a padded tail) equal the float model's forward over the same ids (float32:
    rtol 1e-3, atol 1e-4), on a cache of its own (a generate() after it is unchanged)."""
    from fxpass.aot.quality import agreement

    model, _, _, runner = decoder
    ids = _prompt(length, seed=length)
    with torch.no_grad():
        want = model(ids).logits
    got = runner.score(ids)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
    q = agreement(got, want, ids)
    assert q["top1"] == 1.0 and q["cosine"] > 0.99999
    assert abs(q["perplexity"] / q["reference_perplexity"] - 1) < 1e-3
    short = _prompt(5)
    assert torch.equal(runner.generate(short, max_new_tokens=4), _hf(model, short, 4, min_new=4))


def test_score_runs_a_tail_past_the_last_chunk_token_by_token(tmp_path):
    """Where a padded chunk would pass the cache (20 slots, chunks of 8: a 19-token text
    leaves 3 tokens at 16), the tail runs through the decode program, as ``generate`` does."""
    model, _ = zoo.get("qwen3")
    program = export_for_generate(model, max_cache_len=20, prefill_length=8,
                                  options={"min_compute_macs": 0})
    runner = load(program.save(tmp_path / "p"))
    ids = _prompt(19, seed=3)
    with torch.no_grad():
        want = model(ids).logits
    memo = runner.package.programs["decode"].memos[0].table
    memo.clear()
    torch.testing.assert_close(runner.score(ids), want, rtol=1e-3, atol=1e-4)
    assert len(memo) == 3  # one decode step per tail position, 16..18
    with pytest.raises(ValueError, match="past the cache of 20"):
        runner.score(_prompt(21))


def test_agreement_measures():
    """Hand-checked: the top logit agrees at 2 of 3 positions; a vector against itself has
    cosine 1 and against its negation -1; uniform logits over 4 words have perplexity 4."""
    from fxpass.aot.quality import agreement

    ref = torch.tensor([[[3.0, 1, 0, 0], [0, 2, 1, 0], [1, 0, 0, 5]]])
    got = torch.tensor([[[3.0, 1, 0, 0], [0, 2, 1, 0], [-1, 0, 0, -5]]])
    q = agreement(got, ref)
    assert q["top1"] == pytest.approx(2 / 3)
    assert q["cosine"] == pytest.approx((1 + 1 - 1) / 3)
    flat = torch.zeros(1, 3, 4)
    q = agreement(flat, flat, torch.tensor([[0, 1, 2]]))
    assert q["perplexity"] == pytest.approx(4.0) and q["reference_perplexity"] == pytest.approx(4.0)
    with pytest.raises(ValueError, match="differ in shape.*Runner.score"):
        agreement(flat, torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match="input_ids have 2 tokens, the logits 3"):
        agreement(flat, flat, torch.tensor([[0, 1]]))
