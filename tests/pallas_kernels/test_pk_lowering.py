"""Deviceless lowering: the Pallas kernels lower to Triton (cuda) and Mosaic (tpu) on CPU.

This checks what can be checked without the hardware: every op in the kernels has a Triton or
Mosaic lowering and the block shapes pass lowering-time checks. It does not compile to PTX or
run the kernels (that needs the `gpu` / `tpu` marked tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from pallas_kernels import targets


@pytest.mark.parametrize(
    "backend, platform, marker",
    [("pallas_triton", "cuda", "__gpu$xla.gpu.triton"), ("pallas_tpu", "tpu", "tpu_custom_call")],
)
@pytest.mark.parametrize("transpose_rhs, out_dtype", [(False, None), (True, jnp.float32)])
def test_forward_and_vjp_lower_for_target(backend, platform, marker, transpose_rhs, out_dtype):
    m, k, n, g = 512, 256, 384, 8  # N = 3 tiles of 128; M = 4 tiles
    lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((g, n, k) if transpose_rhs else (g, k, n), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((g,), jnp.int32)

    def f(lhs, rhs, sizes):
        def op(x, w):
            return pk.grouped_matmul(
                x, w, sizes, transpose_rhs=transpose_rhs, backend=backend,
                preferred_element_type=out_dtype,  # fp32 out: the VJP gets fp32 cotangents
            )  # fmt: skip

        out, vjp = jax.vjp(op, lhs, rhs)
        return out, *vjp(out)

    with targets.lowering_platform(platform):
        text = jax.jit(f).trace(lhs, rhs, sizes).lower(lowering_platforms=(platform,)).as_text()
    assert text.count(marker) == 3  # gmm forward, gmm for dlhs, tgmm for drhs
