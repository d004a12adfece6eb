"""`MoEConfig(expert_precision="fp8")`: the expert matmuls in the DeepSeek-V3 fp8 recipe
(emulated here), the router untouched, the same numerics on every implementation, the fp8
kernels in the program compiled for Hopper, and the loss within a derived bound of bf16's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moejax
from moejax import _gmm
from moejax.models import init_lm_params, presets
from moejax.training import presets as train_presets
from moejax.training.step import lm_loss
from pallas_kernels import fp8, introspect, mgpu_compat, targets

CFG = moejax.MoEConfig(d_model=160, d_ff=136, num_experts=4, top_k=2)  # partial 128-tiles


def test_config_validates_precision_and_format():
    assert CFG.expert_precision == "bf16" and CFG.fp8_grad_format == "e4m3"
    assert CFG.replace(expert_precision="fp8", fp8_grad_format="e5m2").fp8_grad_format == "e5m2"
    with pytest.raises(ValueError, match="expert_precision='fp16'"):
        CFG.replace(expert_precision="fp16")
    with pytest.raises(ValueError, match="fp8_grad_format='e4m4'"):
        CFG.replace(fp8_grad_format="e4m4")


def _outputs(cfg, impl):
    params = moejax.init_moe_params(cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (96, cfg.d_model))

    def loss(p, x):
        y, aux = moejax.moe_apply(p, x, cfg, implementation=impl)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape))), (y, aux)

    (_, (y, aux)), (gp, gx) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(params, x)
    return y, aux, gp, gx


@functools.cache
def _by_impl(impl, precision):
    return _outputs(CFG.replace(expert_precision=precision), impl)


def _rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("impl", ["ragged_dot", "blocked"])
def test_fp8_is_quantized_and_router_is_not(impl):
    y8, aux8, g8, dx8 = _by_impl(impl, "fp8")
    y, aux, g, dx = _by_impl(impl, "bf16")
    # e4m3 operands: a few percent off, not bit-equal, not wildly off
    assert 1e-3 < _rel(y8, y) < 0.1
    assert 1e-3 < _rel(g8["experts"]["w_up"], g["experts"]["w_up"]) < 0.15
    assert 1e-3 < _rel(dx8, dx) < 0.15
    # The router sees the same x and is never quantized: identical logits and routing.
    np.testing.assert_array_equal(aux8.router_logits, aux.router_logits)
    np.testing.assert_array_equal(aux8.topk_indices, aux.topk_indices)


def _same_up_to_flips(a, b):
    """Equal to fp32 rounding but for rare rows where an fp32-rounding difference upstream
    moved one value across an fp8 rounding boundary (one fp8 step, 2^-3 relative, of one
    operand element, which reaches its whole output row): a handful of rows, and 1e-5
    relative overall."""
    a, b = np.asarray(a), np.asarray(b)
    off = ~np.isclose(a, b, rtol=1e-5, atol=1e-6)
    assert off.reshape(off.shape[0], -1).any(1).sum() <= 5, off.mean()  # a handful of rows
    assert _rel(a, b) < 1e-5


def test_every_implementation_computes_the_same_fp8_function():
    """The forward and the lhs gradient quantize rows, which no layout changes: ragged_dot and
    the blocked loops agree to fp32 rounding (and its fp8 flips). The weight gradient quantizes
    128-row tiles of the permuted rows, whose padding differs (1 vs block_size rows)."""
    y1, _, g1, dx1 = _by_impl("ragged_dot", "fp8")
    y2, _, g2, dx2 = _by_impl("blocked", "fp8")
    _same_up_to_flips(y2, y1)
    _same_up_to_flips(dx2, dx1)
    assert _rel(g2["experts"]["w_down"], g1["experts"]["w_down"]) < 0.05


@pytest.mark.slow
def test_pallas_implementation_matches_ragged_dot_on_cpu():
    """`implementation="pallas"` on CPU emulates over the Triton kernels (interpreted), with
    the same row alignment as ragged_dot. Their fp32 products run at `KERNEL_PRECISION`
    (TF32 on GPUs, and in jax 0.12's Triton interpreter): the dequantized operands keep 11 of
    their up to 28 significant bits, a relative rounding of 2^-11 each (2^-7 of e4m3's), so
    the outputs agree within 2^-10 relative (exactly fp32 rounding where the interpreter
    multiplies in fp32, as jax 0.10's does)."""
    y1, _, g1, dx1 = _by_impl("ragged_dot", "fp8")
    y2, _, g2, dx2 = _by_impl("pallas", "fp8")
    pairs = [(y2, y1), (dx2, dx1)]
    pairs += [(g2["experts"][k], g1["experts"][k]) for k in ("w_gate", "w_up", "w_down")]
    for a, b in pairs:
        assert _rel(a, b) < 2**-10


def test_hopper_program_runs_the_fp8_kernels():
    """Lowered for an H100 with implementation="pallas": every expert matmul of the forward
    and backward is an fp8 Mosaic GPU kernel (3 projections: forward and lhs gradient by
    fp8_gmm, weight gradient by fp8_tgmm), and no bf16 grouped matmul is left."""
    cfg = CFG.replace(expert_precision="fp8", param_dtype="bfloat16")
    params = moejax.init_moe_params(cfg, jax.random.key(0))
    x = jnp.ones((256, cfg.d_model), jnp.bfloat16)

    def loss(p, x):
        return jnp.sum(moejax.moe_apply(p, x, cfg, implementation="pallas")[0])

    with jax.sharding.use_abstract_mesh(targets.abstract_gpu_mesh()):
        calls = introspect.traced_kernel_calls(jax.grad(loss, (0, 1)), params, x, platform="cuda")
    names = sorted(str(c) for c in calls)
    assert names == ["fp8_gmm/mosaic_gpu"] * 6 + ["fp8_tgmm/mosaic_gpu"] * 3


@pytest.mark.skipif(not mgpu_compat.LOADS_TRANSPOSED, reason="jax 0.10: no fused quantizers")
def test_hopper_program_quantizes_in_the_producers():
    """With 128-aligned widths, the SwiGLU experts' program for an H100 quantizes each operand
    in one fused kernel: the three weights, x once for both projections, the hidden activation
    where it is computed, the output gradient, and the gate and up gradients where they are
    computed; no XLA quantization is left. The fp32 master weights are quantized as they are:
    the program makes no 16-bit copy of them."""
    cfg = moejax.MoEConfig(d_model=256, d_ff=384, num_experts=4, top_k=2, expert_precision="fp8")
    params = moejax.init_moe_params(cfg, jax.random.key(0))
    assert params["experts"]["w_up"].dtype == jnp.float32
    x = jnp.ones((256, cfg.d_model), jnp.bfloat16)

    def loss(p, x):
        return jnp.sum(moejax.moe_apply(p, x, cfg, implementation="pallas")[0])

    grad = jax.grad(loss, (0, 1))
    with jax.sharding.use_abstract_mesh(targets.abstract_gpu_mesh()):
        calls = introspect.traced_kernel_calls(grad, params, x, platform="cuda")
        hlo = jax.jit(grad).trace(params, x).lower(lowering_platforms=("cuda",)).as_text()
    for shape in ("4x256x384", "4x384x256"):  # w_gate and w_up, w_down
        assert f"(tensor<{shape}xf32>) -> tensor<{shape}xbf16>" not in hlo  # no weight cast
        assert f"(tensor<{shape}xbf16>) -> tensor<{shape}xf32>" in hlo  # the gradients widened
    names = sorted(str(c).split("/")[0] for c in calls)
    assert names == sorted(
        ["fp8_gmm"] * 6 + ["fp8_tgmm"] * 3 + ["fp8_quantize_blocks"] * 3 + ["fp8_quantize"] * 2
        + ["fp8_quantize_swiglu", "fp8_quantize_swiglu_grad"]
    )  # fmt: skip


@pytest.mark.slow  # ~15 s of CPU: two LM losses and a gradient compiled
def test_micro_step_loss_within_the_first_order_bound(monkeypatch):
    """The `micro` LM's training loss with fp8 experts against the unquantized one.

    The forward of each expert matmul y = x @ w becomes x~ @ w~ with |x~ - x| <= dx =
    u|x| + h s_x and |w~ - w| <= dw = u|w| + h s_w elementwise (`pallas_kernels.fp8`: u = 2^-4,
    h = 2^-10 for e4m3, s the tile scales). To first order the loss moves by
    <dL/dx, x~ - x> + <dL/dw, w~ - w> per matmul, so by at most B = sum over the matmuls of
    <|dL/dx|, dx> + <|dL/dw|, dw>, measured on the unquantized model with a probe around each
    expert matmul. Second-order terms are O(u) of that: the test allows 1.25 B.

    B adds every rounding error with the sign that hurts. Modelled as independent and uniform
    (variance <= bound^2 / 3, the standard model of rounding errors), the same first-order sum
    has a standard deviation sigma <= sqrt(sum (|dL/dx| dx)^2 / 3 + (|dL/dw| dw)^2 / 3); the
    test also asks |difference| <= 6 sigma, a check hundreds of times tighter than B."""
    model = presets.get("micro")
    train_cfg = train_presets.get("micro")
    params = init_lm_params(model, jax.random.key(0))
    batch = jax.random.randint(jax.random.key(1), (8, model.max_seq_len + 1), 0, model.vocab_size)
    u, h = fp8.rounding_bound("e4m3"), fp8.subnormal_bound("e4m3")
    terms = []
    plain = _gmm.ragged_dot_gmm

    @jax.custom_vjp
    def probe(x, w, sizes):
        return plain(x, w, sizes)

    def fwd(x, w, sizes):
        return probe(x, w, sizes), (x, w, sizes)

    def bwd(res, g):
        x, w, sizes = res
        sx = fp8.dequantize_rows(jnp.ones(x.shape), fp8.quantize_rows(x)[1])
        sw = fp8.dequantize_blocks(jnp.ones(w.shape), fp8.quantize_blocks(w)[1])
        _, vjp = jax.vjp(lambda x, w: plain(x, w, sizes), x, w)
        gx, gw = vjp(g)
        live = (jnp.arange(x.shape[0]) < jnp.sum(sizes))[:, None]  # rows that reach y
        ex = jnp.where(live, jnp.abs(gx) * (u * jnp.abs(x) + h * sx), 0)
        ew = jnp.abs(gw) * (u * jnp.abs(w) + h * sw)
        worst, var = jnp.sum(ex) + jnp.sum(ew), (jnp.sum(ex**2) + jnp.sum(ew**2)) / 3
        jax.debug.callback(lambda a, b: terms.append((float(a), float(b))), worst, var)
        return gx, gw, None

    probe.defvjp(fwd, bwd)

    def loss(p, cfg):
        return lm_loss(p, batch, cfg, train_cfg, implementation="ragged_dot")[0]

    l_fp8 = float(loss(params, model.replace(moe=model.moe.replace(expert_precision="fp8"))))
    monkeypatch.setattr(_gmm, "ragged_dot_gmm", probe)
    l_ref, _ = jax.value_and_grad(loss)(params, model)
    jax.effects_barrier()
    # 2 layers x 3 projections (the micro model: layers of MoE, gated experts)
    assert len(terms) == model.num_layers * 3, terms
    bound = sum(t[0] for t in terms)
    sigma = sum(t[1] for t in terms) ** 0.5
    diff = abs(l_fp8 - float(l_ref))
    print(f"micro: |fp8 - ref| = {diff:.3g}, first-order bound {bound:.3g}, sigma {sigma:.3g}")
    assert 0 < diff <= 1.25 * bound, (diff, bound)  # quantized, within the worst case
    assert diff <= 6 * sigma, (diff, sigma)
