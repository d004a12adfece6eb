"""generate(): the KV-cached prefill and steps equal the full forward at every position; greedy
decoding equals an argmax loop over the full forward; sampling; one device or a mesh."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import parallel
from moejax.models import RopeScaling, generate, init_lm_params, lm_forward, presets
from moejax.models._generate import _prefill, _step, sample
from moejax.testing import assert_close

MICRO = presets.get("micro")
# Every attention option the cache path re-implements, dense and MoE layers, tied embeddings.
VARIANT = MICRO.replace(
    num_layers=3,
    mlp_layer_types=("dense", "moe", "moe"),
    qk_norm="full",
    attention_bias=True,
    attention_out_bias=True,
    tie_embeddings=True,
    rope_scaling=RopeScaling("yarn", 4.0, original_max_position_embeddings=4),
)


def _prompt(b=2, s=5, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (b, s)).astype(np.int32)


def _random_biases(params, key):
    """Non-zero biases (init makes them zero, which would hide a missing one)."""

    def f(path, x):
        name = jax.tree_util.keystr(path)
        if any(f"'{b}'" in name for b in ("bq", "bk", "bv", "bo")):
            return 0.1 * jax.random.normal(jax.random.fold_in(key, hash(name) % 1000), x.shape)
        return x

    return jax.tree_util.tree_map_with_path(f, params)


@pytest.mark.parametrize("cfg", [MICRO, VARIANT], ids=["micro", "variant"])
def test_cached_steps_equal_the_full_forward_at_every_position(cfg):
    params = _random_biases(init_lm_params(cfg, jax.random.key(0)), jax.random.key(1))
    prompt = _prompt()
    ids, logits = generate(params, cfg, prompt, cfg.max_seq_len - 5, return_logits=True)
    assert ids.shape == (2, cfg.max_seq_len) and logits.shape == (2, cfg.max_seq_len - 5, 256)
    np.testing.assert_array_equal(ids[:, :5], prompt)
    full, _ = jax.jit(functools.partial(lm_forward, cfg=cfg))(params, jnp.asarray(ids))
    # logits[:, i] predicted token 5 + i from the cache of positions 0 .. 4 + i.
    assert_close(logits, full[:, 4:-1])


def _argmax_loop(params, cfg, prompt, new):
    """Greedy decoding by the full forward over the whole window each time (causal: the
    padding after position t does not change its logits)."""
    b, s0 = prompt.shape
    forward = jax.jit(functools.partial(lm_forward, cfg=cfg))
    ids = np.zeros((b, s0 + new), np.int32)
    ids[:, :s0] = prompt
    for t in range(s0, s0 + new):
        logits, _ = forward(params, jnp.asarray(ids))
        ids[:, t] = np.argmax(np.asarray(logits[:, t - 1]), axis=-1)
    return ids


def test_greedy_equals_an_argmax_loop_of_the_full_forward_and_compiles_once():
    params = init_lm_params(VARIANT, jax.random.key(2))
    prompt = _prompt(seed=1)
    want = _argmax_loop(params, VARIANT, prompt, 8)
    got = generate(params, VARIANT, prompt, 8)
    np.testing.assert_array_equal(got, want)
    sizes = _prefill._cache_size(), _step._cache_size()
    seen = []
    again = generate(params, VARIANT, _prompt(seed=3), 8, on_token=lambda i, t: seen.append(i))
    assert (_prefill._cache_size(), _step._cache_size()) == sizes  # same shapes: no retrace
    assert seen == list(range(8)) and again.shape == want.shape
    one = generate(params, VARIANT, prompt[0], 8)  # a 1-D prompt gives a 1-D answer
    np.testing.assert_array_equal(one, want[0])


def test_on_a_mesh_generates_what_one_device_does():
    params = init_lm_params(MICRO, jax.random.key(4))
    prompt = _prompt(b=1, s=4, seed=5)
    mesh = parallel.make_mesh((2, 4), ("data", "expert"))
    want = generate(params, MICRO, prompt, 6, temperature=0.8, top_p=0.9, seed=7)
    got = generate(params, MICRO, prompt, 6, temperature=0.8, top_p=0.9, seed=7, mesh=mesh)
    np.testing.assert_array_equal(got, want)


def test_nucleus_sampling_keeps_the_top_mass_only():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 4000)
    draws = np.asarray(jax.vmap(lambda k: sample(logits, k, 1.0, 0.7))(keys))[:, 0]
    counts = np.bincount(draws, minlength=4) / len(draws)
    assert counts[2] == counts[3] == 0  # 0.5 + 0.3 reaches 0.7: tokens 2, 3 are cut
    np.testing.assert_allclose(counts[:2], [0.625, 0.375], atol=0.03)
    full = np.asarray(jax.vmap(lambda k: sample(logits, k, 1.0, 1.0))(keys))[:, 0]
    assert (np.bincount(full, minlength=4) > 0).all()
    assert int(sample(logits, keys[0], 0.0, 1.0)[0]) == 0  # temperature 0: argmax
    assert (np.asarray(jax.vmap(lambda k: sample(logits, k, 1.0, 0.4))(keys)) == 0).all()


def test_bad_arguments():
    params = init_lm_params(MICRO, jax.random.key(0))
    for kwargs, match in [
        (dict(max_new_tokens=12), "max_seq_len=16"),
        (dict(max_new_tokens=0), "max_new_tokens=0"),
        (dict(max_new_tokens=2, temperature=-1.0), "temperature"),
        (dict(max_new_tokens=2, top_p=0.0), "top_p"),
    ]:
        with pytest.raises(ValueError, match=match):
            generate(params, MICRO, _prompt(), **kwargs)
    with pytest.raises(ValueError, match="vocab_size"):
        generate(params, MICRO, [[1, 300]], 2)
