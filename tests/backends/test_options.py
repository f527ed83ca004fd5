"""``Options``: the one typed, frozen object every layer below the entry points reads."""

from __future__ import annotations

import dataclasses

import pytest

from fxpass.jit.options import NOT_KEYED, OPTIONS, REGION_KEYED, Options, from_options


def test_the_table_and_the_fields_are_the_same_options() -> None:
    """An option documented in the table but not a field (or the reverse) would be accepted
    and then ignored, or read and never validated."""
    fields = {f.name for f in dataclasses.fields(Options)} - {"exporting", "device", "dev"}
    assert fields == set(OPTIONS)
    assert set(NOT_KEYED) <= fields and set(REGION_KEYED) <= fields


def test_built_once_frozen_and_typed() -> None:
    o = from_options({"enable": ["rms_norm"], "cache": False, "threads": 1}, "bpu")
    assert from_options(o) is o  # validated once: an Options passes through
    assert o.enable == ("rms_norm",) and o.threads == 1 and o.max_shape_variants == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.strict = True  # type: ignore[misc]
    assert o.replace(strict=True).strict and not o.strict


def test_keys_are_json_and_leave_out_what_changes_no_result() -> None:
    import json

    o = from_options({"enable": ["rms_norm"], "cache": False, "cpu_threads": 1}, "bpu")
    keyed = o.keyed()
    assert not set(NOT_KEYED) & set(keyed) and "exporting" not in keyed
    assert keyed["enable"] == ["rms_norm"]
    json.dumps(keyed)  # a plan key is written as JSON
    assert o.keyed() == o.replace(cpu_threads=None, max_variants=2).keyed()
    assert o.keyed() != o.replace(march="nash-e").keyed()
    # a region's key: the framework's rule switches and every device option that shapes an
    # artifact (the march, quantization), not those that change no artifact (tiered, threads)
    region = o.region_keyed()
    assert set(REGION_KEYED) <= set(region) and region["device"] == "bpu"
    assert {"march", "quantize", "host_fusions"} <= set(region)
    assert not {"tiered", "threads"} & set(region)
    assert region != o.replace(march="nash-e").region_keyed()
    assert region == o.replace(tiered=False, threads=1).region_keyed()


def test_a_misspelled_option_is_an_error_naming_the_valid_ones() -> None:
    with pytest.raises(TypeError, match="unknown option.*'treads'.*threads:"):
        from_options({"treads": 1}, "bpu")
