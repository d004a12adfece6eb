"""Pallas Mosaic GPU grouped-matmul kernels for Hopper (sm_90a): gmm (and gmm_t, the lhs
gradient, reading the weights transposed in shared memory) and tgmm (the weight gradient).

Every kernel is persistent and warp-specialized, after jax's dense Hopper recipe
(`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`): one CTA per SM walks a list of output
tiles; in each CTA one warpgroup issues TMA copies into a ring of `num_stages` shared-memory
slots and two consumer warpgroups run wgmma on them, each owning half of the CTA tile's
columns, with registers moved from the producer to the consumers (`set_max_registers`). The
epilogue casts the fp32 accumulator and stores it with TMA through two 64 x 64 shared-memory
slots per warpgroup, double-buffered, so the next tile's loads overlap the last stores.
The K blocks reach the ring by jax's `emit_pipeline_warp_specialized`, once per tile
(`Config.pipeline="per_tile"`), or by `tile_stream`, one ring for all of the CTA's tiles
(`"stream"`): see `run_tiles`.

Groups must be aligned to the row tile: every group's size is a multiple of `tm` (gmm) or of
the contraction tile (tgmm), so every M tile belongs to one group and nothing is masked or
revisited. `ops` pads the rows of unaligned groups (`metadata.align_rows`); `moejax`'s permute
phase pads experts itself (`pallas_kernels.GROUP_ALIGNMENT`). The schedule is device-side data
computed by pure jnp (`metadata.aligned_tile_groups`, `metadata.largest_first`):
  * gmm: work item (m-tile, n-tile), ordered by a snaking raster `Config.raster` m-tiles wide,
    so the CTAs in flight share weight panels and token tiles in L2; the m-tile's group is one
    load from a [M / tm] table. Tiles past sum(group_sizes) run zero steps and store zeros.
  * tgmm: work item (group, k-tile, n-tile), groups largest first (the longest items start first,
    so the persistent CTAs finish together); each item accumulates over its group's rows.

Only 16-bit operands (bf16, fp16): Hopper's tf32 wgmma cannot read a transposed operand, which
the weight layout [G, K, N] and every tgmm need (`ops` keeps fp32 on Triton).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import metadata as md
from pallas_kernels import mgpu_compat, vma
from pallas_kernels.config import MOSAIC_GPU_EPILOGUE_TILE, MOSAIC_GPU_PIPELINES, Config

MEMORY_REGISTERS = 40  # the TMA warpgroup's registers; the two consumers share the rest
NUM_SMS_H100 = 132
INTERPRET_SMS = 2


def num_sms() -> int:
    """SMs of the compile target: the current abstract mesh's GPU, else H100's 132 (never
    `jax.devices()`, which is the CPU during a deviceless compile)."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is not None and device.platform in ("gpu", "cuda") and device.num_cores:
        return int(device.num_cores)
    return NUM_SMS_H100


def _transforms(minor: int, dtype) -> tuple:
    """Tiling and swizzle of a shared-memory tile whose last dim has `minor` elements."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def _kernel(body, *, out_type, name: str, interpret, cost: pl.CostEstimate, sms: int):
    """`plgpu.kernel`: one CTA per SM, three warpgroups (two consumers, one producer).

    Inside `shard_map(check_vma=True)`, `plgpu.kernel` runs its body with the check off and
    types its outputs as varying over no axis: callers cast them back to their operands' axes
    (each device's output is its own, so that is what they are)."""
    if interpret is True:
        interpret = mgpu_compat.interpret_params()
    if interpret:
        # The interpreter simulates every CTA's three warpgroups as threads: 132 of them cost
        # minutes at test sizes. Two CTAs still walk several work items each.
        sms = min(sms, INTERPRET_SMS)
    return mgpu_compat.kernel(
        body,
        cost_estimate=cost,
        out_type=out_type,
        grid=(sms,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        kernel_name=name,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret or None,
    )


def _epilogue(acc, out_smem, out_gmem, wg, out_dtype):
    """Stores one warpgroup's [rows, cols] fp32 accumulator to `out_gmem` (a [rows, cols] view)
    through its two shared-memory slots, one 64 x 64 TMA store at a time."""
    rows, cols = acc.shape
    epi_m, epi_n = out_smem.shape[-2:]
    slots = out_smem.shape[1]
    acc = acc.astype(out_dtype)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's stores have read
    for a in range(rows // epi_m):
        for b in range(cols // epi_n):
            slot = (a * (cols // epi_n) + b) % slots
            part_m, part_n = slice(a * epi_m, (a + 1) * epi_m), slice(b * epi_n, (b + 1) * epi_n)
            plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)  # this slot is free
            out_smem[wg, slot] = acc[part_m, part_n]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], out_gmem.at[part_m, part_n])


def _out_smem(rows: int, cols: int, out_dtype):
    """Epilogue slots: [2 warpgroups, slots, 64, 64] (one slot when a tile is one store)."""
    epi_m = min(MOSAIC_GPU_EPILOGUE_TILE, rows)
    epi_n = min(MOSAIC_GPU_EPILOGUE_TILE, cols)
    slots = min(2, (rows * cols) // (epi_m * epi_n))
    return plgpu.SMEM((2, slots, epi_m, epi_n), out_dtype, transforms=_transforms(epi_n, out_dtype))


def _compute_registers() -> int:
    """Each consumer warpgroup's registers per thread: the SM's 64K over one warpgroup's 128
    threads (512), less the producer's, halved, rounded down to a multiple of 8 (what
    `emit_pipeline_warp_specialized` gives)."""
    return min(256, (512 - MEMORY_REGISTERS) // 2) // 8 * 8


PIPELINES = MOSAIC_GPU_PIPELINES  # how K blocks reach shared memory (`run_tiles`)


def tile_stream(grid, *, rings, stages: int, tile, steps, copies, step, context) -> None:
    """A persistent, warp-specialized loop over the CTA's output tiles with one shared-memory
    ring for all of them: the producer warpgroup (`wg` 2) runs into the next tile's K blocks
    while the consumers (0 and 1) finish the last and store it.

    `emit_pipeline_warp_specialized`, called once per tile, fills its ring at the start of the
    tile and drains it at the end, so every tile waits for its first TMA loads with the tensor
    cores idle; tiles of few K blocks (fp8's 128-deep steps, a weight gradient over small
    groups) pay that latency often. Here the step counter runs on across tiles, and a slot
    waits for its consumers only once it is reused.

    A slot is refilled once both consumers have arrived on its "consumed" barrier, after their
    last read of it (wgmma waited for, plain loads done), as in jax's pipeline, CUTLASS's and
    DeepGEMM's. The Mosaic GPU interpreter's race detector reports a plain load of a slot and
    the slot's next TMA write as a race in both pipelines (it asks for a proxy fence between a
    generic-proxy read and an async-proxy write, which these pipelines do not issue).

    Args:
      grid: the tiles, walked by `plgpu.nd_loop` over the "sm" axis.
      rings: `[(block shape, dtype, transforms)]`, one shared-memory ring per operand, `stages`
        slots each.
      stages: slots per ring.
      tile: `tile(info) -> t`, the tile's scalars (a pytree) from its `plgpu.NDLoopInfo`; every
        warpgroup computes it.
      steps: `steps(t) -> int32`, the tile's K blocks (0: `run` returns its carry).
      copies: `copies(t, r) -> [gmem view]`, step `r`'s source for each ring.
      step: `step(t, r, slots, carry) -> carry`, with `slots` the rings' views at step `r`'s slot;
        it must be done reading them when it returns (wgmma waited for).
      context: `context(t, run)`, each consumer's work on tile `t`: `run(carry) -> carry` runs
        the steps (as `emit_pipeline_warp_specialized`'s `compute_context`).
    """

    def run(produced, consumed, *smem):
        def producer():
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

            @plgpu.nd_loop(grid, collective_axes="sm", init_carry=jnp.int32(0))
            def issued(info, carry):  # carry: the steps issued before this tile
                t = tile(info)

                def copy(r, _):
                    slot = lax.rem(carry + r, stages)

                    @pl.when(carry + r >= stages)  # the slot's previous step has been consumed
                    def _():
                        plgpu.barrier_wait(consumed.at[slot])

                    for src, ring in zip(copies(t, r), smem, strict=True):
                        plgpu.copy_gmem_to_smem(src, ring.at[slot], produced.at[slot])

                num_steps = steps(t)
                lax.fori_loop(0, num_steps, copy, None)
                return carry + num_steps

            # Wait for the last steps' consumers, so no copy outlives the kernel's barriers.
            def drain(count, _):
                plgpu.barrier_wait(consumed.at[lax.rem(count, stages)])

            lax.fori_loop(jnp.maximum(issued - stages, 0), issued, drain, None)

        def consumer():
            plgpu.set_max_registers(_compute_registers(), action="increase")

            @plgpu.nd_loop(grid, collective_axes="sm", init_carry=jnp.int32(0))
            def _(info, carry):  # carry: the steps consumed before this tile
                t = tile(info)
                num_steps = steps(t)

                def run_steps(acc):
                    def consume(r, acc):
                        slot = lax.rem(carry + r, stages)
                        plgpu.barrier_wait(produced.at[slot])
                        acc = step(t, r, [ring.at[slot] for ring in smem], acc)
                        plgpu.barrier_arrive(consumed.at[slot])
                        return acc

                    return lax.fori_loop(0, num_steps, consume, acc)

                context(t, run_steps)
                return carry + num_steps

        lax.cond(lax.axis_index("wg") == 2, producer, consumer)

    pl.run_scoped(
        run,
        plgpu.Barrier(num_arrivals=len(rings), num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        *[plgpu.SMEM((stages, *shape), dtype, transforms=t) for shape, dtype, t in rings],
        collective_axes="wg",
    )


def gmm_schedule(tile_group_gmem, tiles: tuple[int, int], raster: int, num_groups: int,
                 k_iters: int):  # fmt: skip
    """`(tile, steps)` of a persistent gmm for `run_tiles`: work item `info.index[0]` is the
    output tile `(mi, ni)` of the `tiles` grid, in a snaking raster `raster` m-tiles wide;
    `tile(info) = (mi, ni, g, live)`, its group `g` read from the `[M / tm]` table
    `tile_group_gmem` (`metadata.aligned_tile_groups`: `num_groups` past the groups, clamped
    here); `steps(t)` is `k_iters` K blocks, 0 for a tile past the groups (it stores zeros)."""

    def tile(info):
        mi, ni = plgpu.planar_snake(info.index[0], tiles, 0, raster)
        group = tile_group_gmem[mi]
        return mi, ni, jnp.minimum(group, num_groups - 1), group < num_groups

    def steps(t):
        return jnp.where(t[3], k_iters, 0)

    return tile, steps


def run_tiles(pipeline, grid, rings, operands, *, tile, steps, views, blocks, step, context,
              stages):  # fmt: skip
    """Each CTA's tiles of `grid`: per tile `context(t, run)`, where `run(carry)` runs `step`
    on each of the tile's K blocks, on `pipeline` (`PIPELINES`).

    A tile `t = tile(info)` has `steps(t)` K blocks; block `r` of ring i is block
    `blocks(t, r)[i]` (in units of the ring's block shape) of `views(t)[i]`, a view of
    `operands[i]`. "stream" runs `tile_stream` (one ring of `stages` slots for all the tiles);
    "per_tile", jax's `emit_pipeline_warp_specialized` on each tile (`stages` slots, at most
    the steps of a tile when those are static) with allocations shared between the tiles.
    """
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline must be one of {PIPELINES}, got {pipeline!r}")
    if pipeline == "stream":

        def copies(t, r):
            return [
                view.at[tuple(pl.ds(b * size, size) for b, size in zip(block, shape, strict=True))]
                for view, block, (shape, _, _) in zip(views(t), blocks(t, r), rings, strict=True)
            ]  # fmt: skip

        tile_stream(grid, rings=rings, stages=stages, tile=tile, steps=steps, copies=copies,
                    step=step, context=context)  # fmt: skip
        return

    def pipe(t, body, compute_context, num_steps):
        def index_map(i, r):  # (allocations need only that each block moves with r)
            return (r,) * len(rings[i][0]) if t is None else blocks(t, r)[i]

        specs = [
            plgpu.BlockSpec(shape, functools.partial(index_map, i), transforms=transforms)
            for i, (shape, _, transforms) in enumerate(rings)
        ]
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(num_steps,), memory_registers=MEMORY_REGISTERS, in_specs=specs,
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=stages,
            compute_context=compute_context,
        )  # fmt: skip

    ignore = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the body)
    allocs = pipe(None, ignore, ignore, stages).get_allocations(*operands)

    def scope(allocations):
        @plgpu.nd_loop(grid, collective_axes="sm")
        def _(info):
            t = tile(info)

            def body(idx, *refs):
                *slots, carry = refs
                return step(t, idx[0], slots, carry)

            compute_context = functools.partial(context, t)
            pipe(t, body, compute_context, steps(t))(*views(t), allocations=allocations)

    pl.run_scoped(scope, allocs, collective_axes="wg")


@functools.partial(
    jax.jit, static_argnames=("tiles", "config", "transpose_rhs", "out_dtype", "interpret")
)
def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    tile_group: jax.Array,
    *,
    tiles: tuple[int, int, int],
    config: Config,
    transpose_rhs: bool,
    out_dtype,
    interpret,
) -> jax.Array:
    """out[rows of g] = lhs[rows of g] @ rhs[g] for groups aligned to the row tile.

    Args:
      lhs: [M, K] 16-bit, M % tm == 0, K % tk == 0.
      rhs: [G, K, N] ([G, N, K] if transpose_rhs), N % tn == 0.
      tile_group: [M // tm] int32, the group of each m-tile; G for tiles past the groups
        (`metadata.aligned_tile_groups`).
      tiles: (tm, tk, tn), the CTA tile; each consumer warpgroup owns tn // 2 columns.
      config: supplies num_stages (the shared-memory ring), raster and pipeline.
      transpose_rhs: contract with rhs's last axis (the TMA loads [tn, tk] tiles of rhs[g] and
        wgmma reads them transposed; W^T is never written to memory).
      out_dtype: output dtype (accumulation is fp32).
      interpret: False, or Mosaic GPU interpreter params (True: the defaults).

    Returns:
      [M, N] of out_dtype; tiles past the groups are zero.
    """
    tm, tk, tn = tiles
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    m_iters, n_iters, k_iters = m // tm, n // tn, k // tk
    cols = tn // 2  # per consumer warpgroup
    operand = _transforms(tk, lhs.dtype)
    rings = [
        ((tm, tk), lhs.dtype, operand),
        ((tn, tk), rhs.dtype, operand)
        if transpose_rhs
        else ((tk, tn), rhs.dtype, _transforms(tn, rhs.dtype)),
    ]

    def body(tile_group_gmem, lhs_gmem, rhs_gmem, out_gmem):
        tile, steps = gmm_schedule(
            tile_group_gmem, (m_iters, n_iters), config.raster, num_groups, k_iters
        )

        def views(t):  # the tile's operands along K, in the rings' order
            mi, ni, g, _ = t
            cols_n = pl.ds(ni * tn, tn)
            w = rhs_gmem.at[g, cols_n, :] if transpose_rhs else rhs_gmem.at[g, :, cols_n]
            return [lhs_gmem.at[pl.ds(mi * tm, tm), :], w]

        def blocks(_, kk):  # step kk's block of each view
            return [(0, kk), (0, kk) if transpose_rhs else (kk, 0)]

        def scope(out_smem):
            wg = lax.axis_index("wg")
            wg_cols = pl.ds(wg * cols, cols)

            def context(t, run):
                mi, ni, _, _ = t

                @functools.partial(pl.run_scoped, acc=plgpu.ACC((tm, cols), jnp.float32))
                def _acc(acc):
                    run(acc)
                    out = out_gmem.at[pl.ds(mi * tm, tm), pl.ds(ni * tn, tn)].at[:, wg_cols]
                    _epilogue(acc[...], out_smem, out, wg, out_dtype)

            def step(_, kk, slots, acc):
                lhs_smem, rhs_smem = slots
                # With transpose_rhs, wgmma reads the [tn, tk] weight tile transposed.
                w = rhs_smem.at[wg_cols, :].T if transpose_rhs else rhs_smem.at[:, wg_cols]
                plgpu.wgmma(acc, lhs_smem, w)
                plgpu.wgmma_wait(0)
                return acc

            run_tiles(
                config.pipeline, (m_iters * n_iters,), rings, [lhs_gmem, rhs_gmem.at[0]],
                tile=tile, steps=steps, views=views, blocks=blocks, step=step, context=context,
                stages=(config.num_stages if config.pipeline == "stream"
                        else min(config.num_stages, k_iters)),
            )  # fmt: skip

        pl.run_scoped(scope, _out_smem(tm, cols, out_dtype), collective_axes="wg")
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    itemsize = lhs.dtype.itemsize
    cost = pl.CostEstimate(
        flops=2 * m * k * n,
        transcendentals=0,
        bytes_accessed=m * k * itemsize * n_iters
        + rhs.size * itemsize * m_iters // num_groups
        + m * n * jnp.dtype(out_dtype).itemsize,
    )
    kernel = _kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        name="gmm_t" if transpose_rhs else "gmm",
        interpret=interpret,
        cost=cost,
        sms=num_sms(),
    )
    return vma.cast_varying(kernel(tile_group, lhs, rhs), vma.varying_axes(lhs))


@functools.partial(jax.jit, static_argnames=("tiles", "config", "out_dtype", "interpret"))
def tgmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tiles: tuple[int, int, int],
    config: Config,
    out_dtype,
    interpret,
) -> jax.Array:
    """out[g] = lhs[rows of g]^T @ rhs[rows of g] for groups aligned to the row tile.

    Args:
      lhs: [M, K] 16-bit, M % tm == 0, K % tk == 0.
      rhs: [M, N], N % tn == 0.
      group_sizes: [G] int32, each a multiple of tm, sum <= M.
      tiles: (tm, tk, tn): rows contracted per step, output rows (of K) and columns (of N) per
        CTA; each consumer warpgroup owns tn // 2 columns.
      config: supplies num_stages, raster and pipeline.
      out_dtype: output dtype (accumulation is fp32).
      interpret: False, or Mosaic GPU interpreter params (True: the defaults).

    Returns:
      [G, K, N] of out_dtype; empty groups are zero.
    """
    tm, tk, tn = tiles
    m, k = lhs.shape
    n = rhs.shape[1]
    num_groups = group_sizes.shape[0]
    k_iters, n_iters = k // tk, n // tn
    cols = tn // 2
    per_group = k_iters * n_iters
    order, first_block, steps = md.largest_first(group_sizes, tm=tm)
    rings = [
        ((tm, tk), lhs.dtype, _transforms(tk, lhs.dtype)),
        ((tm, tn), rhs.dtype, _transforms(tn, rhs.dtype)),
    ]

    def body(order_gmem, first_gmem, steps_gmem, lhs_gmem, rhs_gmem, out_gmem):
        def tile(info):
            (lin,) = info.index
            g = order_gmem[lax.div(lin, per_group)]  # largest groups first
            ki, ni = plgpu.planar_snake(
                lax.rem(lin, per_group), (k_iters, n_iters), 0, config.raster
            )
            return g, ki, ni, first_gmem[g]

        def views(t):  # the tile's operands along M, in the rings' order
            _, ki, ni, _ = t
            return [lhs_gmem.at[:, pl.ds(ki * tk, tk)], rhs_gmem.at[:, pl.ds(ni * tn, tn)]]

        def blocks(t, r):  # row tile r of the group, from its first tile on
            return [(t[3] + r, 0), (t[3] + r, 0)]

        def scope(out_smem):
            wg = lax.axis_index("wg")
            wg_cols = pl.ds(wg * cols, cols)

            def context(t, run):
                g, ki, ni, _ = t

                @functools.partial(pl.run_scoped, acc=plgpu.ACC((tk, cols), jnp.float32))
                def _acc(acc):
                    run(acc)  # zero steps for an empty group: its gradient is zero
                    out = out_gmem.at[g, pl.ds(ki * tk, tk), pl.ds(ni * tn, tn)]
                    _epilogue(acc[...], out_smem, out.at[:, wg_cols], wg, out_dtype)

            def step(_, r, slots, acc):
                lhs_smem, rhs_smem = slots
                # lhs rows^T: wgmma reads the [tm, tk] tile transposed in shared memory.
                plgpu.wgmma(acc, lhs_smem.T, rhs_smem.at[:, wg_cols])
                plgpu.wgmma_wait(0)
                return acc

            run_tiles(
                config.pipeline, (num_groups * per_group,), rings, [lhs_gmem, rhs_gmem],
                tile=tile, steps=lambda t: steps_gmem[t[0]], views=views, blocks=blocks,
                step=step, context=context, stages=config.num_stages,
            )  # fmt: skip

        pl.run_scoped(scope, _out_smem(tk, cols, out_dtype), collective_axes="wg")
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    itemsize = lhs.dtype.itemsize
    cost = pl.CostEstimate(
        flops=2 * m * k * n,
        transcendentals=0,
        bytes_accessed=(lhs.size * n_iters + rhs.size * k_iters) * itemsize
        + num_groups * k * n * jnp.dtype(out_dtype).itemsize,
    )
    kernel = _kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
        name="tgmm",
        interpret=interpret,
        cost=cost,
        sms=num_sms(),
    )
    return vma.cast_varying(kernel(order, first_block, steps, lhs, rhs), vma.varying_axes(lhs))
