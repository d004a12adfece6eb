"""The XLA:CPU fast path: permute, expert FFN and unpermute fused into one loop over row chunks.

`fused_moe(x, weight, layout, experts, config)` computes what `permute`, `grouped_ffn` and
`combine` compute together, `y[t] = sum_k weight[t, k] * ffn_{e(t, k)}(x[t])`, with one custom
VJP for the whole expert phase.

Why fused: on XLA:CPU a dropless layer built from separate phases is memory bound between its
matmuls. Each phase writes a full `[R, D]` or `[R, F]` array that the next one reads back, each
such array is a fresh allocation whose pages fault in on first touch (on this class of machine
that costs several times the copy itself), and a per-block grouped matmul re-slices its expert's
weights and read-modify-writes the weight gradient once per block. Here each chunk of rows is
gathered from `x`, pushed through the whole FFN while it is in cache, and scatter-added into `y`;
only the pre-activations (`[R, F]` each) are kept for the backward (as the dense FFN keeps them).

Layout: rows sorted by expert, unpadded (`make_layout(..., alignment=1)`). A `scan` visits the
experts in order; inside an expert a ladder of loops takes chunks of `sizes[0]` rows while that
many remain, then `sizes[1]`, ..., and the last loop takes `ceil(rest / sizes[-1])` chunks of
`sizes[-1]` rows, masking the rows past the expert's end (their token index becomes `T`, out of
range: gathers read zeros, scatters drop them). Large chunks give XLA large dots; the small last
size bounds the wasted rows to `sizes[-1] - 1` per expert, with no padding in the layout. (Merging
the gate and up projections into one `[D, 2F]` matmul, as XLA's dot merger does for a dense FFN,
measured slower here: the concatenated weights and their split gradients are fresh 32 MB arrays.)

Masked rows still write the pre-activation buffer (rows of the next expert, or `sizes[-1]` slack
rows past `R`); the next expert, processed later, overwrites them, so every real row holds its own
expert's values when the backward reads it. The backward runs the same ladder (in its last loop
the masked rows' pre-activations, another expert's, are replaced by zeros so that nothing, not even
a NaN, leaks across experts): per chunk it
recomputes the activation from the saved pre-activations, gathers `dy`, scatter-adds the input
gradient into `dx`, writes the routing-weight gradient `<h, dy @ W_down^T>` (no `[T, K, D]`
gather), and accumulates the expert's weight gradients in loop carries written once per expert.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moejax._config import MoEConfig
from moejax._experts import activate
from moejax._types import GroupedLayout

_DOT_T = (((1,), (1,)), ((), ()))  # lhs @ rhs.T
_DOT_TN = (((0,), (0,)), ((), ()))  # lhs.T @ rhs


def chunk_sizes(block: int, rows: int) -> tuple[int, ...]:
    """The chunk ladder: `(4 * block, block)`, without sizes longer than the layout's `rows`."""
    return tuple(s for s in (4 * block, block) if s <= rows) or (max(rows, 1),)


def fused_moe(
    x: jax.Array, weight: jax.Array, layout: GroupedLayout, experts: dict, config: MoEConfig
) -> jax.Array:
    """Dispatch, grouped expert FFN and weighted combine in one blocked loop (see module doc).

    Args:
      x: `[T, D]` tokens.
      weight: `[T, K]` combine weights (0 where an assignment is dropped); cast to `x.dtype`
        first, as `combine` does.
      layout: an unpadded `GroupedLayout` (`make_layout(..., alignment=1)`).
      experts: `experts/...` parameters (`w_gate`, `w_up [E, D, F]`, `w_down [E, F, D]`, biases).
      config: the layer config (activation, gating, biases, `block_size`).

    Returns:
      `y [T, D]` in `x.dtype`.
    """
    dtype = x.dtype
    names = ("gate", "up") if config.gated else ("up",)
    w_in = tuple(experts[f"w_{n}"].astype(dtype) for n in names)
    b_in = b_down = None
    if config.expert_bias:
        b_in = tuple(experts[f"b_{n}"].astype(dtype) for n in names)
        b_down = experts["b_down"].astype(dtype)
    sizes = chunk_sizes(config.block_size, layout.token_of_row.shape[0])
    weights = (w_in, b_in, experts["w_down"].astype(dtype), b_down)
    return _fused_ffn(x, weight.astype(dtype), layout, weights, config, sizes)


def _activation(config):
    """`h = act(*pre)`, `pre` = (gate, up) pre-activations when gated, else (up,)."""
    if config.gated:
        return lambda gate, up: activate(gate, up, config)
    return lambda up: activate(None, up, config)


def _ladder(count, sizes):
    """Trip counts of the chunk loops for an expert of `count` rows (the last one rounds up)."""
    trips, rest = [], count
    for size in sizes[:-1]:
        trips.append(rest // size)
        rest = rest % size
    trips.append((rest + sizes[-1] - 1) // sizes[-1])
    return trips


def _run_ladder(body, carry, start, count, sizes):
    """Run `body(size, row, end, carry) -> carry` over the chunks of one expert's rows.

    `end` is None except in the last loop, the only one whose chunks can run past the expert.
    """
    end, row = start + count, start
    for i, (size, trips) in enumerate(zip(sizes, _ladder(count, sizes), strict=True)):
        last = i == len(sizes) - 1

        def step(j, c, size=size, row=row, last=last):
            return body(size, row + j * size, end if last else None, c)

        carry = jax.lax.fori_loop(0, trips, step, carry)
        row = row + trips * size
    return carry


def _take(a, index):
    return jnp.take(a, index, axis=0, mode="fill", fill_value=0)


def _dot(a, b, dims=(((1,), (0,)), ((), ()))):
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.promote_types(a.dtype, "f4"))


class _Rows:
    """Per-row tables padded by `sizes[-1]` slack rows, and each expert's first row and count."""

    def __init__(self, x, weight, layout, sizes):
        t = x.shape[0]
        self.num_tokens = t
        self.token = jnp.pad(layout.token_of_row, (0, sizes[-1]), constant_values=t)
        self.weight = jnp.pad(_take(weight.reshape(-1), layout.assignment_of_row), (0, sizes[-1]))
        self.counts = layout.group_sizes
        self.starts = jnp.cumsum(self.counts) - self.counts

    def chunk(self, row, end, size):
        """Token (`T` at or past `end`, unless None) and routing weight of the rows
        `[row, row + size)`."""
        tok = jax.lax.dynamic_slice_in_dim(self.token, row, size)
        if end is not None:
            tok = jnp.where(row + jnp.arange(size) < end, tok, self.num_tokens)
        return tok, jax.lax.dynamic_slice_in_dim(self.weight, row, size)


def _in_proj(xc, wi, bi, dtype):
    """The input projections of a chunk, each `[size, F]` in `dtype`."""
    pre = tuple(_dot(xc, w).astype(dtype) for w in wi)
    return pre if bi is None else tuple(p + b for p, b in zip(pre, bi, strict=True))


def _forward(x, weight, layout, weights, config, sizes):
    w_in, _, _, _ = weights
    dtype, acc = x.dtype, jnp.promote_types(x.dtype, jnp.float32)
    rows = _Rows(x, weight, layout, sizes)
    act = _activation(config)

    def chunk(w, size, row, end, carry):
        y, pre = carry
        wi, bi, wd, bd = w
        tok, wr = rows.chunk(row, end, size)
        p = _in_proj(_take(x, tok), wi, bi, dtype)
        pre = tuple(
            jax.lax.dynamic_update_slice_in_dim(a, b, row, 0) for a, b in zip(pre, p, strict=True)
        )
        out = _dot(act(*p), wd).astype(dtype)
        if bd is not None:
            out = out + bd
        y = y.at[tok].add((out * wr[:, None]).astype(acc), mode="drop")
        return y, pre

    def expert(carry, xs):
        w, start, count = xs
        return _run_ladder(functools.partial(chunk, w), carry, start, count, sizes), None

    r, f = rows.token.shape[0], w_in[0].shape[-1]
    init = (jnp.zeros(x.shape, acc), tuple(jnp.zeros((r, f), dtype) for _ in w_in))
    (y, pre), _ = jax.lax.scan(expert, init, (weights, rows.starts, rows.counts))
    return y.astype(dtype), pre


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused_ffn(x, weight, layout, weights, config, sizes):
    """`y [T, D]`. `weights = (w_in, b_in, w_down [E, F, D], b_down [E, D] | None)` with `w_in`
    the gate and up (or up alone) `[E, D, F]` and `b_in` their `[E, F]` biases or None; all in
    `x.dtype`, as `weight [T, K]`."""
    return _forward(x, weight, layout, weights, config, sizes)[0]


def _fused_ffn_fwd(x, weight, layout, weights, config, sizes):
    y, pre = _forward(x, weight, layout, weights, config, sizes)
    return y, (x, weight, layout, weights, pre)


def _fused_ffn_bwd(config, sizes, res, dy):
    x, weight, layout, weights, pre = res
    dtype, acc = x.dtype, jnp.promote_types(x.dtype, jnp.float32)
    rows = _Rows(x, weight, layout, sizes)
    act = _activation(config)

    def chunk(w, size, row, end, carry):
        dx, dw_row, grads = carry
        wi, bi, wd, bd = w
        tok, wr = rows.chunk(row, end, size)
        xc, dyc = _take(x, tok), _take(dy, tok)
        p = tuple(jax.lax.dynamic_slice_in_dim(a, row, size) for a in pre)
        if end is not None:  # masked rows hold another expert's pre-activations: use zeros
            p = tuple(jnp.where((tok < rows.num_tokens)[:, None], a, 0) for a in p)
        h, act_vjp = jax.vjp(act, *p)
        dhu = _dot(dyc, wd, _DOT_T).astype(dtype)  # [size, F], before the routing weight
        # d weight = <out, dy> = <h, dy @ W_down^T> (+ <b_down, dy>): no [T, K, D] gather.
        dwr = jnp.sum((h * dhu).astype(acc), axis=-1)
        if bd is not None:
            dwr = dwr + _dot(dyc, bd, (((1,), (0,)), ((), ())))
        dw_row = jax.lax.dynamic_update_slice_in_dim(dw_row, dwr, row, 0)
        dp = act_vjp(dhu * wr[:, None])
        dxc = functools.reduce(jnp.add, (_dot(d, w_, _DOT_T) for d, w_ in zip(dp, wi, strict=True)))
        dx = dx.at[tok].add(dxc, mode="drop")
        dyw = dyc * wr[:, None]
        new = (tuple(_dot(xc, d, _DOT_TN) for d in dp), None, _dot(h, dyw, _DOT_TN), None)
        if bi is not None:
            db_in = tuple(jnp.sum(d.astype(acc), 0) for d in dp)
            new = (new[0], db_in, new[2], jnp.sum(dyw.astype(acc), 0))
        grads = jax.tree.map(jnp.add, grads, new)
        return dx, dw_row, grads

    def expert(carry, xs):
        w, start, count = xs
        grads = jax.tree.map(lambda v: jnp.zeros(v.shape, acc), w)
        dx, dw_row, grads = _run_ladder(
            functools.partial(chunk, w), (*carry, grads), start, count, sizes
        )
        return (dx, dw_row), grads

    init = (jnp.zeros(x.shape, acc), jnp.zeros(rows.token.shape, acc))
    (dx, dw_row), grads = jax.lax.scan(expert, init, (weights, rows.starts, rows.counts))
    r = layout.token_of_row.shape[0]
    d_weight = _take(dw_row[:r], layout.row_of_assignment).astype(weight.dtype)
    d_weights = jax.tree.map(lambda g, w: g.astype(w.dtype), grads, weights)
    return dx.astype(dtype), d_weight, None, d_weights


_fused_ffn.defvjp(_fused_ffn_fwd, _fused_ffn_bwd)
