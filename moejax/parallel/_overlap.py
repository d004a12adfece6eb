"""Putting the expert weight gradients inside the backward exchange's all-to-all window.

In the backward of `rows -> send (all-to-all) -> experts`, the experts' transpose produces the
received rows' gradient `dX` (which the send's transpose, an all-to-all, returns to the token
owners) and the weights' gradient `dW` (which nothing in the layer needs). Left alone, XLA may
compute `dW` before the all-to-all starts, or at the very end of the step; either way the
all-to-all has nothing to hide behind.

`tie(rows, experts)` is the identity in the forward, placed just before the send. Its
transpose meets the two cotangents this order produces, `dX` after the all-to-all and `dW`, and
passes them through one `optimization_barrier`: nothing may read the returned rows' gradient
until `dW` is computed, and `dW` does not wait for the all-to-all. The scheduler then has `dW`
to run between the all-to-all's start and its done, by construction rather than by luck. The
numbers are unchanged (the barrier is the identity). With the experts' widths split over
`model` the weights' gradients vary over an axis the rows' do not, and a barrier would have to
make them alike: that case is left to the scheduler.

The capacity dispatcher ties right before its all-to-all. The dropless dispatcher's padded send
gathers rows into its buffer before the all-to-all, so its transpose scatters them back after
it, and a tie before the gather would let XLA run a `dW` between the all-to-all's done and the
barrier; it ties inside its send's own VJP instead, right after the all-to-all
(`dispatch_dropless._send_tied`). The attention weights' gradients, delayed into the MoE
layer, use the same kind of barriers (`moejax._wgrad`).
"""

from __future__ import annotations

import jax

from pallas_kernels.vma import varying_axes


@jax.custom_vjp
def tie(rows, experts):
    """`(rows, experts)` unchanged; see the module docstring for what the backward does."""
    return rows, experts


def _tie_fwd(rows, experts):
    return (rows, experts), None


def _tie_bwd(_, cotangents):
    d_rows, d_experts = cotangents
    if any(varying_axes(w) != varying_axes(d_rows) for w in jax.tree.leaves(d_experts)):
        # Under shard_map a barrier makes its operands vary alike; weights split over `model`
        # vary where the rows do not, so pairing them would change the rows' type. Leave
        # this case to the scheduler.
        return d_rows, d_experts
    return jax.lax.optimization_barrier((d_rows, d_experts))


tie.defvjp(_tie_fwd, _tie_bwd)
