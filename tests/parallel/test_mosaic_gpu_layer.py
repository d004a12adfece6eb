"""The MoE layer, the sharded layer and one micro LM train step on the Mosaic GPU kernels, equal
to the XLA `blocked` path.

On CPU `implementation="pallas"` runs the Triton kernels in interpret mode; an H100 compiles the
Mosaic GPU kernels instead, with experts padded to their row tile by the permute phase
(`pallas_kernels.group_alignment()`). The `mosaic_gpu_kernels` fixture (tests/conftest.py)
makes this CPU run the H100 path: the Mosaic GPU kernels in their interpreter, experts padded
to the test tiles' 64 rows. The default run keeps the forward; gradients are `slow` (~70 s on
jax 0.10), as is the micro LM train step (tests/training/test_mosaic_gpu_step.py). bf16
(the kernels' operand type) on both sides: each expert matmul rounds its fp32 accumulator to
bf16, and the two paths sum in different orders, so results agree to bf16's rounding (one ulp
of the largest value, `assert_close` at bf16 tolerance), not bit for bit.

One device: the Mosaic GPU interpreter cannot interpret these kernels on several devices at
once (see tests/pallas_kernels/test_pk_mosaic_gpu.py); the sharded layer's multi-device
programs are compiled for 8 H100s in tests/accelerator/test_deviceless_layer.py.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import DROPLESS, make_params

import moejax
from moejax import parallel
from moejax.testing import kernels_run

CFG = DROPLESS.replace(param_dtype="bfloat16", num_experts=4)  # few tiles: interpreting is slow


def _mosaic_kernels(fn, *args) -> collections.Counter:
    """Kernel names of the Mosaic GPU kernels (`plgpu.kernel`: `mpmd_map`) `fn` runs on CPU."""
    from jax.extend import core as jex_core

    def walk(jaxpr):
        for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
            if eqn.primitive.name == "mpmd_map":
                yield eqn.params["name"]
            for sub in jex_core.jaxprs_in_params(eqn.params):
                yield from walk(sub)

    return collections.Counter(walk(jax.make_jaxpr(fn)(*args)))


def _loss_and_grads(apply):
    def f(params, x):
        y, aux = apply(params, x)
        w = jnp.sin(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
        return jnp.sum(y.astype(jnp.float32) * w) + 0.1 * aux.load_balance_loss, y

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))


def _close(a, b, what):
    """Elementwise within one bf16 rounding of the largest value (see the module docstring)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = max(float(np.abs(y).max(initial=0.0)), 1e-30)
        tol = 2 * float(jnp.finfo(jnp.bfloat16).eps)
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol * scale, err_msg=what)


def _inputs():
    return jax.random.normal(jax.random.key(1), (4, 8, 16), jnp.bfloat16)


def test_layer_forward_matches_blocked(mosaic_gpu_kernels):
    params, x = make_params(CFG), _inputs()
    apply = {
        impl: jax.jit(lambda p, x, impl=impl: moejax.moe_apply(p, x, CFG, implementation=impl))
        for impl in ("pallas", "blocked")
    }
    assert _mosaic_kernels(apply["pallas"], params, x) == {"gmm": 3}  # gate, up, down
    (y, aux), (y0, aux0) = apply["pallas"](params, x), apply["blocked"](params, x)
    _close(y, y0, "y")
    _close(aux, aux0, "aux")


@pytest.mark.slow
def test_layer_matches_blocked(mosaic_gpu_kernels):
    params, x = make_params(CFG), _inputs()
    apply = {
        impl: _loss_and_grads(
            lambda p, x, impl=impl: moejax.moe_apply(p, x, CFG, implementation=impl)
        )
        for impl in ("pallas", "blocked")
    }
    assert _mosaic_kernels(apply["pallas"], params, x) == {"gmm": 3, "gmm_t": 3, "tgmm": 3}
    assert kernels_run(apply["blocked"], params, x, platform="cpu") == []
    (loss, y), grads = apply["pallas"](params, x)
    (loss0, y0), grads0 = apply["blocked"](params, x)
    _close(y, y0, "y")
    _close(grads, grads0, "grads")


@pytest.mark.slow
def test_sharded_layer_on_one_device_matches_blocked(mosaic_gpu_kernels):
    """`moe_apply_sharded` (shard_map, check_vma, the dropless exchange) with the kernels."""
    params, x = make_params(CFG), _inputs()
    mesh = parallel.make_mesh((1, 1), ("data", "expert"))
    strategy = parallel.Strategy(dispatcher="dropless")
    apply = {
        impl: _loss_and_grads(
            lambda p, x, impl=impl: parallel.moe_apply_sharded(
                p, x, CFG, mesh, strategy=strategy, implementation=impl
            )
        )
        for impl in ("pallas", "blocked")
    }
    calls = _mosaic_kernels(apply["pallas"], params, x)
    assert set(calls) == {"gmm", "gmm_t", "tgmm"} and calls["tgmm"] >= 3, calls
    (_, y), grads = apply["pallas"](params, x)
    (_, y0), grads0 = apply["blocked"](params, x)
    _close(y, y0, "y")
    _close(grads, grads0, "grads")
