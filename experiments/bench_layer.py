"""Benchmark one MoE layer, forward + backward, against a dense FFN of the same active FLOPs.

Shapes (issue 2): T=8192, D=512, F=1024, E=8, K=2, fp32, SwiGLU, Mixtral routing (softmax, top-2,
renormalised). Two routings: `balanced` (a random router) and `zipf1.2` (expert loads, as shares of
the T*K assignments, follow Zipf(1.2); set through a constant input feature so that moejax and
PyTorch see the same router and route identically). Variants, all forward + backward of
`sum(y**2)` w.r.t. the input and every weight:

- `dense FFN`: one SwiGLU FFN over T*K rows (the same matmul FLOPs as the layer), the baseline;
- `moejax auto`: `moe_apply(..., implementation="auto")`, dropless (the fused blocked CPU path);
- `phases`: the unfused path (`permute` -> `blocked_gmm` x3 -> `combine`, as each device runs it
  under `moejax.parallel`);
- `ragged_dot`, and `capacity 1.25` (our capacity mode, factor 1.25, "auto" implementation: it
  computes only the kept rows, so under skew it does less work than dropless because it drops);
- `capacity 1.25, padded buffer`: capacity mode as Switch/GShard-style layers compute it, with
  static shapes: kept assignments scattered into an `[E, C, D]` buffer (C = 1.25 T K / E), one
  batched einsum per projection over the whole buffer, gathered back (output checked against
  moejax's capacity mode);
- with torch and transformers installed: Hugging Face's `MixtralSparseMoeBlock` holding the same
  weights (its output is checked against moejax's) and a dense torch FFN over T*K rows.

Timing: `--rounds` interleaved rounds after two warm-up calls per variant; each round times every
variant once, one after the other (JAX and torch never run concurrently). Reported: median wall
time, min-max spread, and ratios taken within each round then medianed (the machine is shared and
noisy: compare ratios, not absolute times). `others` is the median CPU (in cores) that other
processes used during a variant's samples, read from /proc/stat; a quiet machine shows ~0.

Install the optional benchmark extra (torch pinned, and taken from PyTorch's CPU wheel index so
that pip does not resolve `torch==2.13.0` to the multi-GB CUDA build on Linux):
    pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    pip install -e '.[bench]'

Run: python experiments/bench_layer.py [--rounds 7] [--no-torch] [--skip-ragged]
(~14-38 min on 2 shared CPU cores; ragged_dot takes about half)
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
from moejax import parallel

HZ = os.sysconf("SC_CLK_TCK")
DENSE, AUTO = "dense FFN (T*K rows)", "moejax auto"
PHASES = "phases (permute, blocked_gmm, combine)"
RAGGED, CAPACITY = "ragged_dot", "capacity 1.25 (auto)"
PADDED = "capacity 1.25, padded [E, C, D] buffer"
TORCH_BLOCK, TORCH_DENSE = "HF MixtralSparseMoeBlock (torch)", "dense FFN (torch, T*K rows)"


def _busy_seconds() -> float:
    """CPU seconds all processes have spent busy (from /proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(a) for a in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / HZ


def sample(fn) -> tuple[float, float]:
    """`(wall seconds, cores used by other processes meanwhile)` of one call of `fn`."""
    b0, c0, t0 = _busy_seconds(), time.process_time(), time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    others = _busy_seconds() - b0 - (time.process_time() - c0)
    return wall, max(others, 0.0) / wall


def jax_step(loss, *args):
    """A thunk running forward + backward of `loss(*args)` w.r.t. every argument."""
    grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
    return lambda: jax.block_until_ready(grad(*args))


def dense_loss(w, x):
    y = (jax.nn.silu(x @ w["w_gate"]) * (x @ w["w_up"])) @ w["w_down"]
    return jnp.sum(y * y)


def layer_loss(cfg, impl):
    def loss(params, x):
        return jnp.sum(moejax.moe_apply(params, x, cfg, implementation=impl)[0] ** 2)

    return loss


def phases_loss(cfg):
    """The unfused dropless layer: permute, three block-loop grouped matmuls, combine, as one
    device of `moejax.parallel` runs them (`parallel.local_moe` holding every expert)."""

    def loss(params, x):
        r = moejax.route(params["router"], x, cfg, num_sequences=1)
        y = parallel.local_moe(
            x, r.expert_index, r.weight, r.kept, params["experts"], cfg, "blocked"
        )
        return jnp.sum(y**2)

    return loss


def padded_capacity_loss(cfg):
    """Capacity mode on a static `[E, C, D]` buffer (the Switch/GShard formulation), gather/scatter.

    The assignments kept by `apply_capacity` (slot-major, then position priority) go to row
    `position` of their expert's buffer; every buffer row is multiplied, filled or not.
    """

    def forward(params, x):
        routing = moejax.apply_capacity(
            moejax.route(params["router"], x, cfg, num_sequences=1), cfg, 1
        )
        t, k = routing.expert_index.shape
        e, c, d = cfg.num_experts, cfg.capacity(t), x.shape[-1]
        expert = routing.expert_index.T.reshape(-1)  # [K*T], slot-major = priority order
        onehot = jax.nn.one_hot(expert, e, dtype=jnp.int32)
        position = ((jnp.cumsum(onehot, axis=0) - 1) * onehot).sum(-1)  # [K*T]
        row = jnp.where(routing.kept.T.reshape(-1), expert * c + position, e * c)
        token = jnp.tile(jnp.arange(t), k)
        buf = jnp.zeros((e * c, d), x.dtype).at[row].set(x[token], mode="drop").reshape(e, c, d)
        w = params["experts"]
        h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", buf, w["w_gate"]))
        h = h * jnp.einsum("ecd,edf->ecf", buf, w["w_up"])
        out = jnp.einsum("ecf,efd->ecd", h, w["w_down"]).reshape(e * c, d)
        y = out.at[row].get(mode="fill", fill_value=0.0)  # [K*T, D]; dropped rows read 0
        y = y * routing.weight.T.reshape(-1, 1)
        return y.reshape(k, t, d).sum(0)

    return forward, lambda params, x: jnp.sum(forward(params, x) ** 2)


def zipf_router(params, x, cfg, s: float):
    """Router params whose expert loads follow Zipf(s), via the constant feature `x[:, 0] = 1`.

    Row 0 of the router kernel becomes `scale * log p_zipf`; `scale` is bisected until the most
    loaded expert's share of the T*K assignments equals `p_zipf[0]`. Returns `(params, shares)`.
    """
    e = cfg.num_experts
    p = np.arange(1, e + 1, dtype=np.float64) ** -s
    p /= p.sum()
    route = jax.jit(lambda prm: moejax.route(prm["router"], x, cfg, num_sequences=1))

    def with_scale(scale):
        kernel = params["router"]["kernel"].at[0].set(scale * jnp.log(jnp.asarray(p, jnp.float32)))
        prm = {**params, "router": {**params["router"], "kernel": kernel}}
        idx = np.asarray(route(prm).expert_index).ravel()
        return prm, np.bincount(idx, minlength=e) / idx.size

    lo, hi = 0.0, 64.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if with_scale(mid)[1].max() < p[0] else (lo, mid)
    return with_scale(hi)


def torch_steps(params, x, cfg, threads):
    """Thunks for HF MixtralSparseMoeBlock (same weights as `params`) and a dense torch FFN."""
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.set_num_threads(threads)
    d, f, e, k = cfg.d_model, cfg.d_ff, cfg.num_experts, cfg.top_k
    hf = MixtralConfig(
        hidden_size=d, intermediate_size=f, num_local_experts=e, num_experts_per_tok=k
    )
    block = MixtralSparseMoeBlock(hf).float()

    def tensor(a):
        return torch.from_numpy(np.array(a, np.float32))

    ex = params["experts"]
    with torch.no_grad():
        block.gate.weight.copy_(tensor(params["router"]["kernel"]).T)
        if hasattr(block.experts, "gate_up_proj"):  # transformers >= 5: stacked expert tensors
            gate_up = np.concatenate([ex["w_gate"], ex["w_up"]], axis=2)  # [E, D, 2F]
            block.experts.gate_up_proj.copy_(tensor(gate_up).transpose(1, 2))
            block.experts.down_proj.copy_(tensor(ex["w_down"]).transpose(1, 2))
        else:  # transformers 4.x: one module per expert, w1 = gate, w3 = up, w2 = down
            for i, mlp in enumerate(block.experts):
                mlp.w1.weight.copy_(tensor(ex["w_gate"][i]).T)
                mlp.w3.weight.copy_(tensor(ex["w_up"][i]).T)
                mlp.w2.weight.copy_(tensor(ex["w_down"][i]).T)
    block.train()
    xt = tensor(x)[None].requires_grad_(True)
    weights = [tensor(ex[n][0]).requires_grad_(True) for n in ("w_gate", "w_up", "w_down")]
    xd = torch.randn(x.shape[0] * k, d, requires_grad=True)

    def run_block():
        block.zero_grad(set_to_none=True)
        xt.grad = None
        y = block(xt)
        y = y[0] if isinstance(y, tuple) else y
        (y * y).sum().backward()

    def run_dense():
        for t in (xd, *weights):
            t.grad = None
        wg, wu, wd = weights
        y = (torch.nn.functional.silu(xd @ wg) * (xd @ wu)) @ wd
        (y * y).sum().backward()

    with torch.no_grad():
        y = block(xt)
        y = (y[0] if isinstance(y, tuple) else y)[0].numpy()
    return {TORCH_BLOCK: run_block, TORCH_DENSE: run_dense}, y


def run_rounds(steps: dict, rounds: int) -> dict:
    """Two warm-up calls per step, then `rounds` interleaved rounds of one sample per step."""
    for fn in steps.values():
        fn()
        fn()
    samples = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            samples[name].append(sample(fn))
    return samples


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument(
        "--skip-ragged",
        action="store_true",
        help="leave out ragged_dot (~8x dense, half of the run's time) for more rounds of the rest",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    args = parser.parse_args()
    t, d, f, e, k = args.tokens, args.d_model, args.d_ff, args.experts, args.top_k
    kw = {} if args.block_size is None else {"block_size": args.block_size}
    cfg = moejax.MoEConfig(d_model=d, d_ff=f, num_experts=e, top_k=k, **kw)
    flops = 3 * (2 * t * k * d * f) * 3  # 3 matmuls; forward + 2x for backward
    print(
        f"T={t} D={d} F={f} E={e} K={k} fp32 fwd+bwd; {flops / 1e9:.1f} GFLOP of expert matmuls; "
        f"block_size={cfg.block_size}; jax {jax.__version__} on {jax.devices()[0].device_kind}, "
        f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}"
    )
    params = moejax.init_moe_params(cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (t, d), jnp.float32).at[:, 0].set(1.0)
    dense_w = {n: params["experts"][n][0] for n in ("w_gate", "w_up", "w_down")}
    x_dense = jax.random.normal(jax.random.key(2), (t * k, d), jnp.float32)
    capacity = cfg.replace(drop_policy="capacity", capacity_factor=1.25)
    routings = {
        "balanced": ({**params, "router": {"kernel": params["router"]["kernel"].at[0].set(0.0)}}),
        "zipf1.2": zipf_router(params, x, cfg, 1.2)[0],
    }
    torch_note = None
    steps, loads, kept = {}, {}, {}
    for rname, prm in routings.items():
        counts = np.asarray(moejax.moe_apply(prm, x, cfg)[1].expert_counts)
        loads[rname] = counts / counts.sum()
        dropped = float(moejax.moe_apply(prm, x, capacity)[1].dropped_fraction)
        print(f"{rname}: capacity mode 1.25 drops {dropped:.1%} of the assignments")
        steps[rname, DENSE] = jax_step(dense_loss, dense_w, x_dense)
        steps[rname, AUTO] = jax_step(layer_loss(cfg, "auto"), prm, x)
        steps[rname, PHASES] = jax_step(phases_loss(cfg), prm, x)
        if not args.skip_ragged:
            steps[rname, RAGGED] = jax_step(layer_loss(cfg, "ragged_dot"), prm, x)
        steps[rname, CAPACITY] = jax_step(layer_loss(capacity, "auto"), prm, x)
        padded_forward, padded_loss = padded_capacity_loss(capacity)
        y_cap = np.asarray(moejax.moe_apply(prm, x, capacity)[0])
        err = np.abs(np.asarray(jax.jit(padded_forward)(prm, x)) - y_cap).max()
        print(f"{rname}: padded capacity buffer vs moejax capacity mode, max |diff| = {err:.1e}")
        steps[rname, PADDED] = jax_step(padded_loss, prm, x)
        kept[rname] = 1.0 - dropped
        if args.no_torch:
            continue
        try:
            torch_fns, y_torch = torch_steps(prm, x, cfg, args.threads)
        except ImportError as err:
            torch_note = f"torch rows skipped: {err.name} not installed (pip install -e '.[bench]')"
            continue
        y_jax = np.asarray(moejax.moe_apply(prm, x, cfg)[0])
        err = np.abs(y_torch - y_jax).max() / np.abs(y_jax).max()
        print(f"{rname}: HF Mixtral block vs moejax output, max |diff| / max |y| = {err:.1e}")
        steps.update({(rname, name): fn for name, fn in torch_fns.items()})
    for rname, share in loads.items():
        print(f"{rname}: expert load shares {np.round(share, 3).tolist()}")
    if torch_note:
        print(torch_note)

    samples = run_rounds(steps, args.rounds)
    report(samples, loads, kept, flops, args.rounds)


def _ratio(samples, a, b) -> float:
    """Median over rounds of `wall(a) / wall(b)` within the same round."""
    return statistics.median(x[0] / y[0] for x, y in zip(samples[a], samples[b], strict=True))


def report(samples, loads, kept, flops, rounds):
    """The markdown table and the issue's targets."""
    print(f"\n{rounds} rounds; ratios are medians of per-round ratios.\n")
    print(
        "| routing (max/mean load) | variant | median s | min-max s | x dense FFN (jax) "
        "| x torch dense | GFLOP/s | others (cores) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (rname, name), s in samples.items():
        wall = [w for w, _ in s]
        td = (rname, TORCH_DENSE)
        vs_torch = f"{_ratio(samples, (rname, name), td):.3f}" if td in samples else "-"
        vs_dense = _ratio(samples, (rname, name), (rname, DENSE))
        imb = loads[rname].max() * len(loads[rname])
        print(
            f"| {rname} ({imb:.2f}) | {name} | {statistics.median(wall):.3f} "
            f"| {min(wall):.3f}-{max(wall):.3f} | {vs_dense:.3f} | {vs_torch} "
            f"| {flops / statistics.median(wall) / 1e9:.0f} "
            f"| {statistics.median(o for _, o in s):.2f} |"
        )
    print("\nTargets (issue 2, item 10), auto = moejax auto, dropless:")
    targets = [("balanced", DENSE, "<=", 1.05), ("zipf1.2", DENSE, "<=", 1.15)]
    # "Faster in wall time than" ragged_dot, capacity mode at 1.25 and the HF block. Capacity mode
    # at 1.25 as other layers compute it is the padded buffer (1.25x the dropless rows at any
    # skew); our own capacity mode computes only its kept rows, so under skew it is a smaller
    # computation (it drops), compared per computed row below.
    targets += [
        (r, other, "<", 1.0)
        for r in loads
        for other in (RAGGED, PADDED, TORCH_BLOCK)
        if (r, other) in samples
    ]
    for rname, other, op, bound in targets:
        r = _ratio(samples, (rname, AUTO), (rname, other))
        verdict = "met" if (r <= bound if op == "<=" else r < bound) else "NOT met"
        print(f"- {rname}: auto / {other} = {r:.3f} (target {op} {bound}): {verdict}")
    for rname in loads:
        r = _ratio(samples, (rname, AUTO), (rname, CAPACITY))
        per_row = r * kept[rname]  # (t_auto / rows) / (t_cap / (kept * rows))
        verdict = "met" if per_row < 1.0 else "NOT met"
        print(
            f"- {rname}: auto / {CAPACITY} = {r:.3f} in wall time, which keeps "
            f"{kept[rname]:.1%} of the assignments; per computed row {per_row:.3f} "
            f"(target < 1): {verdict}"
        )


if __name__ == "__main__":
    main()
