"""Helpers shared by moejax's tests and benchmarks: tolerances, random parameters, forced routing.

>>> import jax.numpy as jnp
>>> tolerance(jnp.bfloat16)
(0.02, 0.02)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moejax._params import param_specs

_TOLERANCE = {  # (rtol, atol) per dtype, for results compared against an fp32 reference
    jnp.dtype(jnp.float64): (1e-10, 1e-10),
    jnp.dtype(jnp.float32): (2e-5, 2e-5),
    jnp.dtype(jnp.bfloat16): (2e-2, 2e-2),
    jnp.dtype(jnp.float16): (5e-3, 5e-3),
}


def tolerance(dtype) -> tuple[float, float]:
    """`(rtol, atol)` for comparing a computation in `dtype` against a reference."""
    return _TOLERANCE[jnp.dtype(dtype)]


def assert_close(actual, expected, dtype=None, *, scale: float = 1.0, err_msg: str = ""):
    """Assert two pytrees of arrays are close, with the tolerance of `dtype` (default: of
    `actual`'s first leaf), relative to the largest magnitude of each expected leaf.

    `scale` multiplies the tolerance for quantities that accumulate over a known longer chain
    (document why at the call site); it is never a way to make a failing test pass.
    """
    leaves_a, tree_a = jax.tree.flatten(actual)
    leaves_e, tree_e = jax.tree.flatten(expected)
    if tree_a != tree_e:
        raise AssertionError(f"tree mismatch: {tree_a} vs {tree_e}")
    dtype = dtype or leaves_a[0].dtype
    rtol, atol = tolerance(dtype)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(expected)[0]]
    for path, a, e in zip(paths, leaves_a, leaves_e, strict=True):
        a = np.asarray(jnp.asarray(a, jnp.float32))
        e = np.asarray(jnp.asarray(e, jnp.float32))
        mag = max(1.0, float(np.abs(e).max(initial=0.0)))
        np.testing.assert_allclose(
            a, e, rtol=rtol * scale, atol=atol * scale * mag, err_msg=f"{err_msg} {path}"
        )


def random_params(config, seed: int = 0, bias_scale: float = 0.3) -> dict:
    """A parameter tree like `moejax.init_moe_params`, drawn with numpy, with non-zero biases.

    Projections are Normal(0, init_scale / sqrt(fan_in)); biases and the correction bias are
    Normal(0, `bias_scale`) so that every bias path changes the result. Numpy instead of
    `jax.random`: on XLA:CPU each new parameter shape would cost a `jax.random.normal` compile
    (about a second), which dominates small tests.

    Args:
      config: a `moejax.MoEConfig`.
      seed: numpy seed.
      bias_scale: standard deviation of the biases.

    Returns:
      The nested dict of `[...]` arrays in `config.param_dtype`.

    >>> import moejax
    >>> cfg = moejax.MoEConfig(d_model=8, d_ff=16, num_experts=4, expert_bias=True)
    >>> random_params(cfg)["experts"]["b_down"].shape
    (4, 8)
    """
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(config.param_dtype)

    def draw(spec):
        if spec.fan_in_axis is None:
            std = bias_scale
        else:
            std = config.init_scale / spec.shape[spec.fan_in_axis] ** 0.5
        return jnp.asarray(rng.normal(0.0, std, spec.shape).astype(np.float32), dtype)

    specs = param_specs(config)
    return {g: {n: draw(s) for n, s in group.items()} for g, group in specs.items()}


def force_routing(params: dict, expert: int, strength: float = 30.0) -> dict:
    """Parameters whose router sends every token with positive features to `expert` first.

    The router kernel becomes zero except column `expert` = `strength`, so for inputs whose
    features sum to a positive number (e.g. `abs(x)`), `expert` wins with a large margin and the
    remaining K-1 choices fall on tied zero logits (lowest indices, by `top_k`'s tie rule).
    """
    kernel = jnp.zeros_like(params["router"]["kernel"]).at[:, expert].set(strength)
    return {**params, "router": {**params["router"], "kernel": kernel}}


def zipf_logits(key, tokens: int, num_experts: int, s: float = 1.2, scale: float = 4.0):
    """Router logits `[T, E]` whose top-1 choice follows a Zipf(s) law over experts."""
    k1, k2 = jax.random.split(key)
    ranks = jnp.arange(1, num_experts + 1, dtype=jnp.float32)
    p = ranks**-s / jnp.sum(ranks**-s)
    top = jax.random.choice(k1, num_experts, (tokens,), p=p)
    noise = jax.random.normal(k2, (tokens, num_experts))
    return noise + scale * jax.nn.one_hot(top, num_experts)


def kernels_run(fn, *args, platform: str = "cpu") -> list[str]:
    """`"name/backend"` of every Pallas kernel `fn(*args)` runs when compiled for `platform`
    (`pallas_kernels.introspect`: of the branches `implementation="auto"` and `"pallas"` stage,
    only the ones that platform lowers count). Args may be arrays or ShapeDtypeStructs."""
    from pallas_kernels import introspect

    return [str(c) for c in introspect.traced_kernel_calls(fn, *args, platform=platform)]
