"""`fit.state_bytes`: the training state one device stores (parameters and Adam's two moments as
laid out by `lm_partition_specs`), per layer kind, without compiling; the DeepSeek-V3-shaped
preset's verdicts on 64 H100s and a v5p-64 with FSDP x expert, against the shapes by hand."""

import pytest

from moejax.aot import fit
from moejax.models import presets

NAME = "deepseek_v3_4l"
CFG = presets.get(NAME)
LAYOUT = fit.Layout((("fsdp", 8), ("expert", 8)), microbatches=2, remat="full")
GIB = 2**30


def _by_hand() -> tuple[int, int, int]:
    """Bytes per device of a dense layer, an MoE layer and the rest: fp32 parameters and two
    fp32 moments (12 bytes a parameter); arrays with `D` split over all 64 devices (FSDP, then
    `expert` where the array has no expert axis), expert arrays 8 x 8 (`E` over `expert`, `D`
    over `fsdp`), the MLA up-projections (no `D`) and the norms whole on every device."""
    d, v, h = 7168, 129280, 128
    q_rank, kv_rank, nope, rope, v_dim = 1536, 512, 128, 64, 128
    e, f, fs, dense_f = 256, 2048, 2048, 18432
    split = d * q_rank + d * (kv_rank + rope) + h * v_dim * d  # wq_a, wkv_a, wo: D over 64
    whole = q_rank * h * (nope + rope) + kv_rank * h * (nope + v_dim)  # wq_b, wkv_b
    whole += q_rank + kv_rank + 2 * d  # q_a_norm, kv_a_norm, attn_norm, ffn_norm
    attention = split // 64 + whole
    dense = attention + 3 * d * dense_f // 64
    moe = attention + 3 * e * d * f // 64 + 3 * d * fs // 64 + d * e // 64 + e  # + router
    rest = 2 * v * d // 64 + d  # embedding, unembedding (D over 64), final norm
    return 12 * dense, 12 * moe, 12 * rest


@pytest.mark.parametrize("target", ["h100x64", "v5p-64"])
def test_deepseek_v3_layer_unit_state_and_verdicts_on_64_devices(target):
    tgt = fit.TARGETS[target]
    state = fit.state_bytes(CFG, tgt, LAYOUT)
    dense, moe, rest = _by_hand()
    assert state.per_kind == {"dense": dense, "moe": moe} and state.other == rest
    # the 4-layer preset (one unit of each block kind) stores 8.9 GiB a device: it fits; the
    # published 61 layers (3 dense, 58 MoE) store 153.8 GiB: more than either chip's HBM
    assert state.at_depth(CFG.mlp_kinds) == pytest.approx(8.9 * GIB, rel=0.01)
    full = presets.FULL_DEPTH[NAME]
    assert len(full) == 61 and full.count("dense") == 3
    assert state.at_depth(full) == pytest.approx(153.8 * GIB, rel=0.001)
    assert state.at_depth(full) > tgt.hbm_bytes > state.at_depth(CFG.mlp_kinds)
    line = fit.state_line(NAME, CFG, tgt, LAYOUT, full)
    assert line.startswith(f"{NAME} {target} fsdp8xexpert8: parameters + Adam moments")
    assert "dense layer 0.70, moe layer 2.61" in line
    assert line.endswith(f"(3 dense, 58 moe): 153.8/{tgt.hbm_bytes / GIB:.1f} GiB does not fit")


def test_bf16_moments_store_two_thirds_of_the_state():
    """fp32 parameters with bf16 moments: 4 + 2 + 2 bytes a parameter instead of 4 + 4 + 4; the
    published 61 layers then store 102.5 GiB a device (153.8 with fp32 moments)."""
    tgt = fit.TARGETS["h100x64"]
    fp32, bf16 = fit.state_bytes(CFG, tgt, LAYOUT), fit.state_bytes(CFG, tgt, LAYOUT, "bfloat16")
    full = presets.FULL_DEPTH[NAME]
    assert bf16.at_depth(full) == pytest.approx(fp32.at_depth(full) * 8 / 12, rel=1e-6)
    assert bf16.at_depth(full) == pytest.approx(102.5 * GIB, rel=0.001)
    line = fit.state_line(NAME, CFG, tgt, LAYOUT, full, "bfloat16")
    assert "parameters + bfloat16 Adam moments per device" in line
    assert line.endswith("(3 dense, 58 moe): 102.5/79.1 GiB does not fit")


def test_state_bytes_refuses_a_layout_of_another_size():
    with pytest.raises(ValueError, match="has 64 devices, h100x8 has 8"):
        fit.state_bytes(CFG, fit.TARGETS["h100x8"], LAYOUT)
