"""`TrainConfig.moment_dtype="bfloat16"`: Adam's moments stored in bfloat16 (DeepSeek-V3's
recipe), the update computed in fp32, against a numpy Adam whose moments are rounded to bfloat16
after every step; the state keeps its tree and dtypes from step to step; configs that would stall
the second moment are refused; the micro LM trains with it as with fp32 moments."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from moejax.training import TrainConfig, learning_rate_schedule
from moejax.training.optimizer import make_optimizer

CFG = TrainConfig(steps=20, warmup_steps=2, learning_rate=1e-2, weight_decay=0.1, clip_norm=1e9)


def _params():
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.standard_normal((8, 16)), jnp.float32),  # decayed (a matrix)
        "norm": {"scale": jnp.asarray(1 + 0.1 * rng.standard_normal(16), jnp.float32)},
    }


def _grads(step):
    rng = np.random.default_rng(100 + step)
    scale = 10.0 ** rng.uniform(-4, 1, (8, 16))  # gradients over five decades
    return {
        "w": jnp.asarray(rng.standard_normal((8, 16)) * scale, jnp.float32),
        "norm": {"scale": jnp.asarray(rng.standard_normal(16) * 1e-3, jnp.float32)},
    }


def _bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _reference_step(params, mu, nu, grads, t, cfg):
    """One AdamW step in float64 from the stored moments: the new moments (computed from the
    fp32 gradients, used unrounded for this step's update, as optax does) and parameters."""
    f64 = lambda tree: jax.tree.map(lambda x: np.asarray(x, np.float64), tree)  # noqa: E731
    params, mu, nu, grads = f64(params), f64(mu), f64(nu), f64(grads)
    mu = jax.tree.map(lambda m, g: (1 - cfg.b1) * g + cfg.b1 * m, mu, grads)
    nu = jax.tree.map(lambda v, g: (1 - cfg.b2) * g * g + cfg.b2 * v, nu, grads)
    lr, c1, c2 = float(learning_rate_schedule(cfg)(t - 1)), 1 - cfg.b1**t, 1 - cfg.b2**t
    decay = {"w": True, "norm": {"scale": False}}  # matrices only

    def update(x, m, v, d):
        return x - lr * (
            (m / c1) / (np.sqrt(v / c2) + cfg.eps) + (cfg.weight_decay * x if d else 0)
        )

    return jax.tree.map(update, params, mu, nu, decay), mu, nu


def _adam_state(opt_state):
    """The `ScaleByAdamState` inside the optimizer's state (multi_transform -> chain -> adamw)."""
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    assert len(found) == 1
    return found[0]


def test_bf16_moments_are_stored_in_bf16_and_the_update_is_adams():
    cfg = CFG.replace(moment_dtype="bfloat16")
    opt = make_optimizer(cfg)
    params = _params()
    state = opt.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(make_optimizer(CFG).init(params))
    apply = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
        *opt.update(g, s, p)))  # fmt: skip
    for t in range(1, 7):
        adam = _adam_state(state)
        want_p, want_mu, want_nu = _reference_step(params, adam.mu, adam.nu, _grads(t), t, cfg)
        params, state = apply(params, state, _grads(t))
        adam = _adam_state(state)
        assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {np.dtype(jnp.bfloat16)}
        assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(np.float32)}
        for got, want in ((adam.mu, want_mu), (adam.nu, want_nu)):
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                # bfloat16 rounding of the same value; a tie may round the other way (one ulp)
                np.testing.assert_allclose(np.asarray(g, np.float64), _bf16(w), rtol=2**-7)
        for g, w in zip(jax.tree.leaves(params), jax.tree.leaves(want_p), strict=True):
            np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-6, atol=1e-7)


def test_fp32_moments_by_default_as_optax_adamw():
    params = _params()
    adam = _adam_state(make_optimizer(CFG).init(params))
    assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {np.dtype(np.float32)}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"moment_dtype": "float16"}, "moment_dtype"),
        ({"moment_dtype": "bfloat16", "b2": 0.999}, "b2"),
    ],
)
def test_moment_dtype_configs_that_cannot_work_are_refused(change, field):
    with pytest.raises(ValueError, match=rf"TrainConfig\.{field}="):
        TrainConfig(**change)
    TrainConfig(moment_dtype="bfloat16", b2=0.99)  # 1% a step: resolved


def test_bf16_moments_flag_sets_the_train_config():
    from moejax.cli import train_inputs, train_lm

    args = train_lm.build_parser().parse_args(["--preset", "micro", "--bf16-moments"])
    assert train_inputs.configs(args)[1].moment_dtype == "bfloat16"
    default = train_lm.build_parser().parse_args(["--preset", "micro"])
    assert train_inputs.configs(default)[1].moment_dtype is None


@pytest.mark.slow  # two micro compiles; the optimizer's numerics are the first test's
def test_micro_lm_trains_with_bf16_moments_as_with_fp32_ones():
    """8 steps of the micro LM on the 2x4 mesh, the same batches: the losses with bfloat16
    moments stay within 0.01 nats of those with fp32 moments (the moments differ by bfloat16's
    rounding, 2^-9 relative, so the updates differ by about as much), and the state keeps its
    dtypes from step to step (one compile)."""
    from _helpers import MODEL, TRAIN, corpus, mesh

    from moejax.data import BatchIterator
    from moejax.training import global_batch, init_train_state, make_train_step

    m = mesh()
    it = BatchIterator(corpus().tokens, TRAIN.batch_size, MODEL.max_seq_len, seed=0)
    batches = [global_batch(it.next(), m) for _ in range(TRAIN.steps)]
    losses = {}
    for dtype in (None, "bfloat16"):
        cfg = TRAIN.replace(moment_dtype=dtype)
        step = make_train_step(MODEL, cfg, m)
        state = init_train_state(MODEL, cfg, m)
        dtypes = {x.dtype for x in jax.tree.leaves(_adam_state(state.opt_state))}
        losses[dtype] = []
        for batch in batches:
            state, metrics = step(state, batch)
            losses[dtype].append(float(metrics.loss))
        assert {x.dtype for x in jax.tree.leaves(_adam_state(state.opt_state))} == dtypes
        assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype(np.float32)}
    assert dtypes == {np.dtype(jnp.int32), np.dtype(jnp.bfloat16)}
    gap = np.abs(np.subtract(losses[None], losses["bfloat16"]))
    assert losses[None][-1] < losses[None][0] - 0.5  # it trains
    assert gap.max() <= 0.01, gap


def test_resume_keeps_the_saved_moment_dtype_even_of_an_older_checkpoint():
    """The saved moments are stored in it; a checkpoint written before the field existed had
    the default (the parameters' dtype)."""
    from moejax.training import ResumeMismatch, resume

    older = {"step": 4, "train": {"seed": 0}}
    with pytest.raises(ResumeMismatch, match=r"TrainConfig\.moment_dtype=None, this run has"):
        resume.check(older, TrainConfig(moment_dtype="bfloat16"), "run/checkpoints/4")
    assert resume.check(older, TrainConfig(), "run/checkpoints/4") == []
