"""The sharded MoE layer (forward and backward) and the tiny LM's train step, compiled for an
8 x H100 mesh and TPU v5e / v5p slices on this CPU machine, with `implementation="auto"`: the
compile target, not the host, puts the Mosaic GPU (H100, bf16) or Mosaic (TPU) kernels in the
program."""

import functools
import re

import jax.numpy as jnp
import pytest
from _targets import CACHE_WARNING, needs_cuda, needs_tpu

import moejax
from moejax import aot, parallel
from moejax.aot import hlo
from moejax.models import presets
from moejax.parallel import Strategy
from moejax.training import presets as train_presets

pytestmark = [pytest.mark.deviceless, CACHE_WARNING]
SLOW = pytest.mark.slow
PLATFORMS = [
    pytest.param("cuda", {}, id="h100", marks=needs_cuda),
    pytest.param("tpu", {"generation": "v5e"}, id="v5e", marks=needs_tpu),
]
BACKEND = {"cuda": "mosaic_gpu", "tpu": "mosaic"}  # bf16 on H100: the Hopper kernels
DEVICE_BYTES = {"cuda": 80 * 2**30, "tpu": 16 * 2**30}  # H100 HBM; v5e HBM per chip
CONFIG = moejax.MoEConfig(d_model=1024, d_ff=2048, num_experts=8, top_k=2, param_dtype="bfloat16")
CAPACITY = CONFIG.replace(drop_policy="capacity")
# The layer's strategy space, and the capacity dispatcher (the default of a capacity layer).
CASES = [
    *((CONFIG, s) for s in parallel.strategy_space(CONFIG)),
    (CAPACITY, Strategy("expert", "capacity")),
]


@functools.cache
def _mesh(platform, generation=None):
    kw = {"generation": generation} if generation else {}
    return aot.mesh(platform, (2, 4), ("data", "expert"), **kw)


def _assert_kernels(compiled, platform):
    backend = BACKEND[platform]
    gmms = aot.grouped_matmuls(compiled.kernels)
    assert set(gmms) == {f"{k}/{backend}" for k in ("gmm", "gmm_t", "tgmm")}
    # Three expert projections, each with its backward gmm_t and tgmm.
    assert gmms[f"gmm_t/{backend}"] == gmms[f"tgmm/{backend}"] >= 3


def _layer_cases():
    """Every strategy on both targets; the default run compiles each strategy once, on H100, and
    the data and capacity cases on v5e too (the rest, 2-3 minutes each on 2 cores, are slow)."""
    default = {("h100", "data"), ("h100", "expert"), ("h100", "tensor"), ("h100", "allgather"),
               ("v5e", "data"), ("v5e", "capacity")}  # fmt: skip
    for platform in PLATFORMS:
        for cfg, strategy in CASES:
            target = platform.id
            kind = strategy.dispatcher if strategy.dispatcher != "dropless" else strategy.mode
            fast = (target, kind) in default and strategy.chunks == 1
            marks = list(platform.marks) + ([] if fast else [pytest.mark.slow])
            yield pytest.param(*platform.values, cfg, strategy, id=f"{strategy}-{target}",
                               marks=marks)  # fmt: skip


@pytest.mark.parametrize("platform, kw, cfg, strategy", list(_layer_cases()))
def test_sharded_layer_compiles_with_the_kernels(platform, kw, cfg, strategy):
    mesh = _mesh(platform, **kw)
    fn, args = aot.layer_program(cfg, mesh, strategy, tokens=16384, dtype=jnp.bfloat16)
    compiled = aot.compile_program(fn, args)
    _assert_kernels(compiled, platform)
    assert 0 < compiled.peak_bytes < DEVICE_BYTES[platform]


def _tiny_model(platform):
    model_cfg = presets.get("tiny")
    if platform == "cuda":  # bf16 compute: what H100 runs the Mosaic GPU kernels for
        model_cfg = model_cfg.replace(dtype="bfloat16")
    return model_cfg


@functools.cache
def _tiny_step(platform, generation=None):
    """The tiny LM's train step compiled for the 2 x 4 mesh (a minute on 2 cores; the tests
    that read it are consecutive, so pytest-xdist's load distribution runs them in one worker,
    on one compile)."""
    mesh = _mesh(platform, generation)
    fn, args = aot.train_step_program(_tiny_model(platform), train_presets.get("tiny"), mesh)
    return aot.compile_program(fn, args)


@pytest.mark.parametrize(
    "platform, kw",
    [  # the TPU steps are slow (a minute each); the default run compiles the sharded layer for v5e
        PLATFORMS[0],
        pytest.param("tpu", {"generation": "v5e"}, id="v5e", marks=[needs_tpu, SLOW]),
        pytest.param("tpu", {"generation": "v5p"}, id="v5p", marks=[needs_tpu, SLOW]),
    ],
)
def test_tiny_lm_train_step_compiles_with_the_kernels(platform, kw):
    model_cfg = _tiny_model(platform)
    compiled = _tiny_step(platform, **kw)
    _assert_kernels(compiled, platform)
    # Three expert weight gradients per MoE layer, twice: round 0 of the dropless exchange
    # (straight-line code) and the leftover rounds' loop (`moejax.parallel.dispatch_dropless`).
    assert compiled.kernels[f"tgmm/{BACKEND[platform]}"] == 2 * 3 * len(model_cfg.moe_layers)
    # Attention is a flash kernel too: cuDNN's (bf16 on H100) or jax's Mosaic flash_attention,
    # forward and backward.
    attention = {k for k in compiled.kernels if k.split("/")[0] not in aot.KERNEL_NAMES}
    want = {
        "cuda": {"dot_product_attention_fwd/cudnn", "dot_product_attention_bwd/cudnn"},
        "tpu": {"flash_attention/mosaic", "flash_mha_bwd_dkv/mosaic", "flash_mha_bwd_dq/mosaic"},
    }[platform]
    assert attention == want, compiled.kernels
    assert 0 < compiled.peak_bytes < DEVICE_BYTES[platform]


def _dot_operands(text: str) -> list[tuple[str, list[str]]]:
    """`(jax scope, operand types)` of every `dot` of a compiled module."""
    out = []
    for body in hlo.computations(text)[0].values():
        instructions = list(hlo.parsed(body))
        types = {i.name: i.line.split("=", 1)[1].split()[0] for i in instructions}
        for i in instructions:
            if match := re.search(r" dot\(([^)]*)\)", i.line):
                operands = [types.get(o.lstrip("%"), o) for o in match.group(1).split(", ")]
                out.append((hlo.op_name(i.line), operands))
    return out


@needs_cuda
def test_lm_head_backward_multiplies_in_bf16_on_h100():
    """The logits are fp32, but their gradient matmuls take the bf16 operands
    (`moejax.models.unembed_logits`): differentiating the fp32-output einsum would run them on
    fp32 copies, TF32 at half the bf16 rate."""
    dots = _dot_operands(_tiny_step("cuda").text)
    specs = ("bsd,dv->bsv", "bsv,dv->bsd", "bsd,bsv->dv")  # the logits' einsum and its two VJPs
    head = [(scope, types) for scope, types in dots if any(s in scope for s in specs)]
    assert len(head) >= 3, dots  # the logits and their two gradients
    assert all(t.startswith("bf16[") for _, types in head for t in types), head
