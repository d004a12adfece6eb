"""One micro LM train step on the Mosaic GPU kernels (what an H100 runs for bf16 compute) equals
the same step on the XLA `blocked` path.

The `mosaic_gpu_kernels` fixture (tests/conftest.py) puts the Mosaic GPU kernels, interpreted,
under `implementation="pallas"`, with experts padded to their row tile as on H100. bf16 compute
on both sides: each expert matmul rounds its fp32 accumulator to bf16 and the paths sum in
different orders, so the loss and the gradients agree to bf16's rounding, not bit for bit (the
fp32 Triton path: tests/training/test_step.py). The gradients are compared, not the updated
parameters: Adam's first update is lr * sign(grad), which a rounding flips where a gradient is
near zero. One device (the interpreter's limit, tests/pallas_kernels/test_pk_mosaic_gpu.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import MODEL, TRAIN, corpus, mesh

from moejax.data import BatchIterator
from moejax.training import global_batch, init_train_state, make_train_step
from moejax.training.step import lm_loss

BF16 = MODEL.replace(dtype="bfloat16")


def _count_mosaic_kernels(fn, *args) -> int:
    from jax.extend import core as jex_core

    def walk(jaxpr):
        for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
            yield eqn.primitive.name == "mpmd_map"
            for sub in jex_core.jaxprs_in_params(eqn.params):
                yield from walk(sub)

    return sum(walk(jax.make_jaxpr(fn)(*args)))


@pytest.mark.slow
def test_micro_lm_step_on_mosaic_gpu_kernels_matches_blocked(mosaic_gpu_kernels):
    m = mesh((1, 1))
    tokens = BatchIterator(corpus().tokens, TRAIN.batch_size, MODEL.max_seq_len, seed=0).next()
    batch = global_batch(tokens, m)
    state = init_train_state(BF16, TRAIN, m)
    out = {}
    for impl in ("pallas", "blocked"):

        def grads(params, impl=impl):
            kw = dict(mesh=m, implementation=impl)
            return jax.value_and_grad(lm_loss, has_aux=True)(params, batch, BF16, TRAIN, **kw)

        if impl == "pallas":
            # gate, up, down per MoE layer: gmm forward, gmm_t and tgmm backward (at least).
            assert _count_mosaic_kernels(grads, state.params) >= 9 * len(BF16.moe_layers)
        (total, (ce, _)), g = jax.jit(grads)(state.params)
        new_state, metrics = make_train_step(BF16, TRAIN, m, implementation=impl)(
            init_train_state(BF16, TRAIN, m), batch
        )
        assert bool(metrics.finite)
        out[impl] = (float(ce), float(metrics.loss), g)
    tol = 2 * float(jnp.finfo(jnp.bfloat16).eps)
    (ce_p, loss_p, g_p), (ce_b, loss_b, g_b) = out["pallas"], out["blocked"]
    np.testing.assert_allclose(ce_p, ce_b, rtol=tol)
    np.testing.assert_allclose(loss_p, loss_b, rtol=tol)
    assert loss_p == ce_p and loss_b == ce_b  # the step's loss is this objective's
    leaves = zip(jax.tree_util.tree_leaves_with_path(g_p), jax.tree.leaves(g_b), strict=True)
    for (path, a), b in leaves:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = max(float(np.abs(b).max(initial=0.0)), 1e-30)
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * scale, err_msg=str(path))
