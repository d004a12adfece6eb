"""Delayed attention weight gradients (`lm_forward(delay_wgrad=...)`, `moejax._wgrad`).

The gradients are bit-identical with and without the delay, on every path: inside the MoE
layer's `shard_map` (capacity and dropless, one chunk, chunks pipelined or staged, batch split)
and around the whole layer where it has no all-to-all to bound them by (data mode, allgather,
a `model` split, one device). Where the delay goes inside the layer, the attention weights'
gradient GEMMs are in the MoE layer's `shard_map` in the backward; without it, none is. Where
they land in the compiled GPU schedule is `tests/accelerator/test_batch_split_schedule.py`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import parallel, training
from moejax.models import init_lm_params, lm_forward, presets

CFG = presets.get("micro")  # 2 MoE layers: D=32, H=4, Hkv=2, Dh=8
WQ = (CFG.d_model, CFG.num_heads, CFG.head_dim)  # [D, H, Dh]
WO = (CFG.num_heads, CFG.head_dim, CFG.d_model)  # [H, Dh, D]
S = parallel.Strategy
MESHES = {
    "e8": ((8,), ("expert",)),
    "d2e4": ((2, 4), ("data", "expert")),
    "f2e2m2": ((2, 2, 2), ("fsdp", "expert", "model")),
}
CASES = {  # (mesh, strategy, batch_split, the delay goes inside the MoE layer)
    "capacity": ("e8", S(dispatcher="capacity"), 1, True),
    "dropless, split": ("d2e4", S(dispatcher="dropless"), 2, True),
    "dropless, chunks staged": ("d2e4", S(dispatcher="dropless", chunks=2, stagger=True), 1, True),
    "capacity, chunks staged": ("e8", S(dispatcher="capacity", chunks=2, stagger=True), 2, True),
    "capacity, chunks pipelined": ("d2e4", S(dispatcher="capacity", chunks=2), 1, True),
    "data mode": ("d2e4", S(mode="data"), 1, False),
    "allgather": ("e8", S(dispatcher="allgather"), 2, False),
    "model split": ("f2e2m2", "auto", 1, False),
    "one device": (None, "auto", 1, False),
}


def _mesh(name):
    return None if name is None else parallel.make_mesh(*MESHES[name])


def _config(strategy):
    capacity = isinstance(strategy, S) and strategy.dispatcher == "capacity"
    return CFG.replace(moe=CFG.moe.replace(drop_policy="capacity")) if capacity else CFG


def _grad_fn(mesh, strategy, batch_split, cfg=None, scan=False):
    cfg = cfg or _config(strategy)
    tokens = jax.random.randint(jax.random.key(1), (16, 16), 0, CFG.vocab_size)

    def loss(params, delay):
        logits, aux = lm_forward(
            params, tokens, cfg, mesh=mesh, strategy=strategy, batch_split=batch_split,
            delay_wgrad=delay, scan_layers=scan,
        )  # fmt: skip
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1))

    return jax.grad(loss)


def _sharded_dot_shapes(jaxpr, inside=False, out=None) -> set:
    """Output shapes of the `dot_general`s inside any `shard_map` of `jaxpr` (recursively)."""
    out = set() if out is None else out
    for eqn in jaxpr.eqns:
        if inside and eqn.primitive.name == "dot_general":
            out.add(tuple(eqn.outvars[0].aval.shape))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    _sharded_dot_shapes(sub, inside or eqn.primitive.name == "shard_map", out)
    return out


def _check(params, grad, inside: bool, layer: int = 1):
    grads = {d: jax.jit(grad, static_argnums=1)(params, d) for d in (False, True)}
    for (path, got), want in zip(
        jax.tree_util.tree_leaves_with_path(grads[True]), jax.tree.leaves(grads[False]), strict=True
    ):
        np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(path))
    # The block after an MoE layer gets its attention weights' gradient from that layer.
    assert float(jnp.abs(grads[True]["layers"][layer]["attn"]["wq"]).max()) > 0
    # Where the weight-gradient GEMMs are: inside the MoE layer's shard_map, or not.
    shapes = {d: _sharded_dot_shapes(jax.make_jaxpr(grad, static_argnums=1)(params, d).jaxpr)
              for d in (False, True)}  # fmt: skip
    assert not {WQ, WO} & shapes[False]
    assert ({WQ, WO} <= shapes[True]) == inside, sorted(shapes[True])


# The default run keeps one case of each path: inside (capacity), fallback (a model split), and
# inside with a batch split (test_scanned_layers_delay_the_same_gradients: dropless, split, scan).
SLOW_CASES = (
    "dropless, split",
    "dropless, chunks staged",
    "capacity, chunks staged",
    "capacity, chunks pipelined",
    "data mode",
    "allgather",
    "one device",
)


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES]
)
def test_delayed_gradients_are_the_same_and_where_they_should_be(case):
    mesh_name, strategy, k, inside = CASES[case]
    params = init_lm_params(_config(strategy), jax.random.key(0))
    _check(params, _grad_fn(_mesh(mesh_name), strategy, k), inside)


@pytest.mark.parametrize("layers, moe_every", [pytest.param(2, 1, marks=pytest.mark.slow), (5, 2)])
def test_scanned_layers_delay_the_same_gradients(layers, moe_every):
    """Each unit's MoE layer computes the next unit's first attention's (5 blocks, one MoE in
    two: the last unit's go to the leftover block 4; 2 MoE blocks: the last unit's are a
    zero gradient for block 0's weights)."""
    cfg = CFG.replace(num_layers=layers, moe_every=moe_every)
    params = init_lm_params(cfg, jax.random.key(0))
    grad = _grad_fn(_mesh("d2e4"), S(dispatcher="dropless"), 2, cfg=cfg, scan=True)
    _check(params, grad, inside=True, layer=moe_every)


def test_train_config_checks_delay_wgrad():
    with pytest.raises(ValueError, match="delay_wgrad"):
        training.TrainConfig(delay_wgrad="yes")
