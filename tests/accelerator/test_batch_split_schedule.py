"""Batch split on the real XLA:GPU schedule of the `tiny` LM train step (8 x H100, deviceless).

With `batch_split=2` one micro-batch's attention runs inside the other's MoE all-to-all windows
in the forward, every expert weight-gradient GEMM sits in a backward window, XLA's DotMerger
leaves the micro-batches' matmuls apart, and the schedule model (`moejax.aot.schedule`) finds
70% less exposed all-to-all time than in the unsplit step. A negative control compiled with
synchronous all-to-alls loses it all.

The attention weight gradients, delayed into the previous MoE layer's backward (the default,
`lm_forward(delay_wgrad=...)`), all sit in backward all-to-all windows, split or not; without
the delay, some do and some do not.
"""

import functools
import re

import pytest
from _targets import CACHE_WARNING, needs_cuda

from moejax import aot, parallel, training
from moejax.aot import hlo, schedule, windows
from moejax.models import presets

pytestmark = [pytest.mark.deviceless, needs_cuda, CACHE_WARNING]

BATCH = 256  # 32 sequences of 128 per device
SYNC = {"xla_gpu_disable_async_collectives": "ALLTOALL"}
# Exposed all-to-all with batch_split=2 must be at most this fraction of the unsplit step's: the
# issue's 70% less (Lancet reports 77%). Measured with jax 0.10.2: 0.029 / 0.118 ms = 0.25.
EXPOSED_RATIO = 0.3


@functools.cache
def _compiled(dispatch: str, k: int, sync: bool = False, delay_wgrad=None) -> str:
    cfg = presets.get("tiny")
    cfg = cfg.replace(moe=cfg.moe.replace(drop_policy=dispatch))
    train_cfg = training.TrainConfig(
        batch_size=BATCH, steps=10, warmup_steps=1, delay_wgrad=delay_wgrad
    )
    mesh = aot.mesh("cuda", (8,), ("expert",))
    strategy = parallel.Strategy(dispatcher=dispatch)
    fn, args = aot.train_step_program(cfg, train_cfg, mesh, strategy=strategy, batch_split=k)
    options = SYNC if sync else None
    return aot.compile_program(fn, args, donate_argnums=(0,), compiler_options=options).text


def _exposed_all_to_all(text: str) -> float:
    return schedule.estimate(text).exposed("all-to-all")


def _entry_tgmm(text: str) -> int:
    """tgmm kernels in the ENTRY computation (not in the dropless leftover rounds' loops)."""
    return sum(i.opcode == "custom-call" and "tgmm" in i.line for i in hlo.entry(text))


def _split(kernels):
    """Kernels inside windows: (forward op_names, backward op_names)."""
    ops = [name for _, inside in kernels for name, _ in inside]
    backward = [o for o in ops if "transpose(" in o]
    return [o for o in ops if "transpose(" not in o], backward


DISPATCHES = ["capacity", pytest.param("dropless", marks=pytest.mark.slow)]


# Slow (4 minutes on 2 cores): the default run shows batch split's effect on the exposed
# all-to-all (test_batch_split_cuts_exposed_all_to_all_and_sync_control_does_not).
@pytest.mark.slow
@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_batch_split_overlaps_attention_with_the_other_micro_batchs_all_to_all(dispatch):
    whole, split = _compiled(dispatch, 1), _compiled(dispatch, 2)
    w1, w2 = windows.window_kernels(whole), windows.window_kernels(split)
    assert len(w2) == 2 * len(w1) > 0  # each micro-batch has its own exchanges
    fwd1, _ = _split(w1)
    fwd2, bwd2 = _split(w2)
    # Forward: nothing independent to overlap in the unsplit step; with the split, the other
    # micro-batch's attention (projections and flash kernel) runs inside the windows.
    assert not any("attention" in o for o in fwd1), fwd1
    in_windows = [o for o in fwd2 if "attention" in o]
    assert len({re.search(r"layer_\d+", o).group() for o in in_windows}) >= 3, in_windows
    assert {"micro0", "micro1"} <= {m for o in in_windows for m in re.findall(r"micro\d", o)}
    # Backward: every expert weight gradient (the tgmm kernels of round 0) sits in an
    # all-to-all window, by construction, split or not: a barrier pairs them with the send's
    # transpose's result (`moejax.parallel._overlap.tie`; the dropless dispatcher's
    # `_send_tied`, right after the all-to-all, before the gather that follows it).
    for text, kernels in ((whole, w1), (split, w2)):
        in_windows = sum("tgmm" in o for o in _split(kernels)[1])
        assert in_windows == _entry_tgmm(text) > 0


def _attention_weight_gemms(text: str, k: int) -> list[tuple[str, bool]]:
    """`(op_name, inside a backward all-to-all window)` of each attention weight-gradient GEMM."""
    rows = BATCH // 8 * 128 // k  # one micro-batch's tokens on a device
    kernels = windows.weight_gradient_kernels(text, rows)
    return [(op, inside) for kind, op, inside in kernels if kind == "attention"]


# Slow (1.5-3 minutes on 2 cores); the default run checks where delayed weight gradients go on
# CPU (tests/models/test_delay_wgrad.py).
@pytest.mark.slow
@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_attention_weight_gradients_sit_in_backward_all_to_all_windows(dispatch):
    layers = presets.get("tiny").num_layers
    for k in (1, 2):
        gemms = _attention_weight_gemms(_compiled(dispatch, k), k)
        # Blocks 1.. hand theirs to the MoE layer before them (its return exchange): one GEMM
        # for q, k and v merged, one for o, per block and micro-batch.
        delayed = [inside for name, inside in gemms if "/combine/" in name]
        assert len(delayed) >= 2 * (layers - 1) * k, gemms
        # Their barriers bound them to the window's edges; inside those, XLA fills the window
        # until it deems the all-to-all covered. Capacity: all of them inside. Dropless
        # (measured 6 of 6 unsplit, 10 of 12 split): the rest run just before the start,
        # after the send's gather, where the other micro-batch's work already fills it.
        if dispatch == "capacity":
            assert all(delayed), gemms
        else:
            assert 4 * sum(delayed) >= 3 * len(delayed), gemms
    # Negative control: without the delay the same GEMMs land wherever the scheduler put them
    # (measured: 4 of 8 inside a window with capacity, 1 of 8 dropless).
    control = _attention_weight_gemms(_compiled(dispatch, 1, delay_wgrad=False), 1)
    assert not any("/combine/" in name for name, _ in control)
    assert len(control) >= 2 * layers and not all(inside for _, inside in control), control


def test_dot_merger_keeps_the_micro_batches_apart():
    """Each micro-batch keeps its own attention projections with half the rows: the
    optimization barriers stop DotMerger from merging them back into one matmul."""
    split = _compiled("capacity", 2)
    rows = 32 * 128 // 2  # local tokens of one micro-batch
    for j in (0, 1):
        q = [
            line
            for line in split.splitlines()
            if f"jvp(layer_1)/micro{j}/attention/bsd,dhk->bshk" in line
            and "transpose(" not in line
            and ("gemm" in line or "dot(" in line)
        ]
        assert q, f"micro{j}'s projections were merged away"
        assert all(f"[{rows}," in line or "[16,128," in line for line in q), q[:2]


def test_batch_split_cuts_exposed_all_to_all_and_sync_control_does_not():
    whole = _exposed_all_to_all(_compiled("capacity", 1))
    split = _exposed_all_to_all(_compiled("capacity", 2))
    control = _exposed_all_to_all(_compiled("capacity", 2, sync=True))
    assert split <= EXPOSED_RATIO * whole, (split, whole)
    # Negative control: the same split program with synchronous all-to-alls hides nothing.
    assert not control <= EXPOSED_RATIO * whole, (control, whole)
