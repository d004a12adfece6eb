"""Shared pieces of the sharded-layer tests: tiny configs, params, loss, mesh table."""

import functools

import jax
import jax.numpy as jnp

import moejax
from moejax import parallel

SIZES = dict(d_model=16, d_ff=32, num_experts=8, block_size=8)
DROPLESS = moejax.MoEConfig(**SIZES, top_k=2, expert_bias=True)
CAPACITY = moejax.MoEConfig(**SIZES, top_k=2, drop_policy="capacity", capacity_factor=0.75)
SHARED = moejax.MoEConfig(**SIZES, top_k=2, num_shared_experts=1, shared_d_ff=16, shared_gate=True)
MESHES = {
    "e8": ((8,), ("expert",)),
    "d2e4": ((2, 4), ("data", "expert")),
    "e4m2": ((4, 2), ("expert", "model")),
    "d1e8": ((1, 8), ("data", "expert")),
    "d2e2m2": ((2, 2, 2), ("data", "expert", "model")),
    "d8": ((8,), ("data",)),
    "m8": ((8,), ("model",)),
    "d4m2": ((4, 2), ("data", "model")),
}


@functools.cache
def mesh(name):
    return parallel.make_mesh(*MESHES[name])


def make_params(cfg, key=0):
    """Initial params with non-zero biases, so every bias path is exercised."""
    params = moejax.init_moe_params(cfg, jax.random.key(key))
    k = jax.random.key(key + 100)
    for group in params.values():
        for name, value in group.items():
            if name.startswith("b_") or name == "bias":
                k, sub = jax.random.split(k)
                group[name] = 0.3 * jax.random.normal(sub, value.shape, value.dtype)
    return params


def inputs(key=1, b=8, s=8, d=16):
    return jax.random.normal(jax.random.key(key), (b, s, d), jnp.float32)


def _loss(y, aux):
    # A non-symmetric loss so every output element's gradient differs.
    w = jnp.sin(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    return jnp.sum(y * w) + 0.1 * aux.load_balance_loss + 0.01 * aux.z_loss


@functools.cache
def single_device(cfg, implementation):
    def f(params, x):
        y, aux = moejax.moe_apply(params, x, cfg, implementation=implementation)
        return _loss(y, aux), (y, aux)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))


def sharded(cfg, mesh_name, strategy, implementation, stagger=False):
    m = mesh(mesh_name)

    def f(params, x):
        y, aux = parallel.moe_apply_sharded(
            params, x, cfg, m, strategy=strategy, implementation=implementation, stagger=stagger
        )
        return _loss(y, aux), (y, aux)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))


# The strategy of the 2-process test: bounded dropless with rounds across the process boundary.
STRATEGY_2P = parallel.Strategy(dispatcher="dropless", bucket=4)
