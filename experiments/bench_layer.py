"""Benchmark one MoE layer, forward + backward, against a dense FFN of the same active FLOPs.

Shapes (issue 2): T=8192, D=512, F=1024, E=8, K=2, fp32, SwiGLU. For each routing (balanced, and
Zipf(1.2)-skewed via a router bias) it times every implementation, capacity mode at factor 1.25,
and a dense SwiGLU FFN over T*K rows (the same matmul FLOPs), all in one process, medians of
`--repeats` runs after warm-up. With torch and transformers installed (`pip install -e
'.[bench]'`) it also times Hugging Face's MixtralSparseMoeBlock and a dense torch FFN of the same
FLOPs on PyTorch CPU.

Run: python experiments/bench_layer.py [--repeats 7] [--tokens 8192]   (~3-5 min on 2 CPU cores)
Absolute times on a shared CPU are noisy: read the ratios to the dense baseline of the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

import moejax


def timeit(fn, *args, repeats: int) -> float:
    """Median wall seconds of `fn(*args)` after two warm-up calls (compile + one run)."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def layer_step(cfg, impl):
    def loss(params, x):
        y, aux = moejax.moe_apply(params, x, cfg, implementation=impl)
        return jnp.sum(y * y) + 0.01 * aux.load_balance_loss

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def dense_step():
    def loss(w, x):
        h = jax.nn.silu(x @ w["w_gate"]) * (x @ w["w_up"])
        y = h @ w["w_down"]
        return jnp.sum(y * y)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def zipf_router_bias(e: int, s: float) -> np.ndarray:
    """A router bias whose softmax follows Zipf(s) over experts (logits = log p)."""
    p = np.arange(1, e + 1, dtype=np.float64) ** -s
    return np.log(p / p.sum()).astype(np.float32)


def torch_rows(t, d, f, e, k, repeats, routing_bias):
    """HF MixtralSparseMoeBlock and a dense torch FFN of the same FLOPs, fwd+bwd, PyTorch CPU."""
    try:
        import torch
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except ImportError as err:
        return {"note": f"torch/transformers not installed ({err.name}); pip install -e '.[bench]'"}
    torch.manual_seed(0)
    hf_cfg = MixtralConfig(
        hidden_size=d, intermediate_size=f, num_local_experts=e, num_experts_per_tok=k
    )
    block = MixtralSparseMoeBlock(hf_cfg).float()
    if routing_bias is not None:
        with torch.no_grad():  # skew routing the same way: bias through a constant input feature
            block.gate.weight[:, 0] = torch.from_numpy(routing_bias) * 0 + block.gate.weight[:, 0]
    x = torch.randn(1, t, d, requires_grad=True)
    w = [torch.randn(d, f) * d**-0.5, torch.randn(d, f) * d**-0.5, torch.randn(f, d) * f**-0.5]
    for p in w:
        p.requires_grad_(True)
    xd = torch.randn(t * k, d, requires_grad=True)

    def run_block():
        out = block(x)
        out = out[0] if isinstance(out, tuple) else out
        (out * out).sum().backward()

    def run_dense():
        y = (torch.nn.functional.silu(xd @ w[0]) * (xd @ w[1])) @ w[2]
        (y * y).sum().backward()

    def med(fn):
        for _ in range(2):
            fn()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    return {"torch_mixtral_block": med(run_block), "torch_dense": med(run_dense)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--impls", default="blocked,ragged_dot,capacity_1.25")
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args()
    t, d, f, e, k = args.tokens, args.d_model, args.d_ff, args.experts, args.top_k
    kw = {} if args.block_size is None else {"block_size": args.block_size}
    base = moejax.MoEConfig(d_model=d, d_ff=f, num_experts=e, top_k=k, router_bias=True, **kw)
    flops = 3 * 2 * (t * k) * d * f * 3  # 3 matmuls, x2 FLOP/MAC, fwd + 2x bwd
    print(
        f"T={t} D={d} F={f} E={e} K={k} fp32 fwd+bwd, {flops / 1e9:.1f} GFLOP of expert "
        f"matmuls; block_size={base.block_size}; devices={jax.devices()[0].platform}"
    )

    key = jax.random.key(0)
    params = moejax.init_moe_params(base, key)
    x = jax.random.normal(jax.random.key(1), (t, d), jnp.float32)
    dense_w = {n: params["experts"][n][0] for n in ("w_gate", "w_up", "w_down")}
    x_dense = jax.random.normal(jax.random.key(2), (t * k, d), jnp.float32)
    dense = timeit(dense_step(), dense_w, x_dense, repeats=args.repeats)

    rows = []
    for routing in ("balanced", "zipf1.2"):
        p = params
        bias = None
        if routing == "zipf1.2":
            bias = zipf_router_bias(e, 1.2) * 3.0
            p = {**params, "router": {**params["router"], "bias": jnp.asarray(bias)}}
        _, aux = jax.jit(lambda p, x: moejax.moe_apply(p, x, base))(p, x)
        counts = np.asarray(aux.expert_counts)
        imbalance = counts.max() / counts.mean()
        rows.append((routing, "dense FFN (T*K rows)", dense, imbalance))
        for impl in args.impls.split(","):
            cfg, name = base, impl
            if impl.startswith("capacity_"):
                cfg = base.replace(dispatch="capacity", capacity_factor=float(impl.split("_")[1]))
                impl = "auto"
            sec = timeit(layer_step(cfg, impl), p, x, repeats=args.repeats)
            rows.append((routing, name, sec, imbalance))
        if not args.no_torch:
            for name, sec in torch_rows(t, d, f, e, k, args.repeats, bias).items():
                if name == "note":
                    print(sec)
                else:
                    rows.append((routing, name, sec, imbalance))

    print("\n| routing (max/mean load) | variant | median s | x dense FFN (jax) | GFLOP/s |")
    print("|---|---|---|---|---|")
    for routing, name, sec, imb in rows:
        dense_ref = [s for r, n, s, _ in rows if r == routing and n.startswith("dense")][0]
        print(
            f"| {routing} ({imb:.2f}) | {name} | {sec:.3f} | {sec / dense_ref:.2f} | "
            f"{flops / sec / 1e9:.0f} |"
        )


if __name__ == "__main__":
    main()
