"""What differs in Mosaic GPU between jax 0.10.2, 0.11 and 0.12, in one place.

* `interpret_params`: the Mosaic GPU interpreter's parameters, `plgpu.InterpretGPUParams`
  from jax 0.11, a private module in 0.10.
* `kernel`: `plgpu.kernel`, passing a `pl.CostEstimate` where jax takes one (0.11+).
* `races_found`: the interpreter's race detector, read the same way in every version.
* `load`, `layout_cast`: `plgpu.load(ref, layout=)` (an index argument required in jax 0.10,
  deprecated in 0.11, gone in 0.12) and
  `plgpu.layout_cast`, read as plain values under jax 0.10's interpreter, which has no rule
  for either.
* `WGMMA_MIXES_FP8`: whether wgmma takes an e4m3 operand with an e5m2 one (jax 0.11+).
* `LOADS_TRANSPOSED`: whether a swizzled shared-memory tile loads transposed (jax 0.11+).
* jax 0.10's interpreter cannot read a transposed wgmma operand (`ref.T`: the dlhs kernel's
  weights, both tgmm operands); `_install_transposed_wgmma_fix` teaches it, as 0.11 does.
"""

from __future__ import annotations

import inspect

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def interpret_params(**kwargs):
    """`plgpu.InterpretGPUParams(**kwargs)`: the Mosaic GPU interpreter (CPU), simulating
    warpgroups, barriers, TMA and wgmma (`detect_races=True` checks shared-memory races)."""
    cls = getattr(plgpu, "InterpretGPUParams", None)
    if cls is None:  # jax 0.10
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
    return cls(**kwargs)


def interpret_mode(interpret):
    """A Mosaic GPU kernel's `interpret` from its caller's: False (compile), or the Mosaic GPU
    interpreter's params as given (`InterpretGPUParams`), or True for its defaults (other
    interpreters' params mean those too)."""
    if not interpret:
        return False
    return interpret if type(interpret).__name__ == "InterpretGPUParams" else True


_TAKES_COST = "cost_estimate" in inspect.signature(plgpu.kernel).parameters


def kernel(body, *, cost_estimate: pl.CostEstimate, **kwargs):
    """`plgpu.kernel(body, **kwargs)` with the cost estimate where jax accepts one."""
    if _TAKES_COST:
        kwargs["cost_estimate"] = cost_estimate
    return plgpu.kernel(body, **kwargs)


_LOAD_INDEX = inspect.signature(plgpu.load).parameters.get("idx")
_LOAD_TAKES_INDEX = _LOAD_INDEX is not None  # jax 0.10 and 0.11
# jax 0.10 requires the index; 0.11 deprecates it (a warning per call) and 0.12 removed it.
_LOAD_NEEDS_INDEX = _LOAD_TAKES_INDEX and _LOAD_INDEX.default is inspect.Parameter.empty


def load(ref, *, layout, interpret: bool = False):
    """`plgpu.load` of the whole of `ref` into registers in `layout`. jax 0.10's interpreter
    cannot evaluate `plgpu.load` (its abstract eval wants a ref where the interpreter passes
    values); a plain read gives the same values there (layouts are a compiled-kernel notion)."""
    if _LOAD_TAKES_INDEX and interpret:
        return ref[...]
    if _LOAD_NEEDS_INDEX:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def layout_cast(x, layout, *, interpret: bool = False):
    """`plgpu.layout_cast(x, layout)`; `x` itself under jax 0.10's interpreter, which has no
    rule for it (the same values: see `load`)."""
    if interpret and _LOAD_TAKES_INDEX:
        return x
    return plgpu.layout_cast(x, layout)


# jax 0.10's Mosaic GPU cannot load a swizzled shared-memory tile transposed into registers
# ("Can't transpose the swizzled dimension"); 0.11 and 0.12 can (fp8_quantizers.quantize_both).
LOADS_TRANSPOSED = jax.__version_info__ >= (0, 11)


def _wgmma_mixes_fp8() -> bool:
    from jax._src.pallas.mosaic_gpu import primitives

    return "fp8_dtypes" in inspect.getsource(primitives.wgmma)


WGMMA_MIXES_FP8 = _wgmma_mixes_fp8()


def _install_transposed_wgmma_fix() -> bool:
    """Replaces jax 0.10's interpreted wgmma with one that reads operands transposed by
    trailing `ref.T` / `ref.transpose` (the 0.11 interpreter does the same through its
    `access` of a buffer). Returns False, changing nothing, on jax >= 0.11 (not needed) or
    where the 0.10 internals are laid out otherwise."""
    try:
        import numpy as np
        from jax._src.pallas.mosaic.interpret import utils as interpret_utils
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb
        from jax._src.state import types as state_types

        original = cb.wgmma
        params = inspect.signature(original).parameters
    except (ImportError, AttributeError, ValueError):
        return False
    if "device_id" not in params or "acc_dtype" not in params:  # not the 0.10 callback
        return False

    def split(transforms):
        """(transforms without trailing transposes, the permutation they make, or None)."""
        transforms = jax.tree.map(int, cb._remove_noop_transforms(tuple(transforms)))
        perm = None
        while transforms and isinstance(transforms[-1], state_types.TransposeTransform):
            step = tuple(int(p) for p in transforms[-1].permutation)
            perm = step if perm is None else tuple(perm[p] for p in step)
            transforms = transforms[:-1]
        return transforms, perm

    def wgmma(*, a_transforms, b_transforms, **kwargs):
        a_transforms, a_perm = split(a_transforms)
        b_transforms, b_perm = split(b_transforms)
        if a_perm is None and b_perm is None:
            return original(a_transforms=a_transforms, b_transforms=b_transforms, **kwargs)
        device_id, thread_id = int(kwargs["device_id"]), int(kwargs["thread_id"])
        coords = tuple(int(x) for x in kwargs["grid_point_coords"])
        memory = cb._get_shared_memory()
        thread = memory.get_global_thread_id(device_id, thread_id)
        info = interpret_utils.GPULoggingInfo(
            device_id=device_id,
            grid_point_coords=coords,
            thread_id=thread_id,
            source_info=kwargs.get("source_info"),
        )

        def read(key, transforms, perm):
            key = cb.HostAllocationKey.from_array(key)
            rnge = interpret_utils.to_range(transforms)
            value, _, _ = memory.get_buffer_content(key, rnge, thread, logging_info=info)
            return key, rnge, value if perm is None else np.transpose(value, perm)

        _, _, a = read(kwargs["a_allocation_key_as_array"], a_transforms, a_perm)
        _, _, b = read(kwargs["b_allocation_key_as_array"], b_transforms, b_perm)
        acc_transforms, _ = split(kwargs["acc_transforms"])
        key, rnge, acc = read(kwargs["acc_allocation_key_as_array"], acc_transforms, None)
        out = acc + np.matmul(a, b, dtype=kwargs["acc_dtype"])
        memory.store_buffer_content(key, rnge, out, thread, logging_info=info)
        return kwargs["token"]

    cb.wgmma = wgmma
    return True


TRANSPOSED_WGMMA_FIX_INSTALLED = _install_transposed_wgmma_fix()


def races_found() -> bool:
    """Whether the last Mosaic GPU interpretation with `detect_races=True` saw a shared-memory
    race (jax 0.11+ also raises on one by default)."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    races = interpret_pallas_call.get_races()
    return bool(races is not None and races.races_found)
