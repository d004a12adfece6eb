"""Training with multi-token-prediction blocks on the 2 x 4 mesh: the weighted MTP loss is in
the objective and logged on its own (`mtp_loss`), the blocks' parameters train."""

import jax
import numpy as np
from _helpers import MODEL, TRAIN, corpus, host_tree, mesh

from moejax.models import init_lm_params
from moejax.training import train


def test_mtp_loss_is_trained_and_logged_separately(tmp_path):
    model = MODEL.replace(mtp_layers=1)
    cfg = TRAIN.replace(steps=3, warmup_steps=1, checkpoint_every=0, eval_batches=0)
    result = train(
        model, cfg.replace(mtp_loss_weight=0.3), corpus(), run_dir=str(tmp_path), mesh=mesh(),
        progress=False, outputs=False, tensorboard=False, async_checkpoints=False,
    )  # fmt: skip
    recs = result.records
    assert len(recs) == 3 and all(np.isfinite(r["mtp_loss"]) for r in recs)
    # The byte-level MTP block starts near the uniform entropy, ln 256 = 5.5 nats.
    assert 3.0 < recs[0]["mtp_loss"] < 8.0
    for r in recs:  # total = ce + 0.01 lb + 1e-3 z + 0.3 mtp (the micro preset's weights)
        want = r["loss"] + 0.01 * r["load_balance_loss"] + 1e-3 * r["z_loss"]
        np.testing.assert_allclose(r["total_loss"], want + 0.3 * r["mtp_loss"], rtol=1e-5)
    params = host_tree(result.state.params)
    key_params, _ = jax.random.split(jax.random.key(cfg.seed))  # as moejax.training.state
    init = host_tree(jax.jit(init_lm_params, static_argnums=0)(model, key_params))
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), params["mtp"], init["mtp"])
    assert moved[0]["eh_proj"]["kernel"] and moved[0]["block"]["attn"]["wq"]
