"""Every Hugging Face family's config, as moejax reads it (`lm_config_from_hf`, and the MoE
block alone with `moe_config_from_hf`), round-trips through `moejax.record_to_json` /
`record_from_json` with `==`: what a converted directory's `model.json` stores."""

from __future__ import annotations

import json
from pathlib import Path

import _hf_decoder_reference as ref
import make_hf_model_fixtures as fixtures
import pytest

import moejax
from moejax.interop.hf import lm_config_from_hf, moe_config_from_hf
from moejax.models import LMConfig

WHOLE = {**ref.CONFIGS, **ref.CONFIGS_2026, **fixtures.DENSE_CONFIGS}
BLOCKS = sorted(p.parent.name for p in (Path(__file__).parent / "fixtures").glob("*/config.json"))


@pytest.mark.parametrize("family", sorted(WHOLE))
def test_whole_model_configs_round_trip(family):
    cfg, _ = lm_config_from_hf(WHOLE[family])
    obj = json.loads(json.dumps(moejax.record_to_json(cfg), allow_nan=False))
    assert moejax.record_from_json(LMConfig, obj) == cfg


@pytest.mark.parametrize("family", BLOCKS)
def test_block_configs_round_trip(family):
    config = json.loads((Path(__file__).parent / "fixtures" / family / "config.json").read_text())
    cfg, _ = moe_config_from_hf(config)
    obj = json.loads(json.dumps(moejax.record_to_json(cfg), allow_nan=False))
    assert moejax.record_from_json(type(cfg), obj) == cfg
