"""The whole-model fixtures' weights are the same bytes on every install: each family's
`random_state_dict` hashes to what the fixture script recorded (no model is built), and the
float64 draws reach 16-bit types through float32, whatever ml_dtypes' own float64 cast does
(0.7.0 rounds once where 0.6.0 rounded through float32)."""

from __future__ import annotations

import json

import _hf_decoder_reference as ref
import make_hf_model_fixtures as fixtures
import ml_dtypes
import numpy as np
import pytest

# (fixture file, its families' configs, their seeds)
FILES = {
    "moe": (fixtures.OUT, ref.CONFIGS, fixtures.SEED),
    "moe_2026": (fixtures.OUT_2026, ref.CONFIGS_2026, fixtures.SEED),
    "dense": (fixtures.DENSE_OUT, fixtures.DENSE_CONFIGS, fixtures.DENSE_SEED),
}
CASES = [
    pytest.param(kind, family, id=family)
    for kind, (path, _, _) in FILES.items()
    for family in json.loads(str(np.load(path)["weights_sha256"]))
]


@pytest.mark.parametrize(("kind", "family"), CASES)
def test_weights_hash_to_the_fixtures(kind, family):
    path, configs, seeds = FILES[kind]
    recorded = json.loads(str(np.load(path)["weights_sha256"]))[family]
    sd = ref.random_state_dict(configs[family], seed=seeds[family])
    assert fixtures.weights_sha256(sd) == recorded, f"{family}: weights differ from the fixtures'"


def test_stored_rounds_through_float32():
    """The value on which ml_dtypes 0.6.0 and 0.7.0 disagree: 1 + 2**-8 + 2**-30 lies just
    above bfloat16's tie between 1 and 1 + 2**-7, so one rounding gives 1.0078125; in float32
    the 2**-30 is under half an ulp, the value becomes the tie 1 + 2**-8, and bfloat16 rounds
    it to even: 1.0 on every install."""
    draw = np.array([1 + 2**-8 + 2**-30, -(1 + 2**-8 + 2**-30), 3.0])
    got = ref.stored(draw, ml_dtypes.bfloat16)
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.astype(np.float64), [1.0, -1.0, 3.0])
    assert ref.stored(draw, np.float32).dtype == np.float32
