"""The blocks of `lm_forward`, in order: one after the other (`unscanned_layers`), or as
`jax.lax.scan`s over the runs of a repeated unit of blocks (`scanned_layers`, `layer_runs`), with
the unscanned blocks between and after them.

Each takes `block`, one block over micro-batches (`moejax.models._lm.split_block` with the
model's settings bound), and `tables`, the slot tables of the MoE layers it runs; it returns the
micro-batches and the routing statistics (`LMAux`) stacked over its MoE layers, in order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moejax import _wgrad
from moejax.models._config import LMConfig
from moejax.models._patterns import ScanRun, scan_runs
from moejax.models._sharding import constrain as constrain_specs


def unscanned_layers(
    p, x, cfg, compute, tables, block, policy, start=0, delay_wgrad=False, slots=None, stop=None,
    replays=None,
):  # fmt: skip
    """Blocks `[start, stop)` (`stop` None: to the last) one after the other: `(x, LMAux
    stacked over their MoE layers)`; `tables` are those of their MoE layers, in order.

    With `delay_wgrad`, each MoE block followed by another block computes that block's
    attention weight gradients in its MoE layer's backward (`block`: `split_block`); `slots`
    are the first block's, from a block before `start`. `replays`: per micro-batch
    `[Lm', B / k, S, K]` recorded experts of their `Lm'` MoE layers, in order, or None."""
    stats, tables, j = [], iter(tables), 0
    stop = cfg.num_layers if stop is None else stop
    for i in range(start, stop):
        delay = delay_wgrad and cfg.is_moe(i) and i + 1 < cfg.num_layers
        fn = functools.partial(
            block,
            is_moe=cfg.is_moe(i),
            compute=compute and compute["layers"][i],
            next_compute=compute and compute["layers"][i + 1]["attn"] if delay else None,
            window=cfg.window(i),
        )
        if policy is not None:
            fn = jax.checkpoint(fn, policy=policy)
        next_attn = p["layers"][i + 1]["attn"] if delay else None
        with jax.named_scope(f"layer_{i}"):
            table = next(tables) if cfg.is_moe(i) else None
            replay = None
            if replays is not None and cfg.is_moe(i):
                replay, j = tuple(r[j] for r in replays), j + 1
            x, s, _, slots = fn(p["layers"][i], x, table, slots, next_attn, replay)
        if s is not None:
            stats.append(s)
    return x, (jax.tree.map(lambda *a: jnp.stack(a), *stats) if stats else None)


def _side(x, weights):
    side = _wgrad.attention_side(x, weights)
    return side.weights, side.templates


def layer_runs(cfg: LMConfig) -> tuple[ScanRun, ...]:
    """The runs `lm_forward(scan_layers=True)` scans (`moejax.models._patterns.scan_runs`)."""
    legacy = cfg.moe_every if cfg.mlp_layer_types is None and cfg.layer_types is None else None
    return scan_runs(cfg.layer_kinds, legacy_unit=legacy)


def scanned_layers(
    p, x, cfg, compute, tables, block, policy, mesh=None, delay_wgrad=False, replays=None
):
    """The runs of `layer_runs` as scans over their units, the layers between and after them
    unscanned: `(x, LMAux stacked over the MoE layers in order)`. `replays`: per micro-batch
    `[Lm, B / k, S, K]` recorded experts, or None.

    `delay_wgrad` needs one run from layer 0 whose unit ends in an MoE block (every
    `moe_every` pattern): see `_scan_run`."""
    runs = layer_runs(cfg)
    if delay_wgrad and not (len(runs) == 1 and runs[0].start == 0 and cfg.is_moe(runs[0].unit - 1)):
        raise ValueError(
            f"delay_wgrad=True with scan_layers: the layer pattern {cfg.mlp_kinds} scans as "
            f"{runs}; delaying needs one run from layer 0 whose unit ends in an MoE layer "
            "(a moe_every pattern); pass delay_wgrad=False or scan_layers=False"
        )
    moe_index = {layer: j for j, layer in enumerate(cfg.moe_layers)}

    def tables_of(lo, hi):
        return [tables[moe_index[i]] for i in range(lo, hi) if i in moe_index]

    def replays_of(lo, hi):  # the MoE layers of blocks [lo, hi) are consecutive in `replays`
        if replays is None:
            return None
        first = sum(i < lo for i in cfg.moe_layers)
        n = sum(lo <= i < hi for i in cfg.moe_layers)
        return tuple(r[first : first + n] for r in replays)

    stats, pos, slots = [], 0, None
    for run in runs:
        x, s = unscanned_layers(
            p, x, cfg, compute, tables_of(pos, run.start), block, policy, start=pos,
            stop=run.start, replays=replays_of(pos, run.start),
        )  # fmt: skip
        stats.append(s)
        end = run.start + run.unit * run.repeats
        x, s, slots = _scan_run(
            p, x, cfg, compute, tables_of(run.start, end), block, policy, run,
            mesh=mesh, delay_wgrad=delay_wgrad, replays=replays_of(run.start, end),
        )  # fmt: skip
        stats.append(s)
        pos = end
    x, s = unscanned_layers(
        p, x, cfg, compute, tables_of(pos, cfg.num_layers), block, policy, start=pos,
        delay_wgrad=delay_wgrad, slots=slots if pos < cfg.num_layers else None,
        replays=replays_of(pos, cfg.num_layers),
    )  # fmt: skip
    stats = [s for s in [*stats, s] if s is not None]
    if not stats:
        return x, None
    return x, jax.tree.map(lambda *a: jnp.concatenate(a), *stats)


def _scan_run(
    p, x, cfg, compute, tables, block, policy, run, mesh=None, delay_wgrad=False, replays=None
):
    """Blocks `[s, s + R * u)` of a `ScanRun` as a scan over its R units of u blocks:
    `(x, LMAux of its MoE layers in order or None, the slots for the block after it)`.
    `replays`: per micro-batch `[R * m, B / k, S, K]` recorded experts of its `m` MoE layers
    per unit, in order, or None.

    With `delay_wgrad` (a run from block 0 whose unit ends in an MoE block), unit `r`'s last
    MoE layer computes the weight gradients of the attention of the block after it (unit
    `r + 1`'s first, or the first block after the run), whose weights the scan takes with unit
    `r`'s, and whose slots it carries. The last unit's, where no block follows, go to block
    0's weights with zero inputs: they add exactly nothing. Block 0's own come from slots made
    before the scan, computed after its backward."""
    s0, u, repeats = run
    layers = p["layers"]
    units = [layers[s0 + k * u : s0 + (k + 1) * u] for k in range(repeats)]
    stack = lambda trees: jax.tree.map(lambda *a: jnp.stack(a), *trees)  # noqa: E731
    unit_compute = compute and compute["layers"][s0 : s0 + u]
    moe_in_unit = [j for j in range(u) if cfg.is_moe(s0 + j)]
    m = len(moe_in_unit)
    # tables of unit r, MoE block q: tables[r * m + q]; stacked over r per in-unit MoE block.
    table_xs = None
    if m and tables[0] is not None:
        table_xs = tuple(stack(tables[q::m]) for q in range(m))
    # replays of unit r, MoE block q: row r * m + q, so [R * m, ...] -> [R, m, ...] per
    # micro-batch (None for a unit without MoE blocks: nothing to replay).
    replay_xs = None
    if m and replays is not None:
        replay_xs = tuple(r.reshape(repeats, m, *r.shape[1:]) for r in replays)
    next_attn, slots, attn_compute = None, None, None
    if delay_wgrad:
        end = s0 + u * repeats
        following = [s0 + (r + 1) * u if s0 + (r + 1) * u < end else end for r in range(repeats)]
        following = [i if i < cfg.num_layers else 0 for i in following]
        next_attn = stack([layers[i]["attn"] for i in following])
        attn_compute = compute and compute["layers"][0]["attn"]
        first = constrain_specs(layers[0]["attn"], attn_compute, mesh)  # its FSDP gather
        x, slots = zip(*(_wgrad.collect(xj, *_side(xj, first)) for xj in x), strict=True)

    def unit(carry, xs):
        x, slots = carry
        layers, table, nxt, replay = xs
        unit_stats = []
        for j in range(u):
            delay = delay_wgrad and j == u - 1
            is_moe = cfg.is_moe(s0 + j)
            fn = functools.partial(
                block,
                is_moe=is_moe,
                compute=unit_compute and unit_compute[j],
                next_compute=attn_compute if delay else None,
                window=cfg.window(s0 + j),
            )
            q = moe_in_unit.index(j) if is_moe else None
            x, s, _, out = fn(
                layers[j],
                x,
                None if table is None or q is None else table[q],
                slots if j == 0 else None,
                nxt if delay else None,
                None if replay is None or q is None else tuple(r[q] for r in replay),
            )
            if s is not None:
                unit_stats.append(s)
        stats = jax.tree.map(lambda *a: jnp.stack(a), *unit_stats) if unit_stats else None
        return (x, out if delay_wgrad else None), stats

    if policy is not None:
        unit = jax.checkpoint(unit, policy=policy)
    scanned = (stack(units), table_xs, next_attn, replay_xs)
    (x, slots), stats = jax.lax.scan(unit, (x, slots), scanned)
    if stats is not None:  # [R, m, ...] -> [R * m, ...]: the MoE layers in order
        stats = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stats)
    return x, stats, slots
