"""The strategy for a target you do not have: `moejax.aot.ranking.plan_strategy` compiles
each candidate's train step for a deviceless 8 x H100 mesh and ranks them by the schedule
model's step time (`moejax.aot.schedule`); a `StrategyTuner(cost=...)` decides by the same
ranking (tests/training/test_tuning.py). Two compiles, ~20 s each on 2 cores."""

import pytest
from _targets import CACHE_WARNING, needs_cuda

from moejax import aot, training
from moejax.aot import ranking
from moejax.models import presets
from moejax.training import tuning

# slow: 5 minutes on 2 cores; tests/training/test_tuning.py runs the tuner on CPU by default
pytestmark = [pytest.mark.deviceless, needs_cuda, CACHE_WARNING, pytest.mark.slow]


def test_plan_strategy_ranks_candidates_by_the_schedule_model():
    model = presets.get("micro")
    train_cfg = training.TrainConfig(batch_size=32, steps=10, warmup_steps=1)
    mesh = aot.mesh("cuda", (8,), ("expert",))
    candidates = tuning.parse_candidates("dropless;dropless,batch_split=2")
    best, times = ranking.plan_strategy(model, train_cfg, mesh, candidates=candidates)
    assert list(times) == list(candidates) and times[best] == min(times.values())
    assert all(0 < t < 1 for t in times.values())  # modelled seconds per step
