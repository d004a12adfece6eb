"""The first thing to run on a lent GPU: are the grouped-matmul kernels right, how fast are they,
and how fast are the MoE layer and a ~1B-parameter MoE LM train step, beside what others ship.

Parts (`--parts`; all but fp8 by default), in this order, each within its own time budget
(what would run past it is skipped and named in the results). Planned for one H100 with jax
0.11.2: ~7 min in all, and never more than `--time-limit` (450 s by default: past it the
script writes what it has, marked aborted, and exits with status 3), so a lent machine's
8-minute slot holds it:
  numerics (budget 40 s): every kernel compiled on the device (Mosaic GPU gmm, gmm_t, tgmm, on
    aligned and on realigned groups, on both pipelines; the Triton ones;
    `grouped_matmul(backend="pallas")` forward and VJP) against `jax.lax.ragged_dot` /
    `ragged_dot_general`, bf16: balanced, Zipf, empty and unaligned groups, rows past the
    groups.
  train (100 s): one training step of an OLMoE-shaped LM cut to 2 layers (~1.05 B parameters,
    8 x 2048 tokens): Hugging Face transformers' `OlmoeForCausalLM` on torch first (bf16
    weights, fused AdamW, `experts_implementation="grouped_mm"`, i.e. `torch._grouped_mm`),
    then moejax (`make_train_step`, bf16 compute, fp32 Adam), in tokens/s and MFU. It runs
    second: jax's allocator keeps the memory it grew to, so torch's step must come before the
    kernel timings (at their end it had 2 GiB of 80 left and ran out of memory).
  kernels (200 s): TFLOP/s of forward (gmm), dlhs (gmm_t) and tgmm at the Mixtral, fine-grained
    and DeepSeek-V3 shapes (`pallas_kernels.shapes`), balanced and Zipf-skewed groups: ours
    (Mosaic GPU on its default per-tile pipeline and on `Config(pipeline="stream")`, Triton)
    against a dense jnp matmul of the same FLOPs, `jax.lax.ragged_dot`
    (not at G=256: seconds per call), jax's `ragged_dot_mgpu` (`transposed_ragged_dot_mgpu` for
    tgmm) and `torch._grouped_mm` (its output checked against ours on a sample).
  layer (60 s): moejax's MoE layer (`implementation="pallas"`), forward and backward, against
    a dense SwiGLU FFN of the same FLOPs (top_k x d_ff wide), Mixtral and fine-grained sizes.
  attention (30 s): the attention core forward + backward, bf16, at the Mixtral and OLMoE
    shapes (`bench_attention.part_attention`): "xla", "pallas" (jax's Triton kernel) and
    "auto" (cuDNN's flash attention), each checked against "xla", in ms and TFLOP/s.
  fp8 (325 s, only when named: `--parts fp8` alone fits a 6-minute slot): the fp8 expert
    matmuls (`gpu_check_fp8.py`): fp8 kernels' numerics, TFLOP/s beside our bf16 kernels and
    `torch._scaled_grouped_mm`, the SwiGLU FFN with fused against unfused quantization, the
    layer and the train step with fp8 vs bf16 experts.
Everything goes to one directory (`--out`): results.json (every figure, the device, versions,
commit and date), results.md (the tables), log.txt (all that was printed), and with `--profile`
a jax trace of one timed batch of each of our kernels, the layer and the step (profile/,
TensorBoard/Perfetto).

Needs: jax with CUDA (the lent machines' 0.11.2), flax, optax, chex, torch 2.11 and transformers
5.17, all in the lent machines' image: no wheels to carry (nor `pip install`: the script puts
the repository on sys.path). Run from the repository root with the machine's python3:

    python3 experiments/gpu_check.py --out $OUT/gpu_check

A comparison that is unavailable (no torch, no Hopper GPU for jax's Mosaic GPU kernels, a
failure) is skipped with the reason in the results; the rest still runs. Exit status: 0 when
every part ran and the numerics held, 1 otherwise, 3 at the time limit.

`--dry-run` runs every code path at tiny shapes on whatever is there (on a CPU: the kernels in
their interpreters, one timed call each, no budgets; ~2 min on 2 CPU cores), e.g.
`JAX_PLATFORMS=cpu python experiments/gpu_check.py --dry-run --out /tmp/gc`
(tests/accelerator/test_gpu_check.py runs it).
"""

from __future__ import annotations

import os

# torch and jax share the GPU: jax must not take 75% of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import datetime
import gc
import pathlib
import sys
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np
from bench_attention import part_attention
from gpu_check_fp8 import part_fp8
from gpu_check_kernels import part_kernels, part_numerics
from gpu_check_lib import (
    Run,
    maybe_profile,
    start_time_limit,
    versions,
)

from moejax import hardware

PEAK_BF16 = {"H100": hardware.H100_SXM.peak("bf16"), "H200": hardware.H200_SXM.peak("bf16")}
BUDGET_S = {"numerics": 40, "train": 100, "kernels": 200, "layer": 60, "attention": 30, "fp8": 325}
TIME_LIMIT_S = 450


# ----------------------------------------------------------------------------- part: layer
def part_layer(run: Run) -> None:
    import moejax

    configs = {
        "mixtral": dict(d_model=4096, d_ff=14336, num_experts=8, top_k=2, tokens=8192),
        "fine_grained": dict(d_model=2048, d_ff=768, num_experts=128, top_k=8, tokens=8192),
    }
    if run.dry:
        configs = {"tiny": dict(d_model=64, d_ff=128, num_experts=4, top_k=2, tokens=64)}
    rows = run.results["layer"] = []
    for name, c in configs.items():
        if run.left() < 10:
            run.skip("layer", name, "the part's time budget is spent")
            continue
        t = c.pop("tokens")
        cfg = moejax.MoEConfig(**c, param_dtype="bfloat16")
        params = moejax.init_moe_params(cfg, jax.random.key(0))
        x = jax.random.normal(jax.random.key(1), (t, cfg.d_model), jnp.bfloat16)

        def layer_loss(p, x, cfg=cfg):
            y, aux = moejax.moe_apply(p, x, cfg, implementation="pallas")
            return jnp.sum(y.astype(jnp.float32)) + aux.load_balance_loss

        f = cfg.top_k * cfg.d_ff  # a dense SwiGLU FFN as wide as the tokens' expert work
        k = jax.random.split(jax.random.key(2), 3)
        shapes = [(cfg.d_model, f), (cfg.d_model, f), (f, cfg.d_model)]
        dense = [jax.random.normal(k[i], s, jnp.bfloat16) * 0.02 for i, s in enumerate(shapes)]

        def dense_loss(ws, x):
            wg, wu, wd = ws
            return jnp.sum(((jax.nn.silu(x @ wg) * (x @ wu)) @ wd).astype(jnp.float32))

        flops = 3 * 2 * t * cfg.top_k * 3 * cfg.d_model * cfg.d_ff  # fwd + bwd, 3 projections
        step = jax.jit(jax.value_and_grad(layer_loss, argnums=(0, 1)))
        dense_step = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1)))
        with maybe_profile(run, f"layer_{name}"):
            secs = run.seconds(step, params, x)
        dense_secs = run.seconds(dense_step, dense, x)
        row = dict(config=name, **c, tokens=t, layer_ms=secs * 1e3, dense_ms=dense_secs * 1e3,
                   layer_tflops=flops / secs / 1e12, dense_tflops=flops / dense_secs / 1e12,
                   layer_over_dense=dense_secs / secs)  # fmt: skip
        rows.append(row)
        run.log(f"  layer {name}: {secs * 1e3:.2f} ms ({row['layer_tflops']:.0f} TFLOP/s), "
                f"dense FFN {dense_secs * 1e3:.2f} ms: {row['layer_over_dense']:.2f}x")  # fmt: skip
        del params, x, dense
        gc.collect()


# ----------------------------------------------------------------------------- part: train
def olmoe_hf_config(dry: bool) -> dict:
    """OLMoE-1B-7B's shapes (hidden 2048, 64 experts of 1024, top-8, 16 heads) with 2 layers."""
    if dry:
        return dict(model_type="olmoe", vocab_size=256, hidden_size=64, intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                    num_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
                    tie_word_embeddings=False, rope_theta=10000.0, eos_token_id=0)  # fmt: skip
    return dict(model_type="olmoe", vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16,
                num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096,
                tie_word_embeddings=False, rope_theta=10000.0, eos_token_id=50279)  # fmt: skip


def part_train(run: Run) -> None:
    from moejax.interop.hf import lm_config_from_hf
    from moejax.models import param_counts
    from moejax.training import TrainConfig, flops_per_token, init_train_state, make_train_step

    hf = olmoe_hf_config(run.dry)
    batch, seq = (2, 32) if run.dry else (8, 2048)
    model_cfg, _ = lm_config_from_hf(hf)
    model_cfg = model_cfg.replace(dtype="bfloat16", max_seq_len=seq)
    tokens = batch * seq
    flops = flops_per_token(model_cfg, seq) * tokens
    kind = jax.devices()[0].device_kind
    peak = next((v for key, v in PEAK_BF16.items() if key in kind), None)
    counts = param_counts(model_cfg)
    result = run.results["train"] = dict(
        hf_config=hf, batch=batch, seq=seq, params_total=counts.total,
        params_active=counts.active, flops_per_step=flops, peak_flops=peak,
    )  # fmt: skip
    run.log(f"  OLMoE x2 layers: {counts.total / 1e9:.2f} B params ({counts.active / 1e9:.2f} B "
            f"active), {tokens} tokens per step")  # fmt: skip
    # transformers first: torch frees its memory (empty_cache) for jax, not the other way round;
    # and its eager step needs no compile, so the budget goes to moejax's compile after it.
    result.update(hf_train_step(run, hf, batch, seq, flops, peak))

    train_cfg = TrainConfig(steps=100, batch_size=batch, seq_len=seq, warmup_steps=1)
    step = make_train_step(model_cfg, train_cfg)
    holder = {"state": init_train_state(model_cfg, train_cfg)}
    data = jnp.asarray(
        np.random.default_rng(0).integers(0, hf["vocab_size"], (batch, seq + 1)), jnp.int32
    )

    def one_step():
        holder["state"], metrics = step(holder["state"], data)
        return metrics.loss

    start = time.perf_counter()
    result["moejax_first_loss"] = float(one_step())
    result["moejax_first_step_s"] = time.perf_counter() - start
    with maybe_profile(run, "train_step"):
        secs = run.seconds(one_step)
    result.update(moejax_step_ms=secs * 1e3, moejax_tokens_per_s=tokens / secs,
                  moejax_mfu=flops / secs / peak if peak else None)  # fmt: skip
    mfu = result["moejax_mfu"] or float("nan")
    run.log(f"  moejax: first step {result['moejax_first_step_s']:.1f} s, {secs * 1e3:.1f} "
            f"ms/step, {tokens / secs:.0f} tokens/s, MFU {mfu:.1%}")  # fmt: skip
    holder.clear()


def hf_train_step(run: Run, hf: dict, batch: int, seq: int, flops: float, peak) -> dict:
    """transformers' OlmoeForCausalLM, bf16 weights, AdamW, grouped_mm experts: one step."""
    try:
        import torch
        import transformers
        from transformers import OlmoeConfig, OlmoeForCausalLM
    except ImportError as err:
        run.skip("train", "transformers", f"not importable: {err}")
        return {}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kw = {k: v for k, v in hf.items() if k not in ("model_type", "rope_theta")}
    rope = dict(rope_type="default", rope_theta=hf["rope_theta"])
    torch.manual_seed(0)
    try:
        cfg = OlmoeConfig(**kw, rope_parameters=rope, experts_implementation="grouped_mm",
                          attn_implementation="sdpa")  # fmt: skip
        with torch.device(dev):  # initialized where it runs: 1e9 values drawn on a CPU take long
            model = OlmoeForCausalLM(cfg).to(torch.bfloat16)
    except Exception as err:  # noqa: BLE001  (grouped_mm may not dispatch, e.g. on CPU)
        run.log(f"  transformers: grouped_mm experts unavailable ({err}); using its default")
        with torch.device(dev):
            model = OlmoeForCausalLM(OlmoeConfig(**kw, rope_parameters=rope)).to(torch.bfloat16)
    experts = getattr(model.config, "_experts_implementation", None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev == "cuda")
    ids = torch.randint(0, hf["vocab_size"], (batch, seq), device=dev)

    def one_step():
        out = model(input_ids=ids, labels=ids)  # transformers shifts the labels itself
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    result = dict(hf_experts_implementation=experts, transformers_version=transformers.__version__,
                  hf_params=sum(p.numel() for p in model.parameters()))  # fmt: skip
    try:
        result["hf_first_loss"] = float(one_step())
        secs = run.torch_seconds(one_step)
    except Exception as err:  # noqa: BLE001
        run.skip("train", "transformers step", f"{type(err).__name__}: {str(err)[:300]}")
        return result
    tokens = batch * seq
    result.update(hf_step_ms=secs * 1e3, hf_tokens_per_s=tokens / secs,
                  hf_mfu=flops / secs / peak if peak else None)  # fmt: skip
    run.log(f"  transformers ({experts} experts): {secs * 1e3:.1f} ms/step, "
            f"{tokens / secs:.0f} tokens/s")  # fmt: skip
    model = opt = None  # free the GPU memory for jax
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    return result


# ------------------------------------------------------------------------------------ main
PARTS = {"numerics": part_numerics, "train": part_train, "kernels": part_kernels,
         "layer": part_layer, "attention": part_attention, "fp8": part_fp8}  # fmt: skip
DEFAULT_PARTS = ["numerics", "train", "kernels", "layer", "attention"]  # fp8 when asked for


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--out", type=pathlib.Path, required=True, help="output directory")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=DEFAULT_PARTS)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, any machine")
    parser.add_argument("--profile", action="store_true", help="jax traces into OUT/profile")
    budgets = ", ".join(f"{k} {v} s" for k, v in BUDGET_S.items())
    parser.add_argument(
        "--budget-scale", type=float, default=1.0,
        help=f"multiply every part's time budget (default budgets: {budgets}; none in a dry run)",
    )  # fmt: skip
    parser.add_argument(
        "--time-limit", type=float, default=None,
        help=f"seconds after which the script writes what it has and exits with status 3 "
        f"(default {TIME_LIMIT_S}; none in a dry run)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.time_limit is None and not args.dry_run:
        args.time_limit = TIME_LIMIT_S
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.dry_run:
        raise SystemExit(f"no GPU ({jax.default_backend()}): use --dry-run to check the paths")
    results = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                   device=jax.devices()[0].device_kind, dry_run=args.dry_run,
                   parts=args.parts, **versions())  # fmt: skip
    with open(args.out / "log.txt", "w") as log_file:
        run = Run(args.out, args.dry_run, args.profile, on_gpu, results, log_file=log_file)
        timer = start_time_limit(run, args.time_limit)
        run.log(f"# gpu_check: {results['device']}, jax {results['jax']}, "
                f"torch {results['torch']}, commit {results['commit']}")  # fmt: skip
        start = time.perf_counter()
        for name in args.parts:
            budget = float("inf") if args.dry_run else BUDGET_S[name] * args.budget_scale
            run.deadline = time.perf_counter() + budget
            run.log(f"## {name} (budget {budget:.0f} s)")
            t0 = time.perf_counter()
            try:
                PARTS[name](run)
            except Exception as err:  # noqa: BLE001  (a part fails; the others still run)
                run.log(traceback.format_exc())
                results.setdefault("errors", []).append(
                    dict(part=name, error=f"{type(err).__name__}: {str(err)[:500]}")
                )
            gc.collect()
            jax.clear_caches()  # the next part's buffers, not this part's executables
            results.setdefault("part_seconds", {})[name] = time.perf_counter() - t0
            run.write()
        results["total_seconds"] = time.perf_counter() - start
        if timer is not None:
            timer.cancel()
        run.write()
        run.log((args.out / "results.md").read_text())
    return 1 if results.get("errors") or results.get("numerics_ok") is False else 0


if __name__ == "__main__":
    from pallas_kernels.targets import use_cpu_unless_accelerator

    use_cpu_unless_accelerator()  # no GPU/TPU here: no plugin tracebacks
    raise SystemExit(main())
