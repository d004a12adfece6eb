"""Demo of one MoE layer on 8 simulated CPU devices' worth of tokens: routing statistics, dropped
tokens, and agreement of every implementation with the per-expert loop reference.

Run: python experiments/demo_layer.py   (~20 s on 2 CPU cores)
"""

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

import moejax
from moejax import presets


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--preset", default="mixtral", choices=sorted(presets.PRESETS))
    args = parser.parse_args()

    cfg = presets.PRESETS[args.preset](d_model=128, d_ff=256, num_experts=8, block_size=64)
    params = moejax.init_moe_params(cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (args.tokens // 128, 128, cfg.d_model))
    impls = ["reference", "ragged_dot", "blocked"]
    outs = {
        i: jax.jit(lambda p, x, i=i: moejax.moe_apply(p, x, cfg, implementation=i))(params, x)
        for i in impls
    }
    y_ref, aux = outs["reference"]
    counts = np.asarray(aux.expert_counts)
    print(
        f"preset={args.preset} router={cfg.router} T={x.shape[0] * x.shape[1]} "
        f"E={cfg.num_experts} K={cfg.top_k} drop_policy={cfg.drop_policy}"
    )
    print("tokens per expert:", " ".join(f"{c:5d}" for c in counts))
    print(
        f"load imbalance (max/mean): {counts.max() / counts.mean():.3f}   "
        f"load-balance loss: {float(aux.load_balance_loss):.4f}   z-loss: {float(aux.z_loss):.3f}"
    )
    print(f"dropped assignments: {int(aux.dropped_mask.sum())} ({float(aux.dropped_fraction):.2%})")
    print(f"{'implementation':<14} {'max |y - reference|':>20}")
    for impl in impls:
        err = float(jnp.abs(outs[impl][0] - y_ref).max())
        print(f"{impl:<14} {err:>20.2e}")


if __name__ == "__main__":
    main()
