"""The autotuner times candidates (forward and backward) once per (shape, bucket), keeps the
fastest, re-decides when the bucket changes, and never traces or compiles again in steady
state."""

import jax
import numpy as np
import pytest
from _common import DROPLESS, make_params, mesh

import moejax
from moejax import parallel
from moejax.parallel import Strategy
from moejax.testing import assert_close


class CountingTimer:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return float(self.calls)  # deterministic: every candidate "takes" 1 s


class StrategyClock:
    """Called twice around each timed run; the second call advances by the running strategy's
    time (`tuner.timing`), so the tuner's choice is known in advance."""

    def __init__(self, seconds):
        self.seconds, self.tuner, self.now, self.calls = seconds, None, 0.0, 0

    def __call__(self):
        self.calls += 1
        if self.calls % 2 == 0:
            s = self.tuner.timing
            self.now += self.seconds[(s.mode, s.dispatcher if s.mode == "expert" else None)]
        return self.now


def _compiled(tuner):
    """Executables per jitted function: the timed fwd+bwd ones, and the forwards called."""
    fns = {("timed", s): f for s, f in tuner._timed_fns.items()}
    fns.update({("call", s): f for s, f in tuner._fns.items()})
    return {k: f._cache_size() for k, f in fns.items()}


def test_autotuner_caches_and_redecides_on_bucket_change():
    m = mesh("e8")
    candidates = [Strategy(mode="data"), Strategy(dispatcher="allgather"), Strategy()]
    timer = CountingTimer()
    tuner = parallel.Autotuner(
        DROPLESS, m, candidates=candidates, implementation="ragged_dot", repeats=2, timer=timer
    )
    params = parallel.shard_params(make_params(DROPLESS), DROPLESS, m)
    x = parallel.shard_activations(jax.random.normal(jax.random.key(1), (64, 16)), m)
    y0, _ = moejax.moe_apply(make_params(DROPLESS), x, DROPLESS, implementation="ragged_dot")

    y, aux = tuner(params, x, bucket=4)
    assert_close(y, y0)
    key = ((64, 16), "float32", 4)
    assert len(tuner.timings) == 1 and len(tuner.timings[key]) == 3
    assert Strategy(bucket=4) in tuner.timings[key]  # the dropless candidate got the bucket
    chosen = tuner.choice((64, 16), "float32", 4)
    assert tuner.timings[key][chosen] == min(tuner.timings[key].values())
    compiled, ticks = _compiled(tuner), timer.calls
    assert all(v == 1 for v in compiled.values())
    assert len(tuner._timed_fns) == 3 and list(tuner._fns) == [chosen]  # one forward compiled

    for _ in range(3):  # steady state: no timing, no new compilation
        tuner(params, x, bucket=4)
    assert timer.calls == ticks and _compiled(tuner) == compiled

    # The host saw more skew: a new bucket is a new key, so the tuner re-decides once. Only the
    # dropless candidate (whose buffer size is the bucket) compiles a new timed program (and
    # a forward, if it wins).
    bucket = parallel.choose_bucket(
        parallel.max_pair_count(aux.topk_indices, ~aux.dropped_mask, 8, 8, 8), 8, 2, 8
    )
    tuner(params, x, bucket=bucket + 4)
    assert len(tuner.timings) == 2 and timer.calls > ticks
    after = _compiled(tuner)
    new = set(after) - set(compiled)
    assert ("timed", Strategy(bucket=bucket + 4)) in new and all(v == 1 for v in after.values())
    assert new <= {("timed", Strategy(bucket=bucket + 4)), ("call", Strategy(bucket=bucket + 4))}
    assert after[("timed", Strategy(mode="data"))] == 1


@pytest.mark.parametrize("fastest", ["data", "dropless"])  # the first and the last tried
def test_autotuner_picks_the_fastest_forward_and_backward(fastest):
    m = mesh("e8")
    seconds = {("data", None): 2.0, ("expert", "allgather"): 3.0, ("expert", "dropless"): 4.0}
    key = {"data": ("data", None)}.get(fastest, ("expert", fastest))
    seconds[key] = 1.0
    clock = StrategyClock(seconds)
    candidates = [Strategy(mode="data"), Strategy(dispatcher="allgather"), Strategy()]
    tuner = parallel.Autotuner(
        DROPLESS, m, candidates=candidates, implementation="ragged_dot", repeats=3, timer=clock
    )
    clock.tuner = tuner
    params = parallel.shard_params(make_params(DROPLESS), DROPLESS, m)
    x = parallel.shard_activations(jax.random.normal(jax.random.key(1), (64, 16)), m)
    tuner(params, x, bucket=4)
    chosen = tuner.choice((64, 16), "float32", 4)
    assert (chosen.mode, chosen.dispatcher if chosen.mode == "expert" else None) == key
    assert sorted(tuner.timings[((64, 16), "float32", 4)].values()) == sorted(seconds.values())
    assert clock.calls == 2 * 3 * 3  # 3 timed runs of each of 3 candidates, 2 clock reads each


def test_max_pair_count_matches_numpy_loop():
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 8, (64, 2))
    kept = rng.random((64, 2)) > 0.2
    expected = 0
    for shard in range(4):  # 4 token shards of 16 tokens, N = 2 devices with G = 4 experts
        sl = slice(16 * shard, 16 * (shard + 1))
        dest = idx[sl][kept[sl]] // 4
        expected = max(expected, np.bincount(dest, minlength=2).max())
    assert parallel.max_pair_count(idx, kept, 4, 2, 8) == expected
