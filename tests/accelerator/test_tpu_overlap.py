"""The weight gradients in the backward all-to-all windows of libtpu's schedule (deviceless).

The `tiny` LM train step compiled for a TPU v5p 2x2x2 slice with
`--xla_tpu_enable_async_all_to_all=true`: every expert weight gradient (the Mosaic `tgmm`
kernels) and every delayed attention weight gradient (`lm_forward(delay_wgrad=...)`, the
default) sits inside an all-to-all window, as on the H100 schedule
(`test_batch_split_schedule.py`).
"""

import pytest
from _targets import CACHE_WARNING, needs_tpu

from moejax import aot, parallel, training
from moejax.aot import hlo, windows
from moejax.models import presets

# slow: 2.5 minutes on 2 cores; the H100 window tests run by default
pytestmark = [pytest.mark.deviceless, needs_tpu, CACHE_WARNING, pytest.mark.slow]

PROJECTIONS = ("bsd,dhk->bshk", "bshk,hkd->bsd")  # the attention projections' einsums


def test_weight_gradients_sit_in_tpu_all_to_all_windows():
    cfg = presets.get("tiny")
    cfg = cfg.replace(moe=cfg.moe.replace(drop_policy="capacity"))
    train_cfg = training.TrainConfig(batch_size=256, steps=10, warmup_steps=1)
    mesh = aot.mesh("tpu", (8,), ("expert",), generation="v5p")
    fn, args = aot.train_step_program(
        cfg, train_cfg, mesh, strategy=parallel.Strategy(dispatcher="capacity")
    )
    options = {"xla_tpu_enable_async_all_to_all": True}
    text = aot.compile_program(fn, args, donate_argnums=(0,), compiler_options=options).text
    inside = {ins.name for _, window in windows.windows(text) for ins in window}
    experts, attention = [], []
    for ins in hlo.entry(text):
        op = hlo.op_name(ins.line)
        if "transpose(" not in op:
            continue
        if "tgmm" in op and ins.opcode == "custom-call":
            experts.append(ins.name in inside)
        elif "/combine/transpose(" in op and any(p in op for p in PROJECTIONS):
            attention.append(ins.name in inside)  # computed in the MoE layer: delayed
    layers = cfg.num_layers
    assert len(experts) >= layers and all(experts), experts
    # One merged q/k/v GEMM and one o GEMM per block after the first (op kinds may split them).
    assert len(attention) >= 2 * (layers - 1) and all(attention), attention
