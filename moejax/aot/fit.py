"""Will it fit? Compile a model's real train step for a GPU or TPU slice this machine does not
have, and read memory, FLOPs and a roofline bound from the compiled program.

A `Layout` is a mesh (named axes and sizes) plus the activation policy (`microbatches`,
`remat`; layers are always scanned). `plan_row` compiles `moejax.training.train_step` with the
state donated, exactly as `make_train_step` jits it, for a deviceless `Target`, and reports per
device:

- memory: `memory_analysis()`'s arguments + outputs + temporaries - aliased outputs, against the
  device's HBM (fits or by how much it does not);
- FLOPs: the model's (`metrics.flops_per_token`, PaLM's convention) and what the step executes
  with its remat policy (full remat runs the forward twice: 4/3 of the model's); XLA's own
  `cost_analysis()` figure is shown where the target gives one (TPU; a deviceless GPU compile
  gives none), but it counts each loop body once (scanned layers, micro-batches) and so
  undercounts;
- a compute roofline: the step takes at least executed FLOPs / peak FLOP/s, so MFU is at most
  model / executed FLOPs. Communication, HBM traffic and kernel efficiency are not in it: it
  bounds, it does not predict.

Used by `experiments/plan_scale.py`; the figures are in BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
import math

from moejax import hardware
from moejax.aot import hlo, programs
from moejax.models import LMConfig
from moejax.training._config import TrainConfig
from moejax.training.metrics import flops_per_token


@dataclasses.dataclass(frozen=True)
class Target:
    """A slice of accelerators to compile for.

    Attributes:
      name: e.g. "h100x64".
      device: the chip (`moejax.hardware`); its platform is the lowering platform.
      topology: the deviceless topology (`moejax.aot.mesh`): GPU "slices x hosts x devices per
        host", TPU "generation:shape".
      devices: devices in the slice.
    """

    name: str
    device: hardware.Device
    topology: str
    devices: int

    @property
    def platform(self) -> str:
        return self.device.platform

    @property
    def hbm_bytes(self) -> float:
        """Memory of one device."""
        return self.device.hbm_bytes

    @property
    def peak_flops(self) -> float:
        """Dense bf16 FLOP/s of one device."""
        return self.device.peak("bf16")


_H100, _V5P = hardware.H100_SXM, hardware.TPU_V5P
TARGETS: dict[str, Target] = {
    "h100x8": Target("h100x8", _H100, topology="1x1x8", devices=8),
    "h100x64": Target("h100x64", _H100, topology="1x8x8", devices=64),
    "v5p-64": Target("v5p-64", _V5P, topology="v5p:4x4x4", devices=64),
    "v5p-128": Target("v5p-128", _V5P, topology="v5p:4x4x8", devices=128),
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Mesh axes and sizes, micro-batches and remat policy of one training layout."""

    axes: tuple[tuple[str, int], ...]
    microbatches: int = 1
    remat: str = "full"

    @property
    def mesh_name(self) -> str:
        return "x".join(f"{name}{size}" for name, size in self.axes)

    def __str__(self) -> str:
        return f"{self.mesh_name} mb{self.microbatches} {self.remat}"


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One compiled layout (per-device figures)."""

    preset: str
    target: Target
    layout: Layout
    global_batch: int
    seq_len: int
    memory: dict
    compile_s: float
    xla_flops: float
    model_flops: float
    kernels: dict
    collectives: dict  # op name -> count in the compiled program (FSDP: all-gather, reduce-scatter)

    @property
    def total_bytes(self) -> int:
        m = self.memory
        return m["argument"] + m["output"] + m["temp"] - m["alias"]

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.target.hbm_bytes

    @property
    def executed_flops(self) -> float:
        """Model FLOPs plus the forward that full remat runs again (per device)."""
        return self.model_flops * (4 / 3 if self.layout.remat == "full" else 1.0)

    @property
    def step_time_bound_s(self) -> float:
        return self.executed_flops / self.target.peak_flops

    @property
    def mfu_bound(self) -> float:
        return self.model_flops / (self.step_time_bound_s * self.target.peak_flops)


def _mesh(target: Target, layout: Layout):
    """The deviceless mesh of `layout` on `target`."""
    names, sizes = zip(*layout.axes, strict=True)
    if math.prod(sizes) != target.devices:
        raise ValueError(f"layout {layout.mesh_name} has {math.prod(sizes)} devices, "
                         f"{target.name} has {target.devices}")  # fmt: skip
    return programs.mesh(target.platform, sizes, names, topology=target.topology)


def plan_row(
    preset: str, model_cfg: LMConfig, train_cfg: TrainConfig, target: Target, layout: Layout
) -> PlanRow:
    """Compile the train step of `model_cfg` with `layout` for `target` (see the module doc)."""
    cfg = train_cfg.replace(microbatches=layout.microbatches, remat=layout.remat, scan_layers=True)
    mesh = _mesh(target, layout)
    fn, args = programs.train_step_program(model_cfg, cfg, mesh)
    compiled = programs.compile_program(fn, args, donate_argnums=(0,))
    seq_len = cfg.seq_len or model_cfg.max_seq_len
    tokens = cfg.batch_size * seq_len / target.devices
    return PlanRow(
        preset=preset,
        target=target,
        layout=layout,
        global_batch=cfg.batch_size,
        seq_len=seq_len,
        memory=compiled.memory,
        compile_s=compiled.seconds,
        xla_flops=compiled.cost.get("flops", 0.0),
        model_flops=tokens * flops_per_token(model_cfg, seq_len),
        kernels=compiled.kernels,
        collectives={op: hlo.count_ops(compiled.text, op) for op in _COLLECTIVES},
    )


_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """The training state one device stores between steps, as laid out by
    `lm_partition_specs` on a layout's mesh: every parameter and Adam's two moments (in the
    parameter's dtype, or `TrainConfig.moment_dtype`), by block; gradients and activations,
    which live within the step, are not in it (the compiled `PlanRow` has them).

    Attributes:
      per_kind: bytes per device of one layer of each FFN kind (`"dense"`, `"moe"`): a
        layer-unit of the scanned stack.
      other: the embedding, the unembedding, the final norm and any MTP blocks.
    """

    per_kind: dict[str, int]
    other: int

    def at_depth(self, kinds: tuple[str, ...]) -> int:
        """Bytes per device of the model with the FFN kinds `kinds` (one per layer)."""
        return self.other + sum(self.per_kind[k] for k in kinds)


def state_bytes(
    model_cfg: LMConfig, target: Target, layout: Layout, moment_dtype: str | None = None
) -> StateBytes:
    """`StateBytes` of `model_cfg` on `layout` (no compile: shapes and partition specs only),
    Adam's moments in `moment_dtype` (None: each parameter's dtype)."""
    import jax
    import numpy as np

    from moejax.models import abstract_params, lm_partition_specs

    names, sizes = zip(*layout.axes, strict=True)
    if math.prod(sizes) != target.devices:
        raise ValueError(f"layout {layout.mesh_name} has {math.prod(sizes)} devices, "
                         f"{target.name} has {target.devices}")  # fmt: skip
    mesh = jax.sharding.AbstractMesh(tuple(sizes), tuple(names))
    specs = lm_partition_specs(model_cfg, mesh)
    axis = dict(layout.axes)

    def stored(leaf, spec) -> int:  # bytes of the leaf and its two moments on one device
        split = math.prod(
            axis[a]
            for entry in spec
            if entry
            for a in (entry if isinstance(entry, tuple) else (entry,))
        )
        moment = np.dtype(moment_dtype or leaf.dtype).itemsize
        return leaf.size * (leaf.dtype.itemsize + 2 * moment) // split

    def tree_bytes(tree, tree_specs) -> int:
        is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
        leaves = jax.tree.leaves(tree_specs, is_leaf=is_spec)
        return sum(map(stored, jax.tree.leaves(tree), leaves))

    params = abstract_params(model_cfg)
    layers = [tree_bytes(p, s) for p, s in zip(params["layers"], specs["layers"], strict=True)]
    rest = {k: v for k, v in params.items() if k != "layers"}
    other = tree_bytes(rest, {k: specs[k] for k in rest})
    per_kind = {}
    for kind, b in zip(model_cfg.mlp_kinds, layers, strict=True):
        per_kind.setdefault(kind, b)
    return StateBytes(per_kind, other)


def state_line(
    preset: str,
    model_cfg: LMConfig,
    target: Target,
    layout: Layout,
    full_depth=None,
    moment_dtype: str | None = None,
) -> str:
    """One line: the state per device of each layer kind of `model_cfg` on `layout` and,
    with `full_depth` (FFN kinds of the published model), the whole model's state against HBM;
    Adam's moments in `moment_dtype` (None: the parameters' dtype; the line says bf16)."""
    state = state_bytes(model_cfg, target, layout, moment_dtype)
    moments = "Adam moments" if moment_dtype is None else f"{moment_dtype} Adam moments"
    gib = 2**30
    kinds = ", ".join(f"{kind} layer {b / gib:.2f}" for kind, b in state.per_kind.items())
    line = (
        f"{preset} {target.name} {layout.mesh_name}: parameters + {moments} per device, GiB: "
        f"{kinds}, embeddings and head {state.other / gib:.2f}"
    )
    if full_depth is not None:
        total = state.at_depth(tuple(full_depth))
        counts = ", ".join(f"{full_depth.count(k)} {k}" for k in sorted(set(full_depth)))
        verdict = "fits" if total <= target.hbm_bytes else "does not fit"
        line += (
            f"; at the published {len(full_depth)} layers ({counts}): "
            f"{total / gib:.1f}/{target.hbm_bytes / gib:.1f} GiB {verdict}"
        )
    return line


def default_layouts(model_cfg: LMConfig, target: Target) -> list[Layout]:
    """The layouts a user would try on `target`: FSDP over what the expert axis leaves, the
    expert axis as wide as the experts allow within one node (8), 1, 2 or 4 micro-batches with
    full remat, and at 2 micro-batches: matmul outputs kept (`dots_saveable`), tensor
    parallelism over 2 devices, a twice wider expert axis."""
    n = target.devices
    expert = math.gcd(model_cfg.moe.num_experts, min(8, n))
    base = (("fsdp", n // expert), ("expert", expert))
    out = [Layout(base, microbatches, "full") for microbatches in (1, 2, 4)]
    out.append(Layout(base, 2, "dots_saveable"))
    if n // expert >= 2 and model_cfg.num_kv_heads % 2 == 0:
        out.append(Layout((("fsdp", n // expert // 2), ("expert", expert), ("model", 2)), 2))
    if model_cfg.moe.num_experts % (2 * expert) == 0 and n >= 2 * expert:
        out.append(Layout((("fsdp", n // (2 * expert)), ("expert", 2 * expert)), 2))
    return out


def markdown(rows: list[PlanRow]) -> str:
    """The rows as a BENCHMARKS.md table."""
    gib = 2**30
    lines = [
        "| preset | target | layout | global batch | args / out / temp GiB | total GiB / HBM "
        "| fits | compile s | model / executed / XLA TFLOP per device | step >= s | MFU <= |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r.memory
        lines.append(
            f"| {r.preset} | {r.target.name} | {r.layout} | {r.global_batch} x {r.seq_len} | "
            f"{m['argument'] / gib:.1f} / {m['output'] / gib:.1f} / {m['temp'] / gib:.1f} | "
            f"{r.total_bytes / gib:.1f} / {r.target.hbm_bytes / gib:.0f} | "
            f"{'yes' if r.fits else 'no'} | {r.compile_s:.0f} | {r.model_flops / 1e12:.0f} / "
            f"{r.executed_flops / 1e12:.0f} / {_tflop(r.xla_flops)} | "
            f"{r.step_time_bound_s:.2f} | {r.mfu_bound:.0%} |"
        )
    return "\n".join(lines)


def _tflop(flops: float) -> str:
    return f"{flops / 1e12:.1f}" if flops else "n/a"


def summary_line(rows: list[PlanRow]) -> str:
    """`<preset> <target> <mesh> mb<n> <remat> <total>/<HBM> GiB fits|does not fit`: the fitting
    layout with the best MFU bound, else the smallest."""
    fitting = [r for r in rows if r.fits]
    best = (
        max(fitting, key=lambda r: r.mfu_bound)
        if fitting
        else min(rows, key=lambda r: r.total_bytes)
    )
    verdict = "fits" if best.fits else "does not fit"
    return (
        f"{best.preset} {best.target.name} {best.layout.mesh_name} mb{best.layout.microbatches} "
        f"{best.layout.remat} {best.total_bytes / 2**30:.1f}/{best.target.hbm_bytes / 2**30:.1f} "
        f"GiB {verdict}"
    )
