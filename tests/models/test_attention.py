"""`causal_attention`: "xla" against a float64 numpy reference, the kernels against "xla"
(Triton interpreted; the Mosaic branch in the TPU interpreter), sharded against unsharded, and
which kernel each compile target keeps (jaxpr introspection, no compiler wheels needed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from moejax.models import _attention, apply_rope, attention, rope_tables
from moejax.models._attention import (
    MOSAIC_KERNELS,
    TRITON_KERNELS,
    causal_attention,
    mosaic_blocks,
    triton_blocks,
)
from moejax.parallel import make_mesh
from moejax.testing import assert_close
from pallas_kernels import introspect


def _normal(shape, seed, dtype=jnp.float32):
    """Inputs from numpy (jax.random would compile a threefry kernel per call site)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _qkv(b, s, h, hkv, dh, dtype=jnp.float32):
    shapes = [(b, s, h, dh), (b, s, hkv, dh), (b, s, hkv, dh)]
    return tuple(_normal(shape, seed, dtype) for seed, shape in enumerate(shapes))


def _vjp(fn, q, k, v, w):
    """(out, (dq, dk, dv)) of `fn` with output cotangent `w`, jitted."""

    def run(q, k, v, w):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(w.astype(out.dtype))

    return jax.jit(run)(q, k, v, w)


def _attention_np(q, k, v, w):
    """Forward and input gradients (output cotangent `w`) of causal GQA attention, float64."""
    q, k, v, w = (np.asarray(x, np.float64) for x in (q, k, v, w))
    b, s, h, dh = q.shape
    r = h // k.shape[2]
    out, dq, dk, dv = np.zeros(q.shape), np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    mask = np.tril(np.ones((s, s), bool))
    for bi in range(b):
        for head in range(h):
            g = head // r  # the kv head this query head reads
            qh, kh, vh, wh = q[bi, :, head], k[bi, :, g], v[bi, :, g], w[bi, :, head]
            scores = np.where(mask, qh @ kh.T / np.sqrt(dh), -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[bi, :, head] = p @ vh
            dp = wh @ vh.T
            ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(dh)
            dq[bi, :, head] = ds @ kh
            dk[bi, :, g] += ds.T @ qh
            dv[bi, :, g] += p.T @ wh
    return out, (dq, dk, dv)


def _pallas_names(jaxpr) -> set[str]:
    """Every pallas_call in `jaxpr`, all branches: its name, or its kernel function's name."""
    names = set()
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        if eqn.primitive.name == "pallas_call":
            names.add(eqn.params["name"] or eqn.params["jaxpr"].debug_info.func_name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names |= _pallas_names(sub)
    return names


def _grad_jaxpr(implementation, shapes, dtype=jnp.bfloat16, mesh=None):
    def loss(q, k, v):
        out = causal_attention(q, k, v, mesh=mesh, implementation=implementation)
        return jnp.sum(out.astype(jnp.float32))

    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args)


GQA = pytest.param(4, 2, id="gqa-h4-hkv2")
MHA = pytest.param(2, 2, id="mha-h2")


@pytest.mark.parametrize("h, hkv", [GQA, MHA])
def test_xla_matches_float64_reference(h, hkv):
    q, k, v = _qkv(2, 8, h, hkv, 8)
    w = _normal(q.shape, 3)
    fn = lambda q, k, v: causal_attention(q, k, v, implementation="xla")
    got = _vjp(fn, q, k, v, w)
    assert_close(got, _attention_np(q, k, v, w), np.float32)


def test_xla_is_the_layer_attention_core():
    """The LM layer's attention is its projections and RoPE around exactly this core."""
    d, h, hkv, dh, s = 16, 4, 2, 8, 6
    p = {
        "wq": _normal((d, h, dh), 0) / 4,
        "wk": _normal((d, hkv, dh), 1) / 4,
        "wv": _normal((d, hkv, dh), 2) / 4,
        "wo": _normal((h, dh, d), 3) / 4,
    }
    x = _normal((2, s, d), 4)
    cos, sin = rope_tables(s, dh, 100.0)

    def via_core(p, x):
        q = apply_rope(jnp.einsum("bsd,dhk->bshk", x, p["wq"]), cos, sin)
        k = apply_rope(jnp.einsum("bsd,dhk->bshk", x, p["wk"]), cos, sin)
        v = jnp.einsum("bsd,dhk->bshk", x, p["wv"])
        out = causal_attention(q, k, v, implementation="xla")
        return jnp.einsum("bshk,hkd->bsd", out, p["wo"])

    np.testing.assert_array_equal(jax.jit(via_core)(p, x), jax.jit(attention)(p, x, cos, sin))


@pytest.mark.parametrize(
    "h, hkv, dtype",
    [
        pytest.param(4, 2, jnp.float32, id="gqa-f32"),
        pytest.param(2, 2, jnp.float32, id="mha-f32"),
        pytest.param(4, 2, jnp.bfloat16, id="gqa-bf16"),
    ],
)
def test_pallas_interpreted_matches_xla(h, hkv, dtype):
    """On CPU "pallas" is jax's Triton kernel in interpret mode, forward and its VJP kernels."""
    q, k, v = _qkv(2, 32, h, hkv, 16, dtype)
    w = _normal(q.shape, 3, dtype)
    calls = introspect.kernel_calls(_grad_jaxpr("pallas", [q.shape, k.shape, v.shape]), "cpu")
    assert [c.name for c in calls] == list(TRITON_KERNELS)
    assert {c.backend for c in calls} == {"interpret"}
    got = _vjp(lambda q, k, v: causal_attention(q, k, v, implementation="pallas"), q, k, v, w)
    want = _vjp(lambda q, k, v: causal_attention(q, k, v, implementation="xla"), q, k, v, w)
    assert got[0].dtype == dtype and all(g.dtype == dtype for g in got[1])
    assert_close(got, want, dtype)


def test_mosaic_branch_in_the_tpu_interpreter_matches_xla():
    """The TPU branch (layout transposes, repeated kv heads, scale) run by the TPU interpreter."""
    q, k, v = _qkv(1, 128, 4, 2, 16)
    w = _normal(q.shape, 3)
    with pltpu.force_tpu_interpret_mode():
        got = _vjp(_attention._mosaic, q, k, v, w)
    want = _vjp(lambda q, k, v: causal_attention(q, k, v, implementation="xla"), q, k, v, w)
    assert_close(got, want, np.float32)


@pytest.mark.parametrize("implementation", ["xla", "pallas", "auto"])
@pytest.mark.parametrize(
    "shape, names",
    [
        pytest.param((2, 4), ("data", "expert"), id="data2-expert4"),
        pytest.param((2, 2, 2), ("data", "expert", "model"), id="data2-expert2-model2"),
    ],
)
def test_sharded_equals_unsharded(shape, names, implementation):
    mesh = make_mesh(shape, names)
    q, k, v = _qkv(8, 32, 4, 2, 16)
    w = _normal(q.shape, 3)
    fn = lambda mesh: (
        lambda q, k, v: causal_attention(q, k, v, mesh=mesh, implementation=implementation)
    )
    assert_close(_vjp(fn(mesh), q, k, v, w), _vjp(fn(None), q, k, v, w), np.float32)


def test_model_axis_must_divide_kv_heads():
    mesh = make_mesh((2, 2, 2), ("data", "expert", "model"))
    q, k, v = _qkv(4, 8, 2, 1, 8)
    with pytest.raises(
        ValueError, match=r"kv heads \(1; query heads 2\).* 2 devices of the 'model'"
    ):
        causal_attention(q, k, v, mesh=mesh)


def test_each_compile_target_keeps_its_kernel(monkeypatch):
    """With "auto" CPU keeps no kernel, GPU Triton's where cuDNN's does not run (here: made so;
    where it runs, tests/accelerator/test_deviceless_attention.py) and TPU Mosaic's; with
    "pallas" CPU runs the Triton kernel interpreted. Mosaic's calls are unnamed: `kernel_calls`
    lists them as "kernel", their kernel functions are `MOSAIC_KERNELS`."""
    monkeypatch.setattr(_attention, "cudnn_fits", lambda q, k: False)
    shapes = [(4, 128, 4, 128), (4, 128, 2, 128), (4, 128, 2, 128)]
    triton = [introspect.KernelCall(n, "triton") for n in TRITON_KERNELS]
    for mesh in (None, make_mesh((2, 2, 2), ("data", "expert", "model"))):
        jaxpr = _grad_jaxpr("auto", shapes, mesh=mesh)
        assert introspect.kernel_calls(jaxpr, "cpu") == []
        assert introspect.kernel_calls(jaxpr, "cuda") == triton
        assert introspect.kernel_calls(jaxpr, "rocm") == triton
        assert (
            introspect.kernel_calls(jaxpr, "tpu") == [introspect.KernelCall("kernel", "mosaic")] * 3
        )
        assert _pallas_names(jaxpr) == {*TRITON_KERNELS, *MOSAIC_KERNELS}
    pallas = _grad_jaxpr("pallas", shapes)
    assert introspect.kernel_calls(pallas, "cpu") == [
        introspect.KernelCall(n, "interpret") for n in TRITON_KERNELS
    ]
    assert introspect.kernel_calls(pallas, "cuda") == triton
    assert introspect.kernel_calls(_grad_jaxpr("xla", shapes), "cuda") == []


def test_shapes_a_kernel_cannot_tile_fall_back_to_xla():
    # 8 rows: below both kernels' blocks; 96: Triton's forward block (96) is not a power of two,
    # Mosaic's (128) does not divide it; Dh = 192: neither a power of two nor a multiple of 128.
    for s, dh in [(8, 16), (96, 16), (128, 192)]:
        jaxpr = _grad_jaxpr("auto", [(1, s, 2, dh), (1, s, 1, dh), (1, s, 1, dh)])
        assert _pallas_names(jaxpr) == set(), (s, dh)
    assert triton_blocks(4096, 128, jnp.bfloat16) == (128, 128)  # backward as wide (measured)
    assert triton_blocks(4096, 128, jnp.float32) == (64, 32)  # shared memory: 64 fp32 rows
    assert triton_blocks(32, 16, jnp.float32) == (32, 32)
    assert triton_blocks(8, 16, jnp.float32) is None
    assert triton_blocks(128, 80, jnp.float32) is None
    assert mosaic_blocks(4096, 128) == mosaic_blocks(128, 64) == 128
    assert mosaic_blocks(64, 128) is None and mosaic_blocks(128, 192) is None


def test_rejects_bad_arguments():
    q, k, v = _qkv(1, 8, 4, 2, 8)
    with pytest.raises(ValueError, match="implementation must be one of"):
        causal_attention(q, k, v, implementation="flash")
    with pytest.raises(ValueError, match=r"kv heads \(3\) must divide query heads \(4\)"):
        causal_attention(q, jnp.zeros((1, 8, 3, 8)), jnp.zeros((1, 8, 3, 8)))
    with pytest.raises(ValueError, match="batch 1 is not divisible by the 8 devices"):
        causal_attention(q, k, v, mesh=make_mesh((8,), ("data",)))


def test_cudnn_says_why_it_cannot_run_a_core():
    """cuDNN's flash attention takes 16-bit inputs only (and runs on NVIDIA GPUs only): fp32
    asks for it in vain, with the reason, on any machine."""
    q, k, v = _qkv(1, 128, 4, 2, 64)
    assert q.dtype == jnp.float32 and not _attention.cudnn_fits(q, k)
    with pytest.raises(ValueError, match=r"implementation='cudnn' cannot run q \(1, 128, 4, 64\)"):
        causal_attention(q, k, v, implementation="cudnn")
