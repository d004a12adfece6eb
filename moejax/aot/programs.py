"""The programs users run on accelerators, compiled for GPU and TPU meshes without the hardware.

The sharded MoE layer's forward and backward (`layer_program`) and the LM train step
(`train_step_program`), lowered with `jax.ShapeDtypeStruct`s on a deviceless H100 or TPU mesh
(`mesh`) and compiled by the real XLA:GPU / XLA:TPU pipelines on a CPU host (`compile_program`).
The compiled program says which kernels run (`kernel_counts`), what the scheduler did
(`Compiled.text`) and what fits (`Compiled.memory`, XLA's `memory_analysis()` per device).
"""

from __future__ import annotations

import dataclasses
import re
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from pallas_kernels import introspect, targets

KERNEL_NAMES = ("gmm", "gmm_t", "tgmm", "gather_gmm")


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One deviceless compile.

    Attributes:
      platform: "cuda" or "tpu".
      seconds: lowering plus compile wall time.
      text: the compiled (optimized, scheduled) HLO.
      memory: `memory_analysis()` fields in bytes per device (arguments, outputs, temporaries,
        aliased: outputs written into donated arguments).
      kernels: `"name/backend"` -> count of this package's Pallas kernels in the program.
      cost: `cost_analysis()` of the per-device program: `flops`, `bytes accessed`.
    """

    platform: str
    seconds: float
    text: str
    memory: dict
    kernels: dict
    cost: dict = dataclasses.field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs + temporaries - aliased: what one device must hold."""
        m = self.memory
        return m["argument"] + m["output"] + m["temp"] - m["alias"]


def mesh(platform: str, shape, axis_names, *, topology: str | None = None, generation=None):
    """A deviceless mesh (compile only) of `shape` with `axis_names`.

    Args:
      platform: "cuda" (H100s) or "tpu".
      shape, axis_names: the mesh's axis sizes and names.
      topology: the deviceless slice (`pallas_kernels.targets`): GPU "slices x hosts x devices
        per host" (default: one host of `prod(shape)` GPUs), TPU "generation:shape" such as
        "v5p:4x4x4" (default: the 8-chip slice of `generation`).
      generation: TPU only, without `topology`: "v5e" (default), "v5p", "v6e" or "v4".

    Returns:
      A `jax.sharding.Mesh` of the slice's first `prod(shape)` devices.
    """
    if platform == "cuda":
        if generation is not None:
            raise ValueError(f"generation is for TPU meshes, got {generation!r} for 'cuda'")
        return targets.gpu_mesh(shape, axis_names, topology=topology)
    if platform == "tpu":
        return targets.tpu_mesh(shape, axis_names, generation or "v5e", topology=topology)
    raise ValueError(f"platform must be 'cuda' or 'tpu', got {platform!r}")


def platform_of(mesh_) -> str:
    """The lowering platform of a mesh's devices ("cpu", "cuda", "tpu", ...)."""
    platform = mesh_.devices.flat[0].platform
    return "cuda" if platform == "gpu" else platform


_CUSTOM_CALL_TARGET = re.compile(r'custom-call\(.*custom_call_target="([^"]+)"')


def kernel_counts(hlo_text: str) -> dict[str, int]:
    """`"name/backend"` -> count of every Pallas kernel in a compiled program
    (`pallas_kernels.introspect.compiled_kernel_calls`): the grouped matmuls (`KERNEL_NAMES`)
    and the attention kernels alike; and cuDNN's flash attention, as
    `"dot_product_attention_fwd/cudnn"` and `"..._bwd/cudnn"`."""
    from moejax.models._attention import CUDNN_CALLS

    counts: dict[str, int] = {}
    for call in introspect.compiled_kernel_calls(hlo_text):
        counts[str(call)] = counts.get(str(call), 0) + 1
    for target in _CUSTOM_CALL_TARGET.findall(hlo_text):
        if target in CUDNN_CALLS:
            name = f"{CUDNN_CALLS[target]}/cudnn"
            counts[name] = counts.get(name, 0) + 1
    return counts


def grouped_matmuls(counts: dict) -> dict:
    """The grouped-matmul entries (`KERNEL_NAMES`) of `kernel_counts`."""
    return {k: v for k, v in counts.items() if k.split("/")[0] in KERNEL_NAMES}


def compile_program(
    fn, args, *, donate_argnums=(), compiler_options: dict | None = None
) -> Compiled:
    """Lower `jax.jit(fn)` on abstract `args` (placed on a deviceless mesh) and compile it;
    `donate_argnums` as for `jax.jit` (a train step donates its state: outputs alias it)."""
    mesh_ = jax.tree.leaves(args)[0].sharding.mesh
    platform = platform_of(mesh_)
    start = time.perf_counter()
    with targets.lowering(mesh_):
        lowered = jax.jit(fn, donate_argnums=donate_argnums).lower(*args)
    compiled = lowered.compile(compiler_options or {})
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    memory = {
        key: int(getattr(stats, f"{key}_size_in_bytes", 0) or 0)
        for key in ("argument", "output", "temp", "alias", "generated_code")
    }
    text = compiled.as_text()
    analysis = compiled.cost_analysis() or {}
    cost = {k: float(analysis.get(k, 0.0)) for k in ("flops", "bytes accessed")}
    return Compiled(platform, seconds, text, memory, kernel_counts(text), cost)


def _placed(tree, shardings):
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def layer_program(config, mesh_, strategy, *, tokens: int, seq_len: int = 512, dtype=jnp.bfloat16):
    """`(fn, args)`: forward and backward of `moe_apply_sharded` (implementation "auto", so the
    compile target picks the kernels) on `tokens` tokens of `seq_len` per sequence."""
    import moejax
    from moejax import parallel

    specs = parallel.param_partition_specs(config, mesh_)
    shapes = jax.eval_shape(lambda: moejax.init_moe_params(config, jax.random.key(0)))
    params = _placed(shapes, jax.tree.map(lambda s: NamedSharding(mesh_, s), specs))
    x_sharding = NamedSharding(mesh_, parallel.activation_spec(mesh_, 3))
    x = jax.ShapeDtypeStruct(
        (tokens // seq_len, seq_len, config.d_model), dtype, sharding=x_sharding
    )

    def fn(params, x):
        def loss(params, x):
            y, aux = parallel.moe_apply_sharded(params, x, config, mesh_, strategy=strategy)
            return jnp.sum(y.astype(jnp.float32) ** 2) + aux.load_balance_loss

        return jax.grad(loss, argnums=(0, 1))(params, x)

    return fn, (params, x)


def train_step_program(model_cfg, train_cfg, mesh_, *, strategy="auto", batch_split: int = 1):
    """`(fn, args)`: the LM train step (`moejax.training.train_step`, implementation "auto") on
    an abstract state and batch placed on `mesh_` (`strategy` and `batch_split` as there); the
    batch is `[batch_size, S + 1]` tokens, `S = train_cfg.seq_len or model_cfg.max_seq_len`."""
    import functools

    from moejax import training
    from moejax.training import state as state_lib

    step = functools.partial(
        training.train_step,
        model_cfg=model_cfg,
        train_cfg=train_cfg,
        mesh=mesh_,
        strategy=strategy,
        implementation="auto",
        batch_split=batch_split,
    )
    state = _placed(
        state_lib.abstract_state(model_cfg, train_cfg),
        state_lib.state_shardings(model_cfg, train_cfg, mesh_),
    )
    batch = jax.ShapeDtypeStruct(
        (train_cfg.batch_size, (train_cfg.seq_len or model_cfg.max_seq_len) + 1),
        jnp.int32,
        sharding=state_lib.batch_sharding(mesh_),
    )
    return step, (state, batch)
