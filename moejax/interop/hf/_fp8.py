"""FP8 checkpoints with block scales (DeepSeek-V3/R1, Kimi K2 on the Hub), dequantized on load.

Such a checkpoint's `config.json` has `quantization_config = {"quant_method": "fp8", "fmt":
"e4m3", "weight_block_size": [128, 128], ...}`; each quantized Linear weight `W [out, in]` is
stored as `float8_e4m3fn` with a float32 `weight_scale_inv [ceil(out / 128), ceil(in / 128)]`,
and the real weight is `W[i, j] * weight_scale_inv[i // 128, j // 128]` (DeepSeek's
`weight_dequant`; the edge blocks of a size that is not a multiple of 128 are partial). Norms,
the embedding, the head and the router stay in bf16/fp32 and are read as they are.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from moejax.interop.hf._errors import CheckpointError

FP8_DTYPES = ("F8_E4M3",)  # safetensors dtype names of the weights `dequantize_fp8` reads
SCALE_SUFFIX = "_scale_inv"
# `quantization_config.fmt` spellings of e4m3 (DeepSeek-V3's "e4m3", MiniMax-M2's torch name)
E4M3_NAMES = ("e4m3", "float8_e4m3fn")


def fp8_block_size(config: dict[str, Any]) -> tuple[int, int] | None:
    """The `(rows, columns)` scale block of an FP8 block-quantized checkpoint's `config.json`,
    or None when it has no `quantization_config`.

    Raises:
      CheckpointError: another quantization (naming `quant_method`, `fmt` or
        `weight_block_size`): only e4m3 weights with 2-D block scales are dequantized.
    """
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"config.json quantization_config={q!r}: need an object")
    method, fmt = q.get("quant_method"), q.get("fmt", "e4m3")
    if method != "fp8":
        raise CheckpointError(
            f"config.json quantization_config.quant_method={method!r}: moejax dequantizes only "
            "FP8 block-scaled checkpoints on load (quant_method 'fp8'); dequantize this one first"
        )
    if fmt not in E4M3_NAMES:
        raise CheckpointError(
            f"config.json quantization_config.fmt={fmt!r}: only e4m3 FP8 weights are dequantized"
        )
    block = q.get("weight_block_size")
    if not (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)
    ):
        raise CheckpointError(
            f"config.json quantization_config.weight_block_size={block!r}: need [rows, columns] "
            "(per-tensor or per-channel FP8 scales are not implemented)"
        )
    return int(block[0]), int(block[1])


def without_quantization(config: dict[str, Any]) -> dict[str, Any]:
    """`config` as it describes the dequantized model (no `quantization_config`)."""
    return {k: v for k, v in config.items() if k != "quantization_config"}


def dequantize_fp8(
    weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], name: str = "?"
) -> np.ndarray:
    """`weight [out, in]` (float8) times its block scales `scale_inv [ceil(out / bo),
    ceil(in / bi)]`, in float32 (each product is exact there: 4 significant bits times a float32).

    Raises:
      CheckpointError: a weight that is not 2-D or a scale of another shape (naming `name`).
    """
    if weight.ndim != 2:
        raise CheckpointError(f"FP8 weight of shape {weight.shape}: need [out, in]", tensor=name)
    (rows, cols), (bo, bi) = weight.shape, block
    want = (math.ceil(rows / bo), math.ceil(cols / bi))
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(
            f"shape {tuple(scale_inv.shape)}, but {block} blocks of a {weight.shape} weight "
            f"need {want}",
            tensor=name + SCALE_SUFFIX,
        )
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), bo, 0), bi, 1)[:rows, :cols]
    return weight.astype(np.float32) * scale
