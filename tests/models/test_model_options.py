"""The config-driven attention options of the Hugging Face families (`qk_norm`, attention
biases, `rope_scaling`): created, sharded (heads over `model`, widths over `fsdp`) and computed
on a mesh as on one device; the default config's tree is unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import MoEConfig, parallel
from moejax.models import LMConfig, RopeScaling, init_lm_params, lm_forward, lm_partition_specs
from moejax.models._lm_params import abstract_params

MOE = MoEConfig(d_model=32, d_ff=16, num_experts=4, top_k=2)
BASE = LMConfig(
    vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    max_seq_len=16, moe=MOE,
)  # fmt: skip
FULL = BASE.replace(
    qk_norm="full",
    attention_bias=True,
    attention_out_bias=True,
    rope_scaling=RopeScaling("yarn", 4.0, 8),
)


def _perturbed(params, key):
    """Non-trivial biases and norm gains (they are initialised to 0 and 1)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(
        tree, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    )


def test_default_tree_has_no_new_leaves():
    attn = abstract_params(BASE)["layers"][0]["attn"]
    assert sorted(attn) == ["wk", "wo", "wq", "wv"]
    full = abstract_params(FULL)["layers"][0]["attn"]
    assert full["q_norm"]["scale"].shape == (4, 8) and full["k_norm"]["scale"].shape == (2, 8)
    assert full["bq"].shape == (4, 8) and full["bk"].shape == (2, 8) and full["bo"].shape == (32,)
    head = abstract_params(BASE.replace(qk_norm="head"))["layers"][0]["attn"]
    assert head["q_norm"]["scale"].shape == (8,)


@pytest.mark.slow  # 18 s: three compiles on 8 devices
def test_options_on_a_mesh_equal_one_device():
    mesh = parallel.make_mesh((2, 2, 2), ("fsdp", "expert", "model"))
    params = _perturbed(init_lm_params(FULL, jax.random.key(0)), jax.random.key(1))
    specs = lm_partition_specs(FULL, mesh)
    assert specs["layers"][0]["attn"]["q_norm"]["scale"][0] == "model"
    assert specs["layers"][0]["attn"]["bk"][0] == "model"
    placed = jax.device_put(
        params, jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs)
    )
    tokens = jax.random.randint(jax.random.key(2), (4, 16), 0, 64)
    one, _ = jax.jit(lambda p: lm_forward(p, tokens, FULL))(params)
    sharded, _ = jax.jit(lambda p: lm_forward(p, tokens, FULL, mesh=mesh))(placed)
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(one), rtol=2e-5, atol=2e-5)
    weights = ("wq", "wk", "wv", "wo")
    layers = [{**x, "attn": {k: x["attn"][k] for k in weights}} for x in params["layers"]]
    plain, _ = jax.jit(lambda p: lm_forward(p, tokens, BASE))({**params, "layers": layers})
    assert not np.allclose(np.asarray(plain), np.asarray(one), atol=1e-3)  # the options act
    assert jnp.isfinite(one).all()


def test_checkpoints_from_before_the_options_still_resume(tmp_path):
    """A checkpoint's model metadata written before these fields existed matches a model that
    leaves them off, and not one that turns one on."""
    from moejax.training import CheckpointError
    from moejax.training import presets as train_presets
    from moejax.training.checkpoint import Checkpointer, _flat_config

    new = ("qk_norm", "attention_bias", "attention_out_bias", "rope_scaling")
    old_meta = {k: v for k, v in _flat_config(BASE).items() if k not in new}
    train = train_presets.get("micro")
    Checkpointer(str(tmp_path / "a"), BASE, train)._check_model(old_meta, "ckpt")
    with pytest.raises(CheckpointError, match="qk_norm='<missing>' there, 'head' here"):
        Checkpointer(str(tmp_path / "b"), BASE.replace(qk_norm="head"), train)._check_model(
            old_meta, "ckpt"
        )


def test_checkpoints_from_before_mtp_input_resume_only_without_mtp(tmp_path):
    """Before `mtp_input` existed the MTP blocks read the pre-norm state: such a checkpoint with
    MTP blocks is refused naming the field (the default is now the final-normed state); one
    without them resumes."""
    from moejax.training import CheckpointError
    from moejax.training import presets as train_presets
    from moejax.training.checkpoint import Checkpointer, _flat_config

    train = train_presets.get("micro")
    for cfg in (BASE, BASE.replace(mtp_layers=1)):
        old_meta = {k: v for k, v in _flat_config(cfg).items() if k != "mtp_input"}
        check = Checkpointer(str(tmp_path / str(cfg.mtp_layers)), cfg, train)._check_model
        if not cfg.mtp_layers:
            check(old_meta, "ckpt")
            continue
        with pytest.raises(CheckpointError, match="mtp_input='pre_norm' there, 'final_norm'"):
            check(old_meta, "ckpt")
        pre = Checkpointer(str(tmp_path / "pre"), cfg.replace(mtp_input="pre_norm"), train)
        pre._check_model(old_meta, "ckpt")
