"""Which attention core a compiled H100 (TPU v5e) program holds: cuDNN's (jax's Mosaic)
flash-attention kernel for plain causal layers, the XLA fallback for layers with attention sinks
or a sliding window, which the kernels lack (named scope `xla_attention_sinks_window` in the
compiled HLO's op metadata, no kernel call); and the one-line note saying so."""

import functools

import jax
import jax.numpy as jnp
import pytest
from _targets import CACHE_WARNING, needs_cuda, needs_tpu

from moejax import aot
from moejax.models import _attention, attention, init_lm_params, presets, rope_tables

pytestmark = [pytest.mark.deviceless, CACHE_WARNING]
S, DH = 128, 64  # shapes both kernels tile (triton_blocks, mosaic_blocks)
CFG = presets.get("micro").replace(num_heads=4, num_kv_heads=2, head_dim=DH, max_seq_len=S)
KERNEL = {"cuda": "dot_product_attention_fwd/cudnn", "tpu": "flash_attention/mosaic"}


def _compiled(platform, window, sinks):
    mesh = aot.mesh(platform, (1,), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    p = jax.eval_shape(lambda: init_lm_params(CFG, jax.random.key(0))["layers"][0]["attn"])
    if sinks:
        p = p | {"sinks": jax.ShapeDtypeStruct((CFG.num_heads,), jnp.float32)}
    p = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=sharding), p)
    x = jax.ShapeDtypeStruct((2, S, CFG.d_model), jnp.bfloat16, sharding=sharding)
    cos, sin = rope_tables(S, DH, CFG.rope_theta)
    fn = functools.partial(attention, cos=cos, sin=sin, window=window, implementation="auto")
    return aot.compile_program(lambda p, x: fn(p, x), (p, x))


@pytest.mark.parametrize(
    "platform",
    [pytest.param("cuda", marks=needs_cuda, id="h100"), pytest.param("tpu", marks=needs_tpu)],
)
@pytest.mark.parametrize(
    ("window", "sinks"),
    [(None, False), (16, False), (None, True)],
    ids=["plain", "window", "sinks"],
)
def test_compile_shows_the_kernel_or_the_xla_fallback(platform, window, sinks, capsys, monkeypatch):
    monkeypatch.setattr(_attention, "_NOTED", set())
    compiled = _compiled(platform, window, sinks)
    fallback = window is not None or sinks
    assert compiled.platform == platform
    assert (KERNEL[platform] in compiled.kernels) is not fallback, compiled.kernels
    assert ("xla_attention_sinks_window" in compiled.text) is fallback
    note = [line for line in capsys.readouterr().err.splitlines() if "XLA attention" in line]
    assert len(note) == int(fallback)
    if fallback:
        assert "xla_attention_sinks_window" in note[0] and "Triton" in note[0]
