"""One of two processes (4 simulated CPU devices each) training the micro LM with dynamic expert
placement on one 8-device mesh. Launched by `test_multihost.py`: argv = port, process id, run
directory, output JSON path.

Each process gets a different controller: process 0 the skewed-routing one of
`test_placement.py` (re-places several times in 16 steps), process 1 one that never accepts a
re-placement. Only process 0's decides, so both must apply process 0's re-placements. Each
process also times the hardware figures (`placed.measure_hardware`) and writes what it applied:
its events and checks (without wall times), the final tables, the summary (without wall times
and the measured falls, which need the metrics records only process 0 keeps)."""

import dataclasses
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _helpers import MODEL, TRAIN, corpus, mesh  # noqa: E402

from moejax.placement import H100_NVLINK, ControllerConfig  # noqa: E402
from moejax.records import record_to_json  # noqa: E402
from moejax.training import placed, train  # noqa: E402

CFG = TRAIN.replace(
    steps=16, warmup_steps=2, checkpoint_every=0, eval_batches=0, expert_slots_per_device=3
)
DECIDES = ControllerConfig(
    decide_every=2, patience=1, min_interval=4, min_relative_gain=0.02, forecast_window=3
)
NEVER = dataclasses.replace(DECIDES, warmup_steps=10**9)  # accepts nothing, ever
COMPUTE_BOUND = dataclasses.replace(
    H100_NVLINK, name="compute-bound", flops_per_s=H100_NVLINK.flops_per_s / 1e4
)
WALL = ("migration_wall_s", "measured_migration_s", "overhead_fraction")
# Computed from the metrics records, which process 0 keeps (it writes metrics.jsonl).
FALLS = ("fall_events", "predicted_fall", "in_sample_fall", "measured_fall", "counterfactual_fall")


def main(port, process_id, run_dir, out):
    jax.config.update("jax_default_matmul_precision", "highest")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=int(process_id)
    )
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    m = mesh()
    config = DECIDES if jax.process_index() == 0 else NEVER
    factory = placed.controller_factory(
        MODEL, CFG, m, MODEL.max_seq_len, config=config, hardware=COMPUTE_BOUND
    )
    measured = placed.measure_hardware(m, factory.keywords["workload"])
    result = train(MODEL, CFG, corpus(), run_dir=run_dir, mesh=m, progress=False,
                   outputs=False, tensorboard=False, controller=factory)  # fmt: skip
    events = [{k: v for k, v in e.items() if k not in WALL} for e in result.placement_events]
    summary = {k: v for k, v in result.placement.items() if k not in WALL + FALLS}
    with open(out, "w") as f:
        json.dump(
            {
                "process": jax.process_index(),
                "warmup_steps": config.warmup_steps,
                "measured": record_to_json(measured),
                "events": events,
                "checks": result.placement_checks,
                "tables": [p.slot_to_expert.tolist() for p in result.placements],
                "summary": summary,
                "step": result.step,
            },
            f,
        )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:5])
