"""compile_for_encoder: any length through a few bucket variants, values unchanged by padding.

Tolerances: float32 against eager at rtol = atol = 1e-4."""

from __future__ import annotations

import warnings

import pytest
import torch

from fxpass.backends.bpu import compile_for_encoder
from fxpass.hf.encoders import by_rows, check_buckets, pad_inputs
from fxpass.jit.backend import STATS

TOL = {"rtol": 1e-4, "atol": 1e-4}


def _encoder(name):
    import transformers as tf

    small = dict(vocab_size=300, max_position_embeddings=160)
    torch.manual_seed(0)
    if name == "bert":
        cfg = tf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=128, **small)
        return tf.BertModel(cfg).eval()
    if name == "roberta":
        cfg = tf.RobertaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=128, pad_token_id=1, **small)
        return tf.RobertaForMaskedLM(cfg).eval()
    cfg = tf.DistilBertConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=128, **small)
    return tf.DistilBertModel(cfg).eval()


def _inputs(batch, length, seed, types=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 300, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if batch > 1:
        mask[-1, max(1, length // 2):] = 0  # a row padded by the caller too
    kw = {"input_ids": ids, "attention_mask": mask}
    if types:
        kw["token_type_ids"] = (torch.arange(length) >= length // 2).long().expand(batch, -1)
    return kw


def _tensors(out):
    return [v for v in out.values() if isinstance(v, torch.Tensor)]


@pytest.mark.slow  # the fast tier's 4-minute budget
@pytest.mark.parametrize("name", ["bert", "roberta", "distilbert"])
def test_buckets_keep_eager_values_with_few_variants(name, opts):
    torch._dynamo.reset()
    eager = _encoder(name)
    model = compile_for_encoder(_encoder(name), buckets={"seq": [16, 32, 64], "batch": [2, 4]},
                                options=opts)
    made = STATS["shape_variants"]
    cases = [(1, 5), (2, 16), (3, 20), (2, 31), (4, 9), (1, 64), (2, 3)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no length here is past a bucket: no warning at all
        for i, (b, n) in enumerate(cases):
            kw = _inputs(b, n, seed=i, types=name == "bert")
            ref, got = _tensors(eager(**kw)), _tensors(model(**kw))
            assert [t.shape for t in got] == [t.shape for t in ref]
            for e, a in zip(ref, got, strict=True):
                torch.testing.assert_close(a, e, **TOL)
    # (batch, seq) buckets the cases fall in: (2,16) (2,16) (4,32) (2,32) (4,16) (2,64) (2,16)
    assert STATS["shape_variants"] - made == 5  # one per bucket pair used, never per length


@pytest.mark.slow
def test_a_length_past_the_largest_bucket_warns_once_and_is_exact(opts):
    torch._dynamo.reset()
    eager = _encoder("bert")
    model = compile_for_encoder(_encoder("bert"), buckets={"seq": [8, 16]}, options=opts)
    with torch.no_grad(), pytest.warns(UserWarning, match="past the largest bucket") as w:
        for n in (20, 24):
            kw = _inputs(2, n, seed=n)
            torch.testing.assert_close(model(**kw).last_hidden_state,
                                       eager(**kw).last_hidden_state, **TOL)
    assert len([x for x in w if "past the largest bucket" in str(x.message)]) == 1


@pytest.mark.slow
def test_pooled_output_of_the_bucket_width_is_not_cut(opts):
    """hidden size 64 == a bucket of 64: the (batch, hidden) pooler output stays whole."""
    torch._dynamo.reset()
    eager = _encoder("bert")
    model = compile_for_encoder(_encoder("bert"), buckets={"seq": [64]}, options=opts)
    kw = _inputs(2, 10, seed=3)
    with torch.no_grad():
        got, ref = model(**kw), eager(**kw)
    assert got.pooler_output.shape == (2, 64)
    torch.testing.assert_close(got.pooler_output, ref.pooler_output, **TOL)


@pytest.mark.parametrize("bad,why", [
    ({"tokens": [8, 16]}, "'tokens' is not an input dimension.*use 'seq'"),
    ({"seq": [32, 16]}, r"\[32, 16\] is not increasing.*\[16, 32\]"),
    ({"seq": [8, 8]}, "is not increasing"),
    ({"seq": []}, "non-empty list of positive ints"),
    ({"seq": [0, 4]}, "non-empty list of positive ints"),
    ([8, 16], "must be a dict"),
])
def test_bad_bucket_specs_are_refused(bad, why):
    with pytest.raises(ValueError, match=why):
        check_buckets(bad)


def test_export_for_encoder_packages_one_program_per_bucket_sharing_weights(tmp_path):
    from fxpass.backends.bpu import export_for_encoder, load

    eager = _encoder("bert")
    program = export_for_encoder(_encoder("bert"), buckets={"seq": [16, 32], "batch": [2]})
    path = program.save(str(tmp_path / "pkg"))
    weights = sum(p.numel() * p.element_size() for p in eager.parameters())
    stored = (tmp_path / "pkg" / "weights.bin").stat().st_size
    assert stored <= 1.05 * weights, (stored, weights)  # two programs, one copy of each weight
    runner = load(path)
    assert set(runner.package.programs) == {"b2_s16", "b2_s32"}
    with torch.no_grad():
        for b, n in ((1, 5), (2, 20), (2, 32), (5, 20)):  # 5 rows: chunks of 2, 2, 1 (padded)
            kw = _inputs(b, n, seed=n)
            got, ref = runner(**kw), eager(**kw)
            for e, a in zip(_tensors(ref), _tensors(got), strict=True):
                torch.testing.assert_close(a, e, **TOL)
    with pytest.raises(ValueError, match="seq 40 is past the largest exported bucket"):
        runner(**_inputs(2, 40, seed=0))


def test_padding_masks_padded_tokens_of_real_rows_and_keeps_padded_rows_unmasked():
    """Padded tokens of a real row are masked (a real token must not see them); padded rows
    are all pad tokens with mask 1 (cut from the outputs, and never fully masked, which is
    the slow path of onnxruntime's attention kernel)."""
    kw = _inputs(3, 5, seed=0)
    padded, size, over = pad_inputs(kw, check_buckets({"seq": [8], "batch": [4]}), pad_id=7)
    assert size == {1: (8, 5), 0: (4, 3)} and not over
    ids, mask, types = padded["input_ids"], padded["attention_mask"], padded["token_type_ids"]
    assert ids.shape == mask.shape == types.shape == (4, 8)
    assert torch.equal(ids[:3, :5], kw["input_ids"]) and (ids[:3, 5:] == 7).all()
    assert torch.equal(mask[:3, :5], kw["attention_mask"]) and (mask[:3, 5:] == 0).all()
    assert (ids[3] == 7).all() and (mask[3] == 1).all() and (types[3] == 0).all()
    assert torch.equal(types[:3, :5], kw["token_type_ids"]) and (types[:3, 5:] == 0).all()


@pytest.mark.slow  # the fast tier's 4-minute budget
def test_a_batch_past_the_largest_batch_bucket_runs_in_chunks_of_it(opts):
    """Rows never mix, so 5 rows with ``batch: [2]`` run as 2 + 2 + 1 (padded to 2) through the
    one compiled variant, joined back: eager's values, no warning, no new variant."""
    torch._dynamo.reset()
    eager = _encoder("bert")
    model = compile_for_encoder(_encoder("bert"), buckets={"seq": [16], "batch": [2]},
                                options=opts)
    made = STATS["shape_variants"]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for b, n in ((2, 9), (5, 12), (1, 16)):
            kw = _inputs(b, n, seed=b)
            kw["output_hidden_states"] = True  # a tuple of per-layer tensors is joined too
            ref, got = eager(**kw), model(**kw)
            assert len(got.hidden_states) == len(ref.hidden_states)
            for e, a in zip(ref.hidden_states, got.hidden_states, strict=True):
                torch.testing.assert_close(a, e, **TOL)
            for e, a in zip(_tensors(ref), _tensors(got), strict=True):
                torch.testing.assert_close(a, e, **TOL)
    assert STATS["shape_variants"] - made == 1


def test_chunks_whose_output_has_no_row_dimension_are_refused():
    """A loss (0-dim) of each chunk cannot be joined into the batch's: refused, with the fix."""
    kw = {"input_ids": torch.zeros(3, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match="no row dimension.*batch bucket >= 3"):
        by_rows(lambda kw: {"loss": torch.tensor(1.0)}, kw, {"batch": [2]})
    joined = by_rows(lambda kw: (kw["input_ids"] + 1, None), kw, {"batch": [2]})
    assert torch.equal(joined[0], torch.ones(3, 4, dtype=torch.long)) and joined[1] is None


@pytest.mark.parametrize(("family", "config"), [
    ("ConvBert", dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                      intermediate_size=128, max_position_embeddings=128)),  # a convolution
    ("Funnel", dict(d_model=64, n_head=4, d_head=16, d_inner=128, block_sizes=[1, 1])),  # pools
])
def test_a_model_whose_tokens_see_the_padding_is_refused(family, config):
    """Buckets are exact only where pad tokens are invisible to real ones; a model where they
    are not gave its real tokens wrong values with no error. Both entry points refuse it,
    naming the fix; the same check passes BERT (above)."""
    import transformers

    from fxpass.hf.encoders import export_for_encoder

    cfg = getattr(transformers, f"{family}Config")(vocab_size=512, **config)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}Model")(cfg).eval()
    why = rf"padding changes {family}Model's outputs.*real tokens are .* off eager.*torch\.compile"
    with pytest.raises(ValueError, match="compile_for_encoder: " + why):
        compile_for_encoder(model, buckets={"seq": [16, 32]}, device="ort")
    with pytest.raises(ValueError, match="export_for_encoder: " + why):
        export_for_encoder(model, buckets={"seq": [16, 32], "batch": [1, 4]}, device="ort")


def test_what_a_model_puts_at_masked_tokens_is_not_compared(opts):
    """DeBERTa-v2's outputs at tokens the caller masked change with the padded length, its
    real tokens' do not: buckets serve it, real tokens equal eager's (rtol = atol = 1e-4)."""
    import transformers

    cfg = transformers.DebertaV2Config(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, intermediate_size=128,
                                       max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.DebertaV2Model(cfg).eval()
    ids = torch.randint(3, 500, (2, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, 9:] = 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        c = compile_for_encoder(model, buckets={"seq": [16, 32]}, options=opts, device="ort")
        got = c(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    assert torch.allclose(got[real], want[real], rtol=1e-4, atol=1e-4)
