"""fp8 experts (`expert_precision="fp8"`, emulated on CPU) inside `moe_apply_sharded`: the same
function as the single-device layer, up to what quantization tiles the sharding changes.

SwiGLU experts without biases run the fused op (`fp8_ops.fp8_swiglu_ffn`, one custom VJP under
`shard_map(check_vma=True)`). Quantization tiles along a row (x, h and the output gradients:
1 x 128 along D or F) see the same values on any mesh as long as F is not split, so the output
and the input gradient equal the single device's up to fp32 summation order (and the rare fp8
rounding flip it causes). The weight gradients quantize x^T and dy^T in 128-row tiles of each
device's permuted rows, which differ from one device's: they agree to the fp8 rounding of
different tiles. Splitting F over `model` (tensor mode) splits h's row tiles too."""

import numpy as np
import pytest
from _common import SIZES, inputs, make_params, sharded, single_device

import moejax
from moejax.parallel import Strategy

FP8 = moejax.MoEConfig(**SIZES, top_k=2, expert_precision="fp8")


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _same_up_to_flips(a, b):
    """Equal to fp32 rounding but for a handful of rows where an fp32 difference upstream moved
    one value across an fp8 rounding boundary (as test_fp8_experts._same_up_to_flips)."""
    a, b = np.asarray(a), np.asarray(b)
    off = ~np.isclose(a, b, rtol=1e-5, atol=1e-6)
    assert off.reshape(off.shape[0], -1).any(1).sum() <= 5, off.mean()
    assert _rel(a, b) < 1e-5


@pytest.mark.parametrize(
    ("mesh_name", "strategy", "row_local"),
    [
        ("e8", Strategy(dispatcher="dropless"), True),
        pytest.param("d2e4", Strategy(mode="data"), True, marks=pytest.mark.slow),
        pytest.param("e4m2", Strategy(mode="tensor"), False, marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_fp8_experts_sharded_match_single_device(mesh_name, strategy, row_local):
    params, x = make_params(FP8), inputs()
    (_, (y0, _)), (gp0, gx0) = single_device(FP8, "ragged_dot")(params, x)
    (_, (y, _)), (gp, gx) = sharded(FP8, mesh_name, strategy, "ragged_dot")(params, x)
    # The unquantized layer: the fp8 ones are a few percent off it, by fp8 rounding.
    (_, (yu, _)), (gpu, gxu) = single_device(FP8.replace(expert_precision="bf16"), "ragged_dot")(
        params, x
    )
    assert 1e-3 < _rel(y0, yu) < 0.1
    if row_local:
        _same_up_to_flips(y.reshape(-1, y.shape[-1]), y0.reshape(-1, y0.shape[-1]))
        _same_up_to_flips(gx.reshape(-1, gx.shape[-1]), gx0.reshape(-1, gx0.shape[-1]))
    else:  # h's row tiles split over model: other roundings, as far from the unquantized layer
        assert _rel(y, yu) < 1.5 * _rel(y0, yu) and _rel(gx, gxu) < 1.5 * _rel(gx0, gxu)
    for name in ("w_gate", "w_up", "w_down"):  # other 128-row tiles, as far from unquantized
        got, want, exact = gp["experts"][name], gp0["experts"][name], gpu["experts"][name]
        assert _rel(got, exact) < 1.5 * _rel(want, exact), name
    assert _rel(gp["router"]["kernel"], gpu["router"]["kernel"]) < 1.5 * _rel(
        gp0["router"]["kernel"], gpu["router"]["kernel"]
    )
