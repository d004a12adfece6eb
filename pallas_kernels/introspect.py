"""Which Pallas kernels a program runs: from its jaxpr for a given platform, or from the program
compiled for a GPU or TPU.

`backend="auto"` and `"pallas"` stage every platform's branch into the jaxpr and keep one at
lowering (`jax.lax.platform_dependent`), so "is there a `pallas_call` in the jaxpr" says nothing
about what runs. `kernel_calls(jaxpr, platform)` follows only the branches that platform keeps;
`compiled_kernel_calls(hlo_text)` reads the kernel calls of a compiled program.

>>> import jax, jax.numpy as jnp, pallas_kernels as pk
>>> f = lambda x, w, s: pk.gmm(x, w, s, backend="pallas")
>>> jaxpr = jax.make_jaxpr(f)(jnp.ones((8, 4)), jnp.ones((2, 4, 4)), jnp.array([4, 4]))
>>> [str(c) for c in kernel_calls(jaxpr, "cpu")], [str(c) for c in kernel_calls(jaxpr, "tpu")]
(['gmm/interpret'], ['gmm/mosaic'])
"""

from __future__ import annotations

import dataclasses
import re

import jax
from jax.extend import core as jex_core

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One `pallas_call` the program runs.

    Attributes:
      name: the kernel's name ("gmm", "gmm_t", "tgmm", "gather_gmm" for this package's).
      backend: "triton", "mosaic_gpu" (Hopper), "mosaic" (TPU) or "interpret" (any kernel in
        interpret mode).
    """

    name: str
    backend: str

    def __str__(self) -> str:
        return f"{self.name}/{self.backend}"


def _backend(params) -> str:
    if params.get("interpret"):
        return "interpret"
    module = type(params.get("compiler_params")).__module__
    if "mosaic_gpu" in module:
        return "mosaic_gpu"
    return "mosaic" if "mosaic" in module or ".tpu" in module else "triton"


# Primitives of a Pallas kernel in a jaxpr: `pallas_call`, and `mpmd_map` for `plgpu.kernel`
# (Mosaic GPU kernels with several warpgroups).
_KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")


def _kept_branch(branches_platforms, platform: str) -> int:
    for i, platforms in enumerate(branches_platforms):
        if platforms is None or platform in platforms:
            return i
    raise ValueError(f"no branch for platform {platform!r} in {branches_platforms}")


def kernel_calls(jaxpr, platform: str) -> list[KernelCall]:
    """The `pallas_call`s that lowering `jaxpr` for `platform` keeps, in program order.

    Args:
      jaxpr: a `ClosedJaxpr` or `Jaxpr` (e.g. from `jax.make_jaxpr`, or `jax.jit(f).trace(...)
        .jaxpr`).
      platform: one of `PLATFORMS`.

    Returns:
      One `KernelCall` per `pallas_call` equation reached: every sub-jaxpr is followed (jit,
      custom VJPs, loops, shard_map, cond branches), except that a platform-dependent cond
      contributes only the branch `platform` lowers.
    """
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    calls: list[KernelCall] = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _KERNEL_PRIMITIVES:
            calls.append(KernelCall(eqn.params.get("name") or "kernel", _backend(eqn.params)))
            continue
        branches_platforms = eqn.params.get("branches_platforms")
        if eqn.primitive.name == "cond" and branches_platforms is not None:
            kept = eqn.params["branches"][_kept_branch(branches_platforms, platform)]
            calls += kernel_calls(kept, platform)
            continue
        for sub in jex_core.jaxprs_in_params(eqn.params):
            calls += kernel_calls(sub, platform)
    return calls


def traced_kernel_calls(fn, *args, platform: str, **kwargs) -> list[KernelCall]:
    """`kernel_calls` of `jax.make_jaxpr(fn)(*args, **kwargs)` (args may be ShapeDtypeStructs)."""
    return kernel_calls(jax.make_jaxpr(fn)(*args, **kwargs), platform)


# A kernel call in compiled HLO: a custom call to Triton, Mosaic GPU or Mosaic (TPU) whose
# op_name metadata ends with "<kernel name>/pallas_call" ("/mpmd_map" for `plgpu.kernel`).
# Kernels without a name show their caller's scope there: "jit(flash_attention)", or a scope
# carrying its parameters ("flash_mha_bwd_dq_block_q=128_...").
_COMPILED_CALL = re.compile(
    r'custom_call_target="(__gpu\$xla\.gpu\.triton|mosaic_gpu(?:_v2)?|tpu_custom_call)".*?'
    r'op_name="(?:[^"]*/)?([^/"]+)/(?:pallas_call|mpmd_map)"'
)


_WRAPPED = re.compile(r"\w+\((.*)\)")  # a transformation's scope: jit(f), transpose(jvp(f))


def _kernel_name(scope: str) -> str:
    while m := _WRAPPED.fullmatch(scope):
        scope = m.group(1)
    if "=" in scope:  # a scope named after its parameters: keep the name before them
        scope = scope.split("=")[0].rsplit("_block", 1)[0]
    return scope


_COMPILED_BACKENDS = {
    "__gpu$xla.gpu.triton": "triton",
    "mosaic_gpu": "mosaic_gpu",
    "mosaic_gpu_v2": "mosaic_gpu",
    "tpu_custom_call": "mosaic",
}


def compiled_kernel_calls(hlo_text: str) -> list[KernelCall]:
    """The Pallas kernel calls in a compiled GPU or TPU program (`compiled.as_text()`), in
    schedule order."""
    calls = []
    for line in hlo_text.splitlines():
        if "custom-call(" in line and (m := _COMPILED_CALL.search(line)):
            calls.append(KernelCall(_kernel_name(m.group(2)), _COMPILED_BACKENDS[m.group(1)]))
    return calls
