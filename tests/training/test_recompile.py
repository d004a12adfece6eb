"""The zero-recompile contract of dynamic placement (issue 17, item 2).

Slot tables are arguments of the jitted train step, and each MoE layer's migration gather is
compiled once (ahead of time, at start) for `[1, P]` sources: so a run that re-places every
layer many times compiles the train step once and the gathers a fixed number of times. The
test counts XLA compilations from jax's compile log (`jax_log_compiles`: one "Compiling
<module>" line per lowering sent to XLA, persistent-cache hits included).
"""

import collections
import logging
import re

import jax
import pytest
from _helpers import MODEL, corpus, mesh
from test_placement import PLACED, ScriptedController

from moejax.training import train
from moejax.training.placement_runtime import read_events

STEPS, EVERY = 12, 2


class _CompileLog(logging.Handler):
    """Counts jax's "Compiling <module> with global shapes" records per module name."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.counts = collections.Counter()

    def emit(self, record):
        m = re.match(r"Compiling (\S+) with global shapes", record.getMessage())
        if m:
            self.counts[m.group(1)] += 1


@pytest.fixture
def compile_log():
    handler = _CompileLog()
    logger = logging.getLogger("jax")
    before = jax.config.jax_log_compiles
    jax.clear_caches()  # in-memory caches of earlier tests would hide compilations
    jax.config.update("jax_log_compiles", True)
    logger.addHandler(handler)
    try:
        yield handler.counts
    finally:
        logger.removeHandler(handler)
        jax.config.update("jax_log_compiles", before)


def test_replacing_compiles_the_step_once_and_each_gather_once(tmp_path, compile_log):
    cfg = PLACED.replace(steps=STEPS, warmup_steps=2)
    result = train(
        MODEL,
        cfg,
        corpus(),
        run_dir=str(tmp_path),
        mesh=mesh(),
        progress=False,
        outputs=False,
        tensorboard=False,
        async_checkpoints=False,
        controller=lambda placements: ScriptedController(placements, every=EVERY),
    )
    layers = MODEL.num_moe_layers
    events = read_events(result.run_dir)
    assert len(events) == layers * ((STEPS - 2) // EVERY)  # every layer, 5 times
    assert len({tuple(e["new"]) for e in events}) == len(events)  # all different tables
    counts = dict(compile_log)
    # One train step program for the whole run: a recompile per placement would make it 6.
    assert counts.get("jit(train_step)") == 1, counts
    # `_gather`: each layer's migration (compiled once at start, used 5 times), `to_physical`
    # at start and `to_logical` for the final checkpoint; 2 + 2 = 4 on micro. A migration
    # compiled per re-placement would make it 12.
    assert counts.get("jit(_gather)", 0) <= layers + 2, counts
