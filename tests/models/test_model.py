"""lm_forward: causality, sharded == single device, MoE(E=1) == dense block, mixed precision."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from moejax import parallel
from moejax.models import init_lm_params, lm_forward, presets
from moejax.testing import assert_close

CFG = presets.get("micro")


_init = jax.jit(init_lm_params, static_argnums=0)


def _tokens(seed=0, b=8, s=16):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, (b, s)), jnp.int32)


@functools.cache
def _loss_fn(cfg, mesh=None):
    def loss(params, tokens):
        logits, aux = lm_forward(params, tokens, cfg, mesh=mesh)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
        return ce.mean() + 0.01 * aux.load_balance_loss.mean(), (logits, aux)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def test_future_tokens_do_not_change_past_logits():
    params = _init(CFG, jax.random.key(0))
    tokens = _tokens(b=2)
    changed = tokens.at[:, 9].set((tokens[:, 9] + 1) % 256)
    forward = jax.jit(functools.partial(lm_forward, cfg=CFG, implementation="reference"))
    a, _ = forward(params, tokens)
    b, _ = forward(params, changed)
    np.testing.assert_array_equal(np.asarray(a[:, :9]), np.asarray(b[:, :9]))
    assert not np.allclose(np.asarray(a[:, 9:]), np.asarray(b[:, 9:]))


def test_sharded_model_equals_single_device():
    """The MoE layers under shard_map on a 2 x 4 mesh compute the single-device model."""
    mesh = parallel.make_mesh((2, 4), ("data", "expert"))
    params = _init(CFG, jax.random.key(0))
    tokens = _tokens()
    (loss1, (logits1, aux1)), grads1 = _loss_fn(CFG)(params, tokens)
    (loss8, (logits8, aux8)), grads8 = _loss_fn(CFG, mesh)(params, tokens)
    np.testing.assert_array_equal(np.asarray(aux8.expert_counts), np.asarray(aux1.expert_counts))
    assert int(aux1.expert_counts.sum()) == CFG.num_moe_layers * 8 * 16 * CFG.moe.top_k
    assert_close(logits8, logits1)
    assert_close(
        (loss8, aux8.load_balance_loss, aux8.z_loss, aux8.router_entropy),
        (loss1, aux1.load_balance_loss, aux1.z_loss, aux1.router_entropy),
    )
    assert_close(grads8, grads1)


def test_one_expert_moe_layer_equals_dense_swiglu_block():
    """With E = K = 1 the router weight is exactly 1, so the MoE FFN is a dense SwiGLU MLP."""
    moe = CFG.moe.replace(
        num_experts=1, top_k=1, router="softmax", score_correction_bias=False, num_shared_experts=0
    )
    cfg = CFG.replace(moe=moe, num_layers=1)
    params = _init(cfg, jax.random.key(0))
    experts = params["layers"][0]["moe"]["experts"]
    dense = {**params, "layers": [{k: v for k, v in params["layers"][0].items() if k != "moe"}]}
    dense["layers"][0]["mlp"] = {k: experts[k][0] for k in ("w_gate", "w_up", "w_down")}
    tokens = _tokens(b=2)
    got, aux = jax.jit(functools.partial(lm_forward, cfg=cfg))(params, tokens)
    assert aux.expert_counts.tolist() == [[2 * 16]]
    assert_close(got, _dense_forward(dense, tokens, cfg))


def _dense_forward(params, tokens, cfg):
    from moejax.models import attention, rms_norm, rope_tables, swiglu_mlp

    cos, sin = rope_tables(tokens.shape[1], cfg.head_dim, cfg.rope_theta)
    x = params["embed"]["embedding"][tokens]
    for layer in params["layers"]:
        x = x + attention(layer["attn"], rms_norm(x, layer["attn_norm"]["scale"], 1e-5), cos, sin)
        x = x + swiglu_mlp(layer["mlp"], rms_norm(x, layer["ffn_norm"]["scale"], 1e-5))
    x = rms_norm(x, params["final_norm"]["scale"], 1e-5)
    return x @ params["unembed"]["kernel"]


def test_bf16_compute_keeps_fp32_params_and_loss_close():
    params = _init(CFG, jax.random.key(0))
    tokens = _tokens()
    (loss32, (logits32, _)), _ = _loss_fn(CFG)(params, tokens)
    (loss16, (logits16, aux16)), grads16 = _loss_fn(CFG.replace(dtype="bfloat16"))(params, tokens)
    assert logits16.dtype == jnp.float32 and aux16.z_loss.dtype == jnp.float32
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads16))
    # bf16 has an 8-bit mantissa: the mean loss over 1024 tokens agrees to ~1e-2 relative.
    np.testing.assert_allclose(float(loss16), float(loss32), rtol=2e-2)


def test_moe_layer_inputs_are_what_each_moe_layer_routes():
    from moejax import moe_apply
    from moejax.models import moe_layer_inputs

    params = _init(CFG, jax.random.key(0))
    tokens = _tokens(seed=3)
    _, aux = jax.jit(functools.partial(lm_forward, cfg=CFG))(params, tokens)
    inputs = jax.jit(functools.partial(moe_layer_inputs, cfg=CFG))(params, tokens)
    assert len(inputs) == len(CFG.moe_layers)
    for j, i in enumerate(CFG.moe_layers):
        assert inputs[j].shape == (*tokens.shape, CFG.d_model)
        _, layer_aux = moe_apply(params["layers"][i]["moe"], inputs[j], CFG.moe)
        np.testing.assert_array_equal(layer_aux.expert_counts, aux.expert_counts[j])
    # Layer 0's input depends only on the embedding and the first attention block.
    assert not np.allclose(inputs[0], inputs[-1])
