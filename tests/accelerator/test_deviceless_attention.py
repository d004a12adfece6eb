"""The attention core at the Mixtral shape (2 sequences of 4096 per device, 32 query / 8 kv heads
of 128, bf16), forward and backward, compiled for 8 x H100 and a TPU v5e slice on this CPU
machine: with `implementation="auto"` the compile target puts flash-attention kernels in the
program (cuDNN's on H100, jax's Mosaic kernels on TPU; `"pallas"` on H100: jax's Triton
kernels), and no device holds anything like the `[B, H, S, S]` fp32 scores the XLA core needs.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from _targets import CACHE_WARNING, needs_cuda, needs_tpu
from jax.sharding import NamedSharding, PartitionSpec

from moejax import aot
from moejax.aot import schedule
from moejax.models._attention import CUDNN_CALLS, TRITON_KERNELS, causal_attention
from pallas_kernels import introspect

pytestmark = [pytest.mark.deviceless, CACHE_WARNING]
PLATFORMS = [
    pytest.param("cuda", id="h100", marks=needs_cuda),
    pytest.param("tpu", id="v5e", marks=needs_tpu),
]
DEVICES, B, S, H, HKV, DH = 8, 2, 4096, 32, 8, 128  # B: sequences per device
SCORES_BYTES = B * H * S * S * 4  # one device's fp32 scores: 4 GiB
# The kernels in the compiled program, by the last name in their op_name before "pallas_call".
# Mosaic's are unnamed: the forward is under jax's `jit(flash_attention)`, the backward ones
# under named scopes that carry their block sizes.
COMPILED = {
    "cuda": list(TRITON_KERNELS),
    "tpu": ["flash_attention", "flash_mha_bwd_dkv", "flash_mha_bwd_dq"],
}
_KERNEL_CALL = re.compile(
    r'custom_call_target="(?:__gpu\$xla\.gpu\.triton|tpu_custom_call)".*?'
    r'op_name="(?:[^"]*/)?([^"/]+)/pallas_call"'
)


def _compiled_kernels(hlo_text: str) -> list[str]:
    """The Pallas kernel calls of a compiled program, in schedule order, named as in COMPILED."""
    names = []
    for line in hlo_text.splitlines():
        if "custom-call(" in line and (m := _KERNEL_CALL.search(line)):
            name = re.sub(r"^jit\((.*)\)$", r"\1", m.group(1))
            names.append(re.sub(r"_block_.*$", "", name))
    return names


@functools.cache
def _compile(platform, implementation):
    mesh = aot.mesh(platform, (DEVICES,), ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    args = [
        jax.ShapeDtypeStruct((DEVICES * B, S, heads, DH), jnp.bfloat16, sharding=rows)
        for heads in (H, HKV, HKV)
    ]

    def fn(q, k, v):
        def loss(q, k, v):
            out = causal_attention(q, k, v, mesh=mesh, implementation=implementation)
            return jnp.sum(out.astype(jnp.float32) ** 2)

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return aot.compile_program(fn, args)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_flash_attention_compiles_with_its_kernels_in_bounded_memory(platform):
    compiled = _compile(platform, "auto")
    if platform == "cuda":  # cuDNN's flash attention, forward and backward; no Pallas kernel
        assert compiled.kernels == {f"{name}/cudnn": 1 for name in CUDNN_CALLS.values()}
        assert introspect.compiled_kernel_calls(compiled.text) == []
    else:
        assert _compiled_kernels(compiled.text) == COMPILED[platform]
    assert 0 < compiled.memory["temp"] < SCORES_BYTES / 4


@needs_cuda
def test_pallas_on_h100_compiles_jax_triton_flash_attention_in_bounded_memory():
    compiled = _compile("cuda", "pallas")
    assert _compiled_kernels(compiled.text) == COMPILED["cuda"]
    assert introspect.compiled_kernel_calls(compiled.text) == [  # Triton's calls are named
        introspect.KernelCall(name, "triton") for name in TRITON_KERNELS
    ]
    assert 0 < compiled.memory["temp"] < SCORES_BYTES / 4


@needs_cuda
def test_the_schedule_model_costs_cudnn_attention_as_its_causal_products():
    """Forward: `Q K^T` and `P V`; backward: five products; each over the causal half of one
    device's `[B, H, S, S]` scores, `Dh` deep, at the bf16 rate."""
    ops = [o for o in schedule.parse(_compile("cuda", "auto").text) if o.flops]
    half_scores = B * H * S * S * DH / 2
    assert {o.name.split(".")[0]: o.flops for o in ops} == {
        "dot_product_attention_fwd": 2 * 2 * half_scores,
        "dot_product_attention_bwd": 2 * 5 * half_scores,
    }
    assert {o.dtype for o in ops} == {"bf16"}


@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_xla_core_for_the_same_target_holds_the_scores(platform):
    """What the kernels save: the reference core's temporaries exceed a device's fp32 scores."""
    compiled = _compile(platform, "xla")
    assert _compiled_kernels(compiled.text) == []
    assert compiled.memory["temp"] > SCORES_BYTES
