"""Mesh conventions: the axes `data`, `fsdp`, `expert`, `model` and the MoE layer's specs.

Axes (`AXES`, in mesh order; any subset may be present; an absent axis has size 1):

- `data`: pure data parallelism. Tokens are split over it; parameters are replicated over it.
- `fsdp`: data parallelism with sharded parameters (ZeRO-3). Tokens are split over it as over
  `data`; the LM stores every weight's `D` dimension split over it (and over `expert` where the
  weight has no `E`), gathers each layer's weights before using them and reduce-scatters their
  gradients (`moejax.models.lm_partition_specs`). Inside the MoE layer it acts as `data`.
- `expert`: `N` devices. Tokens are split over it too (tokens over `("data", "fsdp", "expert")`),
  and the routed experts' `E` axis is split over it (`G = E / N` local experts per device).
- `model`: the routed experts' `F` axis (and the shared MLP's `Fs`) is split over it; tokens are
  replicated over it (Megatron-style tensor parallelism, partial sums by `psum`); in the LM also
  the attention heads and the dense MLP's width.

The MoE layer's parameter layout inside `moe_apply_sharded` (one layout for every dispatcher,
mode and pipeline degree; a stored layout that also splits `D` over `fsdp` is gathered to it at
the layer's boundary):

```
router/*                      replicated                 P()
experts/w_gate, w_up [E,D,F]  E over expert, F over model P("expert", None, "model")
experts/w_down [E,F,D]                                   P("expert", "model", None)
experts/b_gate, b_up [E,F]                               P("expert", "model")
experts/b_down [E,D]                                     P("expert", None)
shared/w_gate, w_up [D,Fs]    Fs over model              P(None, "model")
shared/w_down [Fs,D]                                     P("model", None)
shared/gate [D,1]             replicated                 P()
```

Activations `x [B, ..., D]` (or `[T, D]`): the leading axis over `("data", "fsdp", "expert")`.

>>> mesh = make_mesh((2, 4), ("data", "expert"))
>>> dict(mesh.shape)
{'data': 2, 'expert': 4}
>>> activation_spec(mesh, 3)
P(('data', 'expert'), None, None)
"""

from __future__ import annotations

import math

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from moejax._config import MoEConfig
from moejax._params import param_specs

DATA, FSDP, EXPERT, MODEL = "data", "fsdp", "expert", "model"
AXES: tuple[str, ...] = (DATA, FSDP, EXPERT, MODEL)
TOKEN_AXES: tuple[str, ...] = (DATA, FSDP, EXPERT)  # the batch is split over these, in order
_DEFAULT_NAMES = {1: (EXPERT,), 2: (DATA, EXPERT), 3: (DATA, EXPERT, MODEL)}
# Logical parameter axis (shape letter, see moejax._params) -> mesh axis.
_LOGICAL_TO_MESH = {"E": EXPERT, "F": MODEL, "Fs": MODEL}


def make_mesh(shape: tuple[int, ...], axis_names: tuple[str, ...] | None = None, *, devices=None):
    """A mesh with `Auto` axis types (`jax.make_mesh` defaults to Explicit axes, under
    which eager indexing of sharded arrays raises and shard_map does not reshard inputs).

    Args:
      shape: devices per axis, e.g. `(8,)`, `(2, 4)`, `(2, 2, 2)`.
      axis_names: a subset of `AXES` (`"data"`, `"fsdp"`, `"expert"`, `"model"`), in any
        order. Default by rank:
        `("expert",)`, `("data", "expert")`, `("data", "expert", "model")`.
      devices: optional device list (default: all devices).

    Returns:
      A `jax.sharding.Mesh`.
    """
    shape = tuple(shape)
    names = tuple(axis_names) if axis_names is not None else _DEFAULT_NAMES.get(len(shape))
    if names is None or len(names) != len(shape):
        raise ValueError(f"axis_names={axis_names!r}: need one name per mesh dim of {shape}")
    for name in names:
        if name not in AXES:
            raise ValueError(f"axis_names={names!r}: {name!r} is not one of {AXES}")
    if len(set(names)) != len(names):
        raise ValueError(f"axis_names={names!r}: repeated axis")
    need, have = math.prod(shape), len(devices) if devices is not None else jax.device_count()
    if need > have:
        raise ValueError(_too_few_devices(shape, need, have, devices is None))
    kw = {} if devices is None else {"devices": devices}
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), **kw)


def _too_few_devices(shape, need: int, have: int, all_devices: bool) -> str:
    """The error for a mesh of more devices than there are, with what to do about it."""
    msg = f"mesh shape {shape} needs {need} devices, "
    msg += f"{have} are available" if all_devices else f"devices= holds {have}"
    if all_devices and jax.default_backend() == "cpu":
        msg += (
            f"; on a CPU, simulate them: jax.config.update('jax_num_cpu_devices', {need}) right "
            f"after `import jax`, before any computation (or XLA_FLAGS="
            f"--xla_force_host_platform_device_count={need} before jax is imported)"
        )
    return msg


def axis_size(mesh, name: str) -> int:
    """Devices along `name` (1 when the mesh has no such axis)."""
    return dict(mesh.shape).get(name, 1)


def present(mesh, *names: str) -> tuple[str, ...]:
    """The axes among `names` that the mesh has, in the given order."""
    return tuple(n for n in names if n in mesh.axis_names)


def token_axes(mesh) -> tuple[str, ...]:
    """Mesh axes the token (leading) axis is split over: those of `TOKEN_AXES` present."""
    return present(mesh, *TOKEN_AXES)


def token_shards(mesh) -> int:
    """Number of token shards (`data` x `fsdp` x `expert` devices)."""
    size = 1
    for name in TOKEN_AXES:
        size *= axis_size(mesh, name)
    return size


def activation_spec(mesh, ndim: int) -> PartitionSpec:
    """`PartitionSpec` of an activation of rank `ndim`: leading axis over the token axes."""
    axes = token_axes(mesh)
    return PartitionSpec(axes or None, *([None] * (ndim - 1)))


def param_partition_specs(config: MoEConfig, mesh) -> dict:
    """The stored layout (module docstring) as a tree of `PartitionSpec`s, for `mesh`'s axes."""

    def spec(param_spec):
        names = [_LOGICAL_TO_MESH.get(a) for a in param_spec.axes]
        return PartitionSpec(*[n if n in mesh.axis_names else None for n in names])

    specs = param_specs(config)
    out = {g: {n: spec(s) for n, s in group.items()} for g, group in specs.items()}
    out["router"] = {n: PartitionSpec() for n in specs["router"]}  # replicated, whatever its E
    check_divisible(config, mesh)
    return out


def check_divisible(config: MoEConfig, mesh) -> None:
    """ValueError unless `E` divides over `expert` and `F` (and `Fs`) over `model`."""
    n, m = axis_size(mesh, EXPERT), axis_size(mesh, MODEL)
    if config.num_experts % n:
        raise ValueError(f"MoEConfig.num_experts={config.num_experts}: not divisible by expert={n}")
    if config.d_ff % m:
        raise ValueError(f"MoEConfig.d_ff={config.d_ff}: not divisible by model={m}")
    if config.shared_width % m:
        raise ValueError(f"shared width Fs={config.shared_width}: not divisible by model={m}")


def shard_params(params: dict, config: MoEConfig, mesh) -> dict:
    """`params` placed on `mesh` in the stored layout (`jax.device_put` with `NamedSharding`s)."""
    specs = param_partition_specs(config, mesh)
    return jax.tree.map(lambda p, s: jax.device_put(p, NamedSharding(mesh, s)), params, specs)


def shard_activations(x: jax.Array, mesh) -> jax.Array:
    """`x` placed with its leading axis over the token axes.

    Raises:
      ValueError: the leading axis does not divide over the token shards.
    """
    check_batch(x.shape, mesh)
    return jax.device_put(x, NamedSharding(mesh, activation_spec(mesh, x.ndim)))


def check_batch(shape: tuple[int, ...], mesh) -> None:
    """ValueError unless the leading axis of an activation of `shape` divides over the token
    shards (`token_shards`: the product of the `data`, `fsdp` and `expert` axes)."""
    shards = token_shards(mesh)
    if shape and shape[0] % shards:
        axes = " x ".join(f"{a}={axis_size(mesh, a)}" for a in token_axes(mesh))
        raise ValueError(
            f"x.shape[0]={shape[0]}: does not divide over the {shards} token shards of the mesh "
            f"({axes}); give a batch that is a multiple of {shards}"
        )
