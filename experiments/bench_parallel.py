"""Expert parallelism: dispatch-buffer bytes of bounded dropless vs worst case vs capacity 1.0,
communication per mode (cost model), and indicative times on simulated devices.

Shapes: T = 8192 tokens over N = 8 expert-axis devices (T_local = 1024), D = 256, F = 512,
E = 16, K = 2, fp32. Routings: "balanced" (random router on Gaussian tokens), "zipf" (router bias
log p with p ~ Zipf(1.2) over experts), "trained" (a router trained for 150 Adam steps on
clustered synthetic tokens with the load-balance loss), and with `--lm-run` the real routing of
a trained LM (below). For each routing the host picks the dropless bucket
from the *previous* batch (`max_pair_count` -> `choose_bucket`, capped at 1.25x balanced) and the
current batch is sent with it (extra rounds if it is more skewed). Zero drops is checked by
running the sharded layer on 8 simulated devices and comparing with the single-device layer.

Real routing: `--lm-run runs/tiny` adds one row per MoE layer of the LM that `train_lm.py`
trained there (its latest checkpoint), routing its own hidden states of held-out text at
T = 8192 tokens (`moejax.models.moe_layer_inputs`; the LM's own E, K, D, F).

Run: python experiments/bench_parallel.py [--repeats 3] [--skip-times] [--lm-run runs/tiny]
(~3-6 min on 2 cores)
Times on simulated CPU devices are indicative only: collectives are memcpys within one process.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax
import jax.numpy as jnp
import numpy as np
import optax

import moejax
from moejax import parallel
from moejax.parallel import traffic

T, D, F, E, K, N = 8192, 256, 512, 16, 2, 8
CFG = moejax.MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K, router_bias=True, block_size=128)


def tokens(key, clusters=None):
    if clusters is None:
        return jax.random.normal(key, (T, D))
    k1, k2 = jax.random.split(key)
    which = jax.random.randint(k1, (T,), 0, clusters.shape[0])
    return clusters[which] + 0.5 * jax.random.normal(k2, (T, D))


def zipf_params(params, s=1.2):
    p = np.arange(1, E + 1, dtype=np.float64) ** -s
    bias = jnp.asarray(np.log(p / p.sum()) * 3.0, jnp.float32)  # sharpened Zipf(1.2) preference
    return {**params, "router": {**params["router"], "bias": bias}}


def train_router(params, clusters, steps=150):
    """Train the layer (router included) to imitate a random teacher, with the balance loss."""
    teacher = jax.random.normal(jax.random.key(7), (D, D)) / math.sqrt(D)
    opt = optax.adam(3e-3)

    def loss(p, x):
        y, aux = moejax.moe_apply(p, x, CFG, implementation="blocked")
        return jnp.mean((y - jnp.tanh(x @ teacher)) ** 2) + 0.01 * aux.load_balance_loss

    @jax.jit
    def step(p, s, key):
        x = tokens(key, clusters)[:2048]
        g = jax.grad(loss)(p, x)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    state = opt.init(params)
    for i in range(steps):
        params, state = step(params, state, jax.random.key(1000 + i))
    return params


def routing_stats(params, x, cfg=CFG):
    """Max (source, destination) count and capacity-1.0 drops, per device shard of x."""
    r = moejax.route(params["router"], x, cfg)
    kept = jnp.ones(r.expert_index.shape, bool)
    pair = parallel.max_pair_count(r.expert_index, kept, N, N, cfg.num_experts)
    cap = cfg.replace(drop_policy="capacity", capacity_factor=1.0)
    dropped = 0
    for shard in jnp.split(r.expert_index, N):  # capacity counted per device (GShard groups)
        sub = moejax.Routing(None, None, shard, jnp.ones(shard.shape), jnp.ones(shard.shape, bool))
        dropped += int((~moejax.apply_capacity(sub, cap).kept).sum())
    return pair, dropped / (x.shape[0] * cfg.top_k)


def check_dropless(params, x, bucket, mesh, cfg=CFG):
    """Run the sharded bounded-dropless layer; return (dropped fraction, max |y - y_single|)."""
    p = parallel.shard_params(params, cfg, mesh)
    xs = parallel.shard_activations(x, mesh)
    strategy = parallel.Strategy(dispatcher="dropless", bucket=bucket)
    f = jax.jit(lambda p, x: parallel.moe_apply_sharded(p, x, cfg, mesh, strategy=strategy))
    y, aux = f(p, xs)
    y0, _ = jax.jit(lambda p, x: moejax.moe_apply(p, x, cfg))(params, x)
    y, y0 = jax.device_get((y, y0))  # sharded vs single device: compare on the host
    return float(aux.dropped_fraction), float(np.max(np.abs(y - y0)))


def layer_shape(cfg=CFG, tokens=T):
    return traffic.LayerShape(
        tokens=tokens // N,
        top_k=cfg.top_k,
        d_model=cfg.d_model,
        d_ff=cfg.d_ff,
        num_experts=cfg.num_experts,
        n=N,
    )


def buffer_table(routings, mesh):
    """One row per `(name, params, x_prev, x[, cfg])` routing (`cfg` defaults to `CFG`)."""
    rows = []
    for name, params, x_prev, x, *rest in routings:
        cfg = rest[0] if rest else CFG
        shape = layer_shape(cfg, x.shape[0])
        cap1 = traffic.buffer_bytes(shape, "capacity", capacity_factor=1.0)
        worst = traffic.buffer_bytes(shape, "worst")
        prev_pair, _ = routing_stats(params, x_prev, cfg)
        bucket = parallel.choose_bucket(prev_pair, x.shape[0] // N, cfg.top_k, N)
        pair, cap_drop = routing_stats(params, x, cfg)
        rounds = math.ceil(pair / bucket)
        dl = traffic.buffer_bytes(shape, "dropless", bucket=bucket)
        dropped, err = check_dropless(params, x, bucket, mesh, cfg)
        rows.append((name, pair, bucket, rounds, dl, worst, cap1, cap_drop, dropped, err))
        print(
            f"| {name} | {pair} | {bucket} | {rounds} | {dl / 2**20:.2f} | {worst / 2**20:.2f} | "
            f"{cap1 / 2**20:.2f} | {dl / cap1:.2f}x | {cap_drop:.1%} | {dropped:.0%} | {err:.1e} |",
            flush=True,
        )
    return rows


def comm_table(shape, bucket, rounds):
    items = [
        ("expert / capacity 1.0", traffic.comm_bytes(shape, "expert", "capacity")),
        (
            f"expert / dropless (B={bucket}, R={rounds})",
            traffic.comm_bytes(shape, "expert", "dropless", bucket=bucket, rounds=rounds),
        ),
        ("expert / allgather", traffic.comm_bytes(shape, "expert", "allgather")),
        ("data (weights all-gathered)", traffic.comm_bytes(shape, "data")),
        ("tensor (weights re-sliced)", traffic.comm_bytes(shape, "tensor")),
    ]
    for name, b in items:
        print(f"| {name} | {b / 2**20:.2f} |")


def time_table(params, x, mesh, repeats):
    p = parallel.shard_params(params, CFG, mesh)
    xs = parallel.shard_activations(x, mesh)
    strategies = [
        parallel.Strategy(dispatcher="dropless"),
        parallel.Strategy(dispatcher="dropless", chunks=4),
        parallel.Strategy(dispatcher="allgather"),
        parallel.Strategy(mode="data"),
        parallel.Strategy(mode="tensor"),
    ]
    for s in strategies:

        def loss(p, x, s=s):
            y, aux = parallel.moe_apply_sharded(p, x, CFG, mesh, strategy=s)
            return jnp.sum(y * y) + 0.01 * aux.load_balance_loss

        f = jax.jit(jax.grad(loss, argnums=(0, 1)))
        jax.block_until_ready(f(p, xs))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f(p, xs))
            ts.append(time.perf_counter() - t0)
        print(
            f"| {s.mode} / {s.dispatcher if s.mode == 'expert' else '-'} | {s.chunks} | "
            f"{statistics.median(ts) * 1e3:.0f} |",
            flush=True,
        )


def lm_routings(run_dir: str, preset: str):
    """Real routing: each MoE layer of the LM trained in `run_dir` (its latest checkpoint) on its
    own hidden states (`moejax.models.moe_layer_inputs`) for two held-out batches of T tokens of
    the default corpus (the first picks the bucket, the second is sent)."""
    from moejax import data
    from moejax.models import moe_layer_inputs, presets
    from moejax.training import Checkpointer, abstract_state
    from moejax.training import presets as train_presets
    from moejax.training.checkpoint import restore_target

    model_cfg, train_cfg = presets.get(preset), train_presets.get(preset)
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), model_cfg, train_cfg)
    step = ckpt.latest_step()
    state, _ = ckpt.restore(step, restore_target(abstract_state(model_cfg, train_cfg), None))
    ckpt.close()
    seq = model_cfg.max_seq_len
    _, held_out = data.default_corpus().split(train_cfg.eval_fraction)
    batches = [
        held_out[i * T : (i + 1) * T].reshape(T // seq, seq).astype(np.int32) for i in range(2)
    ]
    inputs = jax.jit(moe_layer_inputs, static_argnums=2)
    prev, cur = (inputs(state.params, jnp.asarray(b), model_cfg) for b in batches)
    cfg = model_cfg.moe
    return [
        (
            f"{preset} LM step {step}, MoE layer {j}",
            state.params["layers"][i]["moe"],
            prev[j].reshape(T, cfg.d_model),
            cur[j].reshape(T, cfg.d_model),
            cfg,
        )
        for j, i in enumerate(model_cfg.moe_layers)
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-times", action="store_true")
    ap.add_argument(
        "--lm-run",
        help="a train_lm.py run directory (e.g. runs/tiny): add one row per MoE layer with the "
        "trained LM's real routing of held-out text",
    )
    ap.add_argument("--lm-preset", default="tiny", help="the preset --lm-run trained")
    args = ap.parse_args()
    mesh = parallel.make_mesh((N,), ("expert",))
    base = moejax.init_moe_params(CFG, jax.random.key(0))
    clusters = 2.0 * jax.random.normal(jax.random.key(3), (32, D))
    t0 = time.perf_counter()
    trained = train_router(base, clusters)
    print(f"trained router in {time.perf_counter() - t0:.0f} s", flush=True)
    keys = jax.random.split(jax.random.key(11), 6)
    routings = [
        ("balanced", base, tokens(keys[0]), tokens(keys[1])),
        ("zipf 1.2", zipf_params(base), tokens(keys[2]), tokens(keys[3])),
        ("trained", trained, tokens(keys[4], clusters), tokens(keys[5], clusters)),
    ]
    print(
        "| routing | max pair | bucket B | rounds | dropless MiB | worst MiB | cap1.0 MiB | "
        "dropless/cap1.0 | cap1.0 drops | dropless drops | max abs err vs 1 device |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = buffer_table(routings, mesh)
    if args.lm_run:
        buffer_table(lm_routings(args.lm_run, args.lm_preset), mesh)
    print("\n| mode | forward MiB moved per device (cost model) |\n|---|---|")
    comm_table(layer_shape(), rows[1][2], rows[1][3])
    if not args.skip_times:
        print("\n| mode / dispatcher | chunks | fwd+bwd ms (indicative) |\n|---|---|---|")
        time_table(base, routings[0][3], mesh, args.repeats)


if __name__ == "__main__":
    main()
