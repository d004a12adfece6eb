"""Delayed weight gradients: attention's dW computed while an MoE layer's all-to-all is in flight.

In the backward of block `l`, the attention projections' weight gradients `dW = x^T dy` have
their inputs early, a whole MoE layer before anything needs them, and nothing in the graph asks
XLA to compute them anywhere in particular. The MoE layer of block `l - 1`, next in the backward,
is where the step waits on all-to-alls; the transpose of its return exchange (the first
all-to-all of its backward) has nothing else to overlap with. Megatron-Core's
`--delay-wgrad-compute` fills the same gap. Three pieces move the GEMMs there; the numbers do
not change (each is the identity in the forward, and the backward computes the same einsum
transposes, only elsewhere):

- `project(spec, x, w, slot)`: `einsum(spec, x, w)` whose backward returns `dx` only, and hands
  `(x, dy)` back as the gradient of `slot` instead of computing `dW`.
- `collect(h, weights, templates)`, just before the exchange: creates the slots (zeros in the
  forward). In the backward it computes each `dW` from its `(x, dy)` and passes them through
  one `optimization_barrier` with the gradient of `h`, which the exchange's transpose returns:
  nothing reads that gradient until every `dW` is done.
- `hold(y, slots)`, just after the exchange: in the backward, the slots' `(x, dy)` pass a
  barrier with `y`'s gradient, the operand of the exchange's transpose, so no `dW` starts
  before that all-to-all can.

`around(exchange, x, side)` puts the three together. Inside the MoE layer's `shard_map`
(`moejax.parallel.moe_apply_sharded(..., wgrad=side)`) the exchange is the return all-to-all,
and each device computes its own tokens' part of `dW` (the caller's `jit` sums the parts, as it
sums any replicated weight's gradient). Where the layer has no all-to-all to bound them by,
`beside` hands the same slots over without bounds.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.vma import cast_varying, match_varying, varying_axes

# The attention projections whose weight gradients are delayed: their einsums, and which input
# each reads (q, k and v read the same one, so their gradients can stay one merged GEMM).
ATTENTION_SPECS: dict[str, str] = {
    "wq": "bsd,dhk->bshk",
    "wk": "bsd,dhk->bshk",
    "wv": "bsd,dhk->bshk",
    "wo": "bshk,hkd->bsd",
}
ATTENTION_INPUTS: dict[str, str] = {"wq": "h", "wk": "h", "wv": "h", "wo": "heads"}


class Template(NamedTuple):
    """The static shapes of one delayed projection: its einsum, the name of its input (shared
    by projections of the same input) and the shapes of its input `x` and output `y`."""

    name: str
    spec: str
    x_name: str
    x_shape: tuple[int, ...]
    x_dtype: str
    y_shape: tuple[int, ...]
    y_dtype: str

    def local(self, shards: int) -> Template:
        """The template of one of `shards` equal blocks of the leading (batch) axis."""
        x0, y0 = self.x_shape[0], self.y_shape[0]
        if x0 % shards or y0 % shards:
            raise ValueError(f"{self.name}: batch {x0} does not split over {shards} shards")
        return self._replace(
            x_shape=(x0 // shards, *self.x_shape[1:]), y_shape=(y0 // shards, *self.y_shape[1:])
        )


def slot_shapes(templates: tuple[Template, ...]) -> dict:
    """The slots' tree of `(shape, dtype)`: `{"x": {input name: ...}, "dy": {projection: ...}}`
    (one input slot per distinct input, one output slot per projection)."""
    return {
        "x": {t.x_name: (t.x_shape, t.x_dtype) for t in templates},
        "dy": {t.name: (t.y_shape, t.y_dtype) for t in templates},
    }


def is_shape(v) -> bool:
    """Whether `v` is one `(shape, dtype)` leaf of `slot_shapes`."""
    return isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], str)


def slot_of(slots: dict, name: str) -> tuple[bool, tuple]:
    """`(hands_back_x, slot)` of projection `name` (of `ATTENTION_SPECS`) for `project`: its
    input's slot and its output's; only the first reader of an input hands the input back (the
    others hand back zeros, so the input slot's gradient, their sum, is the input)."""
    x_name = ATTENTION_INPUTS[name]
    first = next(n for n, x in ATTENTION_INPUTS.items() if x == x_name)
    return name == first, (slots["x"][x_name], slots["dy"][name])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Delayed:
    """Weight gradients a layer computes in its backward on behalf of a later block: the
    weights (as that block uses them) and one `Template` per projection."""

    weights: dict  # name -> weight array
    templates: tuple[Template, ...] = dataclasses.field(metadata=dict(static=True))


def attention_side(h: jax.Array, weights: dict) -> Delayed:
    """The attention projections fed `h [B, S, D]` (the normalised residual stream; an MoE
    layer's input shares its shape and dtype), as a `Delayed`."""
    q = jax.eval_shape(functools.partial(jnp.einsum, ATTENTION_SPECS["wq"]), h, weights["wq"])
    inputs = {"h": h, "heads": jax.ShapeDtypeStruct(h.shape[:2] + weights["wo"].shape[:2], q.dtype)}
    templates = []
    for name, spec in ATTENTION_SPECS.items():
        x_name = ATTENTION_INPUTS[name]
        x = inputs[x_name]
        y = jax.eval_shape(functools.partial(jnp.einsum, spec), x, weights[name])
        templates.append(Template(name, spec, x_name, x.shape, str(x.dtype), y.shape, str(y.dtype)))
    return Delayed({name: weights[name] for name in ATTENTION_SPECS}, tuple(templates))


def around(exchange: Callable, x: jax.Array, side: Delayed | None):
    """`(exchange(x), slots)`, with `side`'s weight gradients computed inside the window of
    `exchange`'s transpose in the backward (`slots`: None without a side)."""
    if side is None:
        return exchange(x), None
    x, slots = collect(x, side.weights, side.templates)
    y = exchange(x)
    return hold(y, slots)


def _einsum_vjp(spec: str, x, w, dy, wrt: str):
    """The gradient of `einsum(spec, x, w)` with respect to `x` or `w` (`wrt`), as autodiff
    gives it."""
    if wrt == "x":
        _, vjp = jax.vjp(lambda x: jnp.einsum(spec, x, w), x)
    else:
        _, vjp = jax.vjp(lambda w: jnp.einsum(spec, x, w), w)
    return vjp(dy)[0]


def beside(layer: Callable, x: jax.Array, side: Delayed | None):
    """`(*layer(x), slots)`, for a `layer` returning `(y, *others)`, where the layer has no
    exchange to bound `side`'s weight gradients by (no expert all-to-all, a `model` split, one
    device): the slots work as with `around`, without the barriers.

    Bounding them around a whole layer would only move the GEMMs next to the layer's backward,
    with nothing to overlap them with; and the barrier on the input's gradient changes where
    XLA's partitioner sums that gradient's partial sums (from jax 0.11; measured with a `model`
    split under FSDP), so its last bits would differ from the undelayed step's. Unbounded, the
    gradients are bit-identical to the undelayed ones.
    """
    if side is None:
        return (*layer(x), None)
    x, slots = collect(x, side.weights, side.templates, False)
    y, *others = layer(x)
    y, slots = hold(y, slots, False)
    return (y, *others, slots)


def _bounded(a, b, bound: bool = True):
    """`(a, b)` through one `optimization_barrier` where they vary over the same manual axes
    (a barrier would make them alike, changing a cotangent's type) and `bound`; unchanged
    otherwise."""
    if not bound or varying_axes(a) != varying_axes(b):
        return a, b
    return jax.lax.optimization_barrier((a, b))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def project(spec: str, hands_back_x: bool, x: jax.Array, w: jax.Array, slot) -> jax.Array:
    """`einsum(spec, x, w)`; its backward leaves `dW` to `collect`, handing `(x, dy)` back
    through `slot = (x_slot, y_slot)` (`slot_of`; `x` as zeros unless `hands_back_x`)."""
    del slot
    return jnp.einsum(spec, x, w)


def _project_fwd(spec, hands_back_x, x, w, slot):
    del slot
    return jnp.einsum(spec, x, w), (x, w)


def _project_bwd(spec, hands_back_x, res, dy):
    x, w = res
    x_back = x if hands_back_x else jnp.zeros_like(x)
    return _einsum_vjp(spec, x, w, dy, wrt="x"), None, (x_back, dy)


project.defvjp(_project_fwd, _project_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def hold(y, slots: dict, bound: bool = True):
    """`(y, slots)` unchanged; see the module docstring for the backward (`bound=False`: no
    barrier, `beside`)."""
    return y, slots


def _hold_fwd(y, slots, bound):
    return (y, slots), None


def _hold_bwd(bound, _, cotangents):
    d_y, d_slots = cotangents
    return _bounded(d_y, d_slots, bound)


hold.defvjp(_hold_fwd, _hold_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def collect(h, weights: dict, templates: tuple[Template, ...], bound: bool = True):
    """`(h, slots)`: `h` unchanged and one zero `(x, y)` pair per template, varying like the
    weights; see the module docstring for the backward (`bound=False`: no barrier, `beside`)."""
    return h, _zero_slots(weights, templates)


def _zero_slots(weights, templates):
    axes = varying_axes(weights)
    zeros = lambda sd: cast_varying(jnp.zeros(*sd), axes)  # noqa: E731
    return jax.tree.map(zeros, slot_shapes(templates), is_leaf=is_shape)


def _collect_fwd(h, weights, templates, bound):
    return (h, _zero_slots(weights, templates)), weights


def _collect_bwd(templates, bound, weights, cotangents):
    d_h, d_slots = cotangents
    d_weights = {}
    for t in templates:
        x, dy = d_slots["x"][t.x_name], d_slots["dy"][t.name]
        w = weights[t.name]
        d_weights[t.name] = match_varying(_einsum_vjp(t.spec, x, w, dy, wrt="w"), w)
    return _bounded(d_h, d_weights, bound)


collect.defvjp(_collect_fwd, _collect_bwd)
