"""Multi-token prediction: the blocks against a hand-written reference of DeepSeek-V3's equations
(fed the final-normed state, as serving stacks draft, or the state before it), the weighted MTP
loss of `lm_loss` (positions without a target left out), the main model untouched, generation
skipping the blocks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moejax import moe_apply
from moejax.models import (
    attention,
    generate,
    init_lm_params,
    lm_forward,
    presets,
    rms_norm,
    rope_tables,
    swiglu_mlp,
)
from moejax.testing import assert_close
from moejax.training import TrainConfig, lm_loss

CFG = presets.get("micro").replace(mtp_layers=2)


def _block(layer, x, cfg, cos, sin):
    h = rms_norm(x, layer["attn_norm"]["scale"], cfg.norm_eps)
    x = x + attention(layer["attn"], h, cos, sin, implementation="xla")
    h = rms_norm(x, layer["ffn_norm"]["scale"], cfg.norm_eps)
    y = moe_apply(layer["moe"], h, cfg.moe)[0] if "moe" in layer else swiglu_mlp(layer["mlp"], h)
    return x + y


def _next_tokens(window, s, m):
    """`[M, B, S]`: block k reads window[:, i + k], zero past the window's end."""
    out = np.zeros((m, window.shape[0], s), np.int32)
    for k in range(1, m + 1):
        avail = window[:, k : k + s]
        out[k - 1, :, : avail.shape[1]] = avail
    return out


def _reference(params, tokens, nexts, cfg):
    """Block k: h^k = Block_k(W_eh [enorm(Emb(t_{i+k})); hnorm(s^{k-1}_i)]), logits from
    norm(h^k). `s^{k-1}` is, for `mtp_input="final_norm"`, the final-normed main state (k = 1)
    and norm(h^{k-1}) after; for `"pre_norm"` the raw last block's output and h^{k-1}."""
    s = tokens.shape[1]
    cos, sin = rope_tables(s, cfg.head_dim, cfg.rope_theta)
    emb = params["embed"]["embedding"]
    h = emb[tokens]
    for layer in params["layers"]:
        h = _block(layer, h, cfg, cos, sin)
    if cfg.mtp_input == "final_norm":
        h = rms_norm(h, params["final_norm"]["scale"], cfg.norm_eps)
    out = []
    for nxt, p in zip(nexts, params["mtp"], strict=True):
        e = rms_norm(emb[nxt], p["enorm"]["scale"], cfg.norm_eps)
        z = jnp.concatenate([e, rms_norm(h, p["hnorm"]["scale"], cfg.norm_eps)], -1)
        h = _block(p["block"], z @ p["eh_proj"]["kernel"], cfg, cos, sin)
        normed = rms_norm(h, p["norm"]["scale"], cfg.norm_eps)
        out.append(normed @ params["unembed"]["kernel"])
        if cfg.mtp_input == "final_norm":
            h = normed
    return jnp.stack(out)


def _window(b=2, s=16, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (b, s + 1)).astype(np.int32)


@pytest.mark.parametrize("mtp_input", ["final_norm", "pre_norm"])
def test_mtp_blocks_equal_the_reference_and_leave_the_main_model_alone(mtp_input):
    cfg = CFG.replace(mtp_input=mtp_input)
    params = init_lm_params(cfg, jax.random.key(0))
    plain = init_lm_params(CFG.replace(mtp_layers=0), jax.random.key(0))
    assert "mtp" not in plain and len(params["mtp"]) == 2
    jax.tree.map(np.testing.assert_array_equal, {**params, "mtp": None}, {**plain, "mtp": None})
    window = _window()
    tokens = jnp.asarray(window[:, :-1])
    fwd = jax.jit(functools.partial(lm_forward, cfg=cfg))
    logits, _, mtp = fwd(params, tokens, mtp_tokens=jnp.asarray(window))
    assert mtp.shape == (2, 2, 16, 256)
    assert_close(logits, fwd(params, tokens)[0])  # the main model's logits are unchanged
    nexts = _next_tokens(window, 16, 2)
    assert_close(mtp, jax.jit(_reference, static_argnums=3)(params, tokens, nexts, cfg))
    if mtp_input == "pre_norm":  # the two conventions are different functions
        other = jax.jit(functools.partial(lm_forward, cfg=CFG))
        assert not np.allclose(other(params, tokens, mtp_tokens=jnp.asarray(window))[2], mtp)


def test_weighted_mtp_loss_counts_the_positions_that_have_a_target():
    params = init_lm_params(CFG, jax.random.key(1))
    window = jnp.asarray(_window(seed=1))
    loss = jax.jit(lm_loss, static_argnums=(2, 3))
    base, (ce, aux, none) = loss(params, window, CFG, TrainConfig())
    assert none is None  # weight 0: the blocks do not run
    total, (ce2, _, mtp_loss) = loss(params, window, CFG, TrainConfig(mtp_loss_weight=0.3))
    assert_close(ce2, ce)
    assert_close(total, base + 0.3 * mtp_loss)
    # By hand: block k (1-based) at position i predicts window[:, i + k + 1], for i + k + 1 <= S.
    _, _, mtp = lm_forward(params, window[:, :-1], CFG, mtp_tokens=window)
    want = []
    for k in (1, 2):
        n = 17 - k - 1  # positions with a target
        labels = window[:, k + 1 : k + 1 + n]
        want.append(
            optax.softmax_cross_entropy_with_integer_labels(mtp[k - 1, :, :n], labels).mean()
        )
    assert_close(mtp_loss, np.mean(want))


def test_generation_skips_the_mtp_blocks():
    params = init_lm_params(CFG, jax.random.key(2))
    no_mtp = {k: v for k, v in params.items() if k != "mtp"}
    prompt = _window(b=1, s=3)[:, :4]
    np.testing.assert_array_equal(
        generate(params, CFG, prompt, 4), generate(no_mtp, CFG.replace(mtp_layers=0), prompt, 4)
    )


def test_mtp_checks():
    params = init_lm_params(CFG, jax.random.key(0))
    tokens = jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(ValueError, match="mtp_tokens.shape"):
        lm_forward(params, tokens, CFG, mtp_tokens=tokens)
    with pytest.raises(ValueError, match="mtp_layers=0"):
        lm_forward(params, tokens, CFG.replace(mtp_layers=0), mtp_tokens=tokens)
    with pytest.raises(ValueError, match="mtp_layers"):
        CFG.replace(mtp_layers=-1)
    with pytest.raises(ValueError, match="mtp_loss_weight"):
        TrainConfig(mtp_loss_weight=-0.1)
