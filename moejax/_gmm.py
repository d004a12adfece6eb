"""Grouped matmuls for phase 3, one per `implementation=`, all with the same contract.

`gmm(lhs [R, K], rhs [E, K, N], group_sizes [E]) -> [R, N]`: rows `[start_e, start_e + size_e)`
multiply `rhs[e]`; rows past `sum(group_sizes)` give zeros. Each implementation states the row
alignment it wants the permute phase to pad groups to.

- `ragged_dot`: `jax.lax.ragged_dot` (alignment 1). Correct everywhere; on XLA:CPU it lowers to a
  masked dense matmul with E times the FLOPs.
- `blocked`: the XLA block loop. Groups are padded to `block` rows; a loop over groups slices the
  group's weights once and an inner loop runs one `[block, K] @ [K, N]` matmul per block of the
  group (trip counts = used blocks, so unused capacity costs nothing). Custom VJP: dlhs by the same
  loops with `rhs` transposed, drhs (tgmm) by accumulating `lhs_b^T @ dout_b` over a group's blocks
  in a loop carry written once per group. Safe inside `shard_map(check_vma=True)`: every loop
  carry starts varying like the operands and the VJP's cotangents vary like their primals (see
  `pallas_kernels.vma`), so each device of `moejax.parallel` runs it as is; the single-device
  layer runs the fused loop of `moejax._fused` instead.
- `pallas`: `pallas_kernels.grouped_matmul` (Mosaic GPU on Hopper, Triton on other GPUs, Mosaic on
  TPU, and the Triton kernel in interpret mode on CPU; chosen when the program is lowered, not
  from the host). Alignment `pallas_kernels.group_alignment()`: 128 when compiling for a Hopper
  GPU (its kernels need every expert on their 128-row tile), else 1.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.vma import match_varying, zeros_varying

_DOT_T = (((1,), (1,)), ((), ()))  # contract lhs dim 1 with rhs dim 1: lhs @ rhs.T


def ragged_dot_gmm(lhs, rhs, group_sizes):
    """`jax.lax.ragged_dot` with an fp32 accumulator for low-precision inputs."""
    return jax.lax.ragged_dot(
        lhs, rhs, group_sizes, preferred_element_type=jnp.promote_types(lhs.dtype, jnp.float32)
    ).astype(lhs.dtype)


def _group_blocks(group_sizes, block):
    """First block and block count of each group (group sizes are multiples of block)."""
    counts = group_sizes // block
    return jnp.cumsum(counts) - counts, counts


def _blocked_matmul(lhs, rhs, group_sizes, block, transpose_rhs):
    r, _ = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    acc_dtype = jnp.promote_types(lhs.dtype, jnp.float32)
    dims = _DOT_T if transpose_rhs else (((1,), (0,)), ((), ()))

    def group(g, out):
        w = rhs[g]  # sliced once per group, not once per block

        def body(b, out):
            x = jax.lax.dynamic_slice_in_dim(lhs, b * block, block)
            y = jax.lax.dot_general(x, w, dims, preferred_element_type=acc_dtype)
            return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), b * block, 0)

        return jax.lax.fori_loop(starts[g], starts[g] + counts[g], body, out)

    starts, counts = _group_blocks(group_sizes, block)
    init = zeros_varying((r, n), lhs.dtype, lhs, rhs, group_sizes)
    return jax.lax.fori_loop(0, rhs.shape[0], group, init)


def _blocked_tgmm(lhs, dout, group_sizes, block):
    """`[E, K, N]`: per group, `lhs_g^T @ dout_g` (zeros for empty groups).

    Each group's blocks accumulate in a loop carry that is written once per group (a
    read-modify-write of the `[E, K, N]` result per block costs as much as a small matmul).
    """
    _, k = lhs.shape
    n = dout.shape[1]
    acc_dtype = jnp.promote_types(lhs.dtype, jnp.float32)

    def group(g, out):
        def body(b, acc):
            x = jax.lax.dynamic_slice_in_dim(lhs, b * block, block)
            d = jax.lax.dynamic_slice_in_dim(dout, b * block, block)
            return acc + jax.lax.dot_general(
                x, d, (((0,), (0,)), ((), ())), preferred_element_type=acc_dtype
            )

        init = zeros_varying((k, n), acc_dtype, lhs, dout, group_sizes)
        acc = jax.lax.fori_loop(starts[g], starts[g] + counts[g], body, init)
        return jax.lax.dynamic_update_index_in_dim(out, acc, g, 0)

    starts, counts = _group_blocks(group_sizes, block)
    e = group_sizes.shape[0]
    init = zeros_varying((e, k, n), acc_dtype, lhs, dout, group_sizes)
    return jax.lax.fori_loop(0, e, group, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def blocked_gmm(lhs, rhs, group_sizes, block):
    """Grouped matmul over block-aligned groups (see module docstring).

    Args:
      lhs: `[R, K]` rows sorted by group, R a multiple of `block`.
      rhs: `[E, K, N]`.
      group_sizes: `[E]` int32, multiples of `block`, sum <= R.
      block: rows per block.

    Returns:
      `[R, N]` in `lhs.dtype` (fp32 accumulation).
    """
    return _blocked_matmul(lhs, rhs, group_sizes, block, transpose_rhs=False)


def _blocked_gmm_fwd(lhs, rhs, group_sizes, block):
    return blocked_gmm(lhs, rhs, group_sizes, block), (lhs, rhs, group_sizes)


def _blocked_gmm_bwd(block, res, dout):
    lhs, rhs, group_sizes = res
    dlhs = _blocked_matmul(dout, rhs, group_sizes, block, transpose_rhs=True)
    drhs = _blocked_tgmm(lhs, dout, group_sizes, block).astype(rhs.dtype)
    # Under shard_map the cotangents take the primals' varying axes (a psum where the forward
    # broadcast an invariant operand, e.g. replicated weights meeting sharded rows).
    return match_varying(dlhs, lhs), match_varying(drhs, rhs), None


blocked_gmm.defvjp(_blocked_gmm_fwd, _blocked_gmm_bwd)


def pallas_gmm(lhs, rhs, group_sizes, group_alignment: int = 1):
    """`pallas_kernels.grouped_matmul` with `backend="pallas"`: decided by the compile target,
    Mosaic GPU on Hopper, Triton on other GPUs, Mosaic on TPU, the Triton kernel in interpret
    mode elsewhere (CPU). `group_alignment`: what the permute padded every group to."""
    import pallas_kernels

    return pallas_kernels.grouped_matmul(
        lhs, rhs, group_sizes, backend="pallas", group_alignment=group_alignment
    )


@functools.cache
def _fp8_matmuls(implementation: str, block: int):
    """The float grouped matmuls the emulated fp8 path runs (`pallas_kernels.fp8_ops.Matmuls`),
    per implementation: the block loops, `ragged_dot`, or the Pallas kernels."""
    from pallas_kernels import fp8_ops

    if implementation == "blocked":
        return fp8_ops.Matmuls(
            gmm=functools.partial(_blocked_matmul, block=block, transpose_rhs=False),
            gmm_t=functools.partial(_blocked_matmul, block=block, transpose_rhs=True),
            tgmm=functools.partial(_blocked_tgmm, block=block),
        )
    if implementation == "pallas":
        import pallas_kernels as pk

        kw = dict(backend="pallas", group_alignment=block)
        return fp8_ops.Matmuls(
            gmm=functools.partial(pk.gmm, **kw),
            gmm_t=functools.partial(pk.gmm, transpose_rhs=True, **kw),
            tgmm=functools.partial(pk.tgmm, **kw),
        )
    return fp8_ops.REFERENCE_MATMULS


@dataclasses.dataclass(frozen=True)
class Fp8Matmul:
    """The expert matmuls with `expert_precision="fp8"` (`pallas_kernels.fp8_ops`): the fp8
    Mosaic GPU kernels for `implementation="pallas"` compiled for Hopper, the emulated recipe
    on this implementation's float matmuls otherwise. `alignment`: what the permute padded
    every group to. Called as a grouped matmul; `swiglu_ffn` runs a whole SwiGLU expert FFN
    with the quantizations fused into their producers (`fp8_ops.fp8_swiglu_ffn`)."""

    implementation: str
    alignment: int
    grad_format: str

    def _options(self) -> dict:
        return dict(
            grad_format=self.grad_format,
            backend="auto" if self.implementation == "pallas" else "emulated",
            matmuls=_fp8_matmuls(self.implementation, self.alignment),
            group_alignment=self.alignment,
        )

    def __call__(self, lhs, rhs, group_sizes):
        from pallas_kernels import fp8_ops

        return fp8_ops.fp8_grouped_matmul(lhs, rhs, group_sizes, **self._options())

    def swiglu_ffn(self, x, w_gate, w_up, w_down, group_sizes):
        from pallas_kernels import fp8_ops

        return fp8_ops.fp8_swiglu_ffn(x, w_gate, w_up, w_down, group_sizes, **self._options())
