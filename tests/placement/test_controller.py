"""Controller: hysteresis (no flapping), reaction to drift, per-layer state, bookkeeping."""

import dataclasses
import json

import numpy as np
import pytest

from moejax.placement import (
    H100_IB,
    H100_NVLINK,
    ControllerConfig,
    Placement,
    PlacementController,
    Workload,
    balanced,
    drifting_zipf,
    migration_bytes,
    migration_s,
    step_cost,
    zipf,
)
from moejax.placement.traces import zipf_exponent_for, zipf_probs

N, E, S = 8, 16, 3
WL = Workload(tokens_per_device=512, top_k=2, d_model=1024, d_ff=1024)
# Small batches (8192 rows over 16 experts per step) make the per-step noise large (~5%).
TOKENS = N * WL.rows_per_step


def _run(trace, config=None):
    config = ControllerConfig() if config is None else config
    base = Placement.identity(E, N, S)
    ctl = PlacementController([base] * trace.shape[1], H100_IB, WL, config)
    for t in range(1, trace.shape[0]):
        ctl.observe(t - 1, trace[t - 1])  # one step late, as the training loop feeds it
    return ctl


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_flapping_on_noisy_balanced_trace(seed):
    ctl = _run(balanced(500, E, TOKENS, seed=seed))
    assert len(ctl.accepted) == 0
    # One check every decide_every = 5 observed steps, none accepted.
    assert len(ctl.log) == 99 and all(d.step % 5 == 4 for d in ctl.log)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_replacement_on_noisy_stationary_zipf(seed):
    trace = zipf(500, E, TOKENS, s=zipf_exponent_for(E, 4.0), seed=seed)
    ctl = _run(trace)
    # The first check fixes the skew; noise must not trigger any further re-placement.
    assert len(ctl.accepted) == 1
    first = ctl.accepted[0]
    assert first.step < 50
    mean_counts = trace.mean(axis=(0, 1))
    assert first.new.imbalance(mean_counts) < 1.1 < first.old.imbalance(mean_counts)


def test_no_flapping_even_with_patience_one_and_no_interval():
    config = ControllerConfig(patience=1, min_interval=0, decide_every=5)
    trace = zipf(500, E, TOKENS, s=zipf_exponent_for(E, 4.0), seed=3)
    assert len(_run(trace, config).accepted) <= 2


def test_replaces_on_drift_and_reduces_modeled_imbalance():
    s = zipf_exponent_for(E, 4.0)
    trace = drifting_zipf(600, E, TOKENS, s=s, shift_every=150, seed=0)
    ctl = _run(trace)
    accepted = ctl.accepted
    assert len(accepted) >= 4  # at least once after each of the 3 rotations, plus the first
    assert {d.step // 150 for d in accepted} == {0, 1, 2, 3}
    for d in accepted:
        window = trace[max(0, d.step - 4) : d.step + 1, 0].mean(axis=0)
        assert d.new.imbalance(window) < d.old.imbalance(window)
        assert d.gain_s > 0 and d.accepted and "repays" in d.reason
    # Modeled imbalance at the end of each phase is close to balanced.
    for phase_end in (149, 299, 449, 599):
        current = [d.new for d in accepted if d.step < phase_end][-1]
        assert current.imbalance(trace[phase_end - 20 : phase_end, 0].mean(axis=0)) < 1.15


def test_change_detector_replaces_right_after_an_abrupt_shift():
    # Counts arrive one step late; a shift at step t0 is confirmed by the counts of steps t0 and
    # t0 + 1 (react_steps = 2) and re-placed at once, off the decide_every schedule.
    s = zipf_exponent_for(E, 4.0)
    trace = drifting_zipf(600, E, TOKENS, s=s, shift_every=150, seed=0)
    ctl = _run(trace)
    assert [d.step for d in ctl.accepted] == [1, 151, 301, 451]
    # Re-planned on the re-seeded EMA: balanced for the new phase.
    for d in ctl.accepted:
        phase = trace[d.step + 1 : d.step + 101, 0].mean(axis=0)
        assert d.new.imbalance(phase) < 1.15 < d.old.imbalance(phase)
    # Without the detector, only the scheduled checks run (one every 5 observed steps).
    off = _run(trace, ControllerConfig(react_gain=None))
    assert all(d.step % 5 == 4 for d in off.log)
    for start in (150, 300, 450):  # it reacts later: at the next scheduled check at best
        assert min(d.step for d in off.accepted if d.step >= start) >= start + 4


def test_urgent_shift_is_confirmed_by_one_step():
    # react_urgent: a shift to more than twice the planned imbalance on one step's counts is
    # a change at once (a step sooner than react_steps = 2), and so is a one-step spike that
    # large (the price of the knob, which is why it is off by default).
    s = zipf_exponent_for(E, 4.0)
    trace = drifting_zipf(600, E, TOKENS, s=s, shift_every=150, seed=0)
    urgent = ControllerConfig(react_urgent=1.0)
    assert [d.step for d in _run(trace, urgent).accepted] == [0, 150, 300, 450]
    spiky = zipf(300, E, TOKENS, s=s, seed=0)
    spiky[200] = zipf(1, E, TOKENS, s=s, seed=100)[0]
    assert 200 not in [d.step for d in _run(spiky).log]
    assert 200 in [d.step for d in _run(spiky, urgent).log]
    # A shift below the urgent bound still waits for react_steps steps.
    calm = ControllerConfig(react_urgent=50.0)
    assert [d.step for d in _run(trace, calm).accepted] == [1, 151, 301, 451]


@pytest.mark.parametrize("seed", [0, 1])
def test_one_step_spike_is_not_a_change(seed):
    s = zipf_exponent_for(E, 4.0)
    trace = zipf(300, E, TOKENS, s=s, seed=seed)
    trace[200] = zipf(1, E, TOKENS, s=s, seed=seed + 100)[0]  # another hot set, for one step
    ctl = _run(trace)
    assert ctl.accepted[0].step == 1  # the initial skew is a change (two steps confirm it)
    assert all(d.step % 5 == 4 for d in ctl.log[1:])  # the spike triggered no extra check
    trace[201] = trace[200]  # the same shift for two steps is a change
    assert 201 in [d.step for d in _run(trace).log]


def test_steady_drift_stays_on_schedule():
    # Each hot set blends into the next over 40 steps: the EMA keeps pace, the scheduled checks
    # re-place, and the change detector (raw counts against the EMA before them) stays quiet;
    # measured against the last plan alone it would fire 11-15 times here.
    rng = np.random.default_rng(0)
    base = zipf_probs(E, zipf_exponent_for(E, 4.0))
    hot_sets = [base[rng.permutation(E)] for _ in range(6)]
    rows = [
        rng.multinomial(TOKENS, (1 - t / 40) * hot_sets[k] + t / 40 * hot_sets[k + 1])
        for k in range(5)
        for t in range(40)
    ]
    ctl = _run(np.stack(rows)[:, None, :])
    assert len(ctl.accepted) >= 5
    assert [d.step for d in ctl.log if d.step % 5 != 4] == [1]  # the initial skew only


def test_bookkeeping_matches_accepted_decisions():
    s = zipf_exponent_for(E, 4.0)
    ctl = _run(drifting_zipf(300, E, TOKENS, s=s, shift_every=100, seed=1))
    accepted = ctl.accepted
    assert accepted
    assert ctl.migration_s == pytest.approx(sum(d.migration_s for d in accepted))
    assert ctl.bytes_moved == sum(d.bytes_moved for d in accepted)
    for d in accepted:
        assert d.bytes_moved == migration_bytes(d.old, d.new, WL) > 0
        assert d.migration_s == pytest.approx(migration_s(d.old, d.new, H100_IB, WL))
    assert ctl.decision_wall_s > 0
    assert ctl.placements[0] == accepted[-1].new
    # Rejected checks are logged with a reason and move nothing.
    rejected = [d for d in ctl.log if not d.accepted]
    assert rejected and all(d.reason for d in rejected)
    assert all(d.new == d.old or d.bytes_moved >= 0 for d in rejected)


def test_migration_must_repay_within_horizon():
    # A one-step horizon cannot repay moving 1 GB-sized experts over InfiniBand.
    config = ControllerConfig(horizon_steps=1, patience=1, min_interval=0)
    trace = zipf(100, E, TOKENS, s=zipf_exponent_for(E, 4.0), seed=0)
    ctl = _run(trace, config)
    assert not ctl.accepted
    assert any("migration" in d.reason for d in ctl.log)


def test_layers_are_independent():
    s = zipf_exponent_for(E, 4.0)
    skewed = zipf(200, E, TOKENS, s=s, seed=0)
    even = balanced(200, E, TOKENS, seed=1)
    trace = np.concatenate([even, skewed], axis=1)  # [steps, 2, E]: only layer 1 is skewed
    ctl = _run(trace)
    assert ctl.num_layers == 2
    assert [d.layer for d in ctl.accepted] == [1]
    assert ctl.placements[0] == Placement.identity(E, N, S)
    assert ctl.ema.shape == (2, E)


def test_observe_accepts_1d_counts_and_validates():
    ctl = PlacementController(Placement.identity(E, N, S), H100_IB, WL)
    assert ctl.observe(0, np.ones(E)) == []
    with pytest.raises(ValueError, match=r"shape \[L, E\] = \(1, 16\), got \(2, 16\)"):
        ctl.observe(1, np.ones((2, E)))
    with pytest.raises(ValueError, match="finite and >= 0"):
        ctl.observe(1, -np.ones(E))
    with pytest.raises(ValueError, match="at least one layer"):
        PlacementController([], H100_IB, WL)


def test_per_step_imbalance_is_the_window_mean_and_above_the_ema_figure():
    trace = zipf(40, E, TOKENS, s=zipf_exponent_for(E, 4.0), seed=3)  # [steps, 1, E]
    ctl = _run(trace, ControllerConfig(forecast_window=7))
    p = ctl.placements[0]
    seen = trace[trace.shape[0] - 8 : trace.shape[0] - 1, 0]  # the 7 last observed steps
    want = np.mean([p.imbalance(c) for c in seen])
    assert ctl.per_step_imbalance(0, p) == pytest.approx(want, rel=1e-12)
    # The busiest device is a maximum: noisy steps average above the smoothed counts' figure.
    assert ctl.per_step_imbalance(0, p) > p.imbalance(ctl.ema[0])
    with pytest.raises(ValueError, match="at least one observed step"):
        PlacementController(p, H100_IB, WL).per_step_imbalance(0, p)


def test_stale_replicas_that_mostly_cost_sync_are_replanned():
    # Expert 0 was hot and is replicated on every device; now it gets only 2x the rows of the
    # others. Its 9 replicas still balance the devices within 5%, but their gradient sync is
    # paid every step: the re-plan trigger watches the modeled step (sync included), not the
    # imbalance alone, so the controller drops most of them.
    table = Placement.identity(E, N, S).device_table().copy()
    table[:, -1] = 0  # the spare slot of every device holds expert 0
    stale = Placement.identity(E, N, S).with_table(table.reshape(-1))
    warm = np.full(E, TOKENS / (E + 1))
    warm[0] *= 2
    assert stale.imbalance(warm) < 1.05  # an imbalance trigger at 5% would not fire
    before = step_cost(stale, warm, H100_IB, WL)
    assert before.replica_sync_s > 0.2 * before.total_s
    ctl = PlacementController(stale, H100_IB, WL, ControllerConfig(decide_every=1, patience=1))
    (d,) = ctl.observe(0, warm)
    after = step_cost(d.new, warm, H100_IB, WL)
    assert after.total_s < before.total_s and after.replica_sync_s < before.replica_sync_s
    assert d.new.expert_replica_counts()[0] < 9


@pytest.mark.parametrize("tokens", [256, 4096])
def test_packed_replica_sync_is_charged_and_a_gain_below_it_rejected(tokens):
    # The training step's sync (Workload(replica_sync="packed")): replicas across devices cost
    # one all-reduce over the expert axis of their packed gradients. Expert 0 is 2x as hot as
    # the others; the identity (spare slots as local duplicates) syncs nothing.
    n, e, s = 4, 8, 3
    base = Placement.identity(e, n, s)
    cfg = ControllerConfig(decide_every=1, patience=1, min_interval=0)

    def decide(overlap):
        wl = Workload(
            tokens_per_device=tokens,
            top_k=2,
            d_model=1024,
            d_ff=1024,
            replica_sync="packed",
            replica_sync_overlap=overlap,
        )
        counts = np.full(e, n * wl.rows_per_step / (e + 1))
        counts[0] *= 2
        return wl, counts, PlacementController([base], H100_NVLINK, wl, cfg).observe(0, counts)

    free_wl, counts, (free,) = decide(1.0)  # sync not charged: replication always pays
    wl, _, accepted = decide(0.0)
    charged = dataclasses.replace(free_wl, replica_sync_overlap=0.0)
    now = step_cost(base, counts, H100_NVLINK, wl)
    assert now.replica_sync_s == 0.0
    if tokens == 256:  # small batch: the balance gained is below the all-reduce it adds
        assert accepted == []
        assert step_cost(free.new, counts, H100_NVLINK, charged).total_s > now.total_s
    else:  # large batch: accepted, its predicted gain net of the sync its placement now pays
        (d,) = accepted
        after = step_cost(d.new, counts, H100_NVLINK, wl)
        assert after.replica_sync_s > 0
        assert d.gain_s == pytest.approx(now.total_s - after.total_s, rel=1e-12)
        assert 0 < d.gain_s < free.gain_s


def _skewed_counts(perm_seed=None):
    probs = zipf_probs(E, zipf_exponent_for(E, 4.0))
    if perm_seed is not None:
        probs = probs[np.random.default_rng(perm_seed).permutation(E)]
    return probs * TOKENS


FAST = ControllerConfig(decide_every=1, patience=1, min_interval=0, forecast_window=4)


def test_forecast_is_in_sample_until_a_replacement_is_measured():
    ctl = PlacementController(Placement.identity(E, N, S), H100_IB, WL, FAST)
    counts = _skewed_counts()
    (d,) = ctl.observe(0, counts)
    assert ctl.realized_ratio == 1.0 and ctl.realized.matured == 0
    before, after = ctl.forecast(0, d.old, d.new)
    assert before == d.old.imbalance(counts) and after == d.new.imbalance(counts) < before


def test_realized_ratio_is_one_on_stationary_routing():
    # Identical counts every step: the steps after a re-placement are the steps it planned on.
    ctl = PlacementController(Placement.identity(E, N, S), H100_IB, WL, FAST)
    counts = _skewed_counts()
    (d,) = ctl.observe(0, counts)
    for t in range(1, 1 + FAST.apply_lag + FAST.forecast_window):
        assert ctl.observe(t, counts) == []
    assert ctl.realized.matured == 1
    assert ctl.realized_ratio == pytest.approx(1.0, rel=1e-12)


def test_realized_ratio_measures_the_fall_after_a_replacement_under_drift():
    once = ControllerConfig(decide_every=1, patience=1, min_interval=100, forecast_window=4)
    ctl = PlacementController(Placement.identity(E, N, S), H100_IB, WL, once)
    first = _skewed_counts()
    (d,) = ctl.observe(0, first)
    in_sample = d.old.imbalance(first) - d.new.imbalance(first)
    shifted = _skewed_counts(perm_seed=1)  # the hot experts move right after the decision
    window = range(FAST.apply_lag, FAST.apply_lag + FAST.forecast_window)  # steps run on `new`
    ctl.observe(1, first)  # step 1 still runs the old layout: not measured
    for t in window:
        if t == window[-1]:
            assert ctl.realized.matured == 0  # matured only once the window's last step is seen
        assert ctl.observe(t, shifted) == []  # min_interval: no second re-placement
    # Measured as the logs show it: the old table before (on the one step the decision saw),
    # the new one on the steps it ran.
    measured = d.old.imbalance(first) - d.new.imbalance(shifted)
    assert ctl.realized.matured == 1
    assert ctl.realized_ratio == pytest.approx(measured / in_sample, rel=1e-12)
    assert ctl.realized_ratio < 0.5  # the layout fitted the old hot set
    # New forecasts scale the in-sample fall by it.
    old, new = d.new, d.old
    before = ctl.per_step_imbalance(0, old)
    fall = before - ctl.per_step_imbalance(0, new)
    assert ctl.forecast(0, old, new) == pytest.approx(
        (before, before - ctl.realized_ratio * fall), rel=1e-12, abs=1e-12
    )


def test_fall_tracker_calibrates_on_the_most_recent_replacements():
    from moejax.placement.realized import FallTracker

    new = Placement(np.array([0, 2, 1, 3]), num_experts=4, num_devices=2, slots_per_device=2)
    counts = np.array([[4.0, 3, 1, 0]])  # new's imbalance on them: 5 / 4
    tracker = FallTracker(recent=2)
    for i, (before, forecast) in enumerate([(2.25, 1.0), (1.75, 1.0), (2.0, 0.5)]):
        tracker.follow(0, new, first=i, last=i, before=before, forecast_fall=forecast)
        tracker.observe(i, counts)
    # Measured falls 1.0, 0.5, 0.75; the last two against their in-sample 1.0 + 0.5.
    assert tracker.matured == 3
    assert tracker.ratio == pytest.approx((0.5 + 0.75) / (1.0 + 0.5), rel=1e-12)
    # A state of the older cumulative format loads as one aggregate entry.
    old = FallTracker(recent=2)
    old.load_state_dict(
        {"forecast_sum": 2.0, "realized_sum": 1.0, "matured": 4, "followed": []}, [new]
    )
    assert (old.matured, old.ratio) == (4, 0.5)
    with pytest.raises(ValueError, match="recent must be >= 1, got 0"):
        FallTracker(recent=0)


# Cut after the counts of step 100 (a change-detector streak open: the hot set moved at 100),
# of step 103 (two re-placements followed, not yet measured to the end), of step 149 (quiet).
@pytest.mark.parametrize("cut", [101, 104, 150])
def test_state_dict_round_trip_makes_the_same_decisions(cut):
    # Two layers, a drifting trace. A controller restored from the JSON state
    # decides exactly as the one that kept running.
    trace = drifting_zipf(
        400, E, TOKENS, s=zipf_exponent_for(E, 4.0), shift_every=100, seed=5, num_layers=2
    )
    base = [Placement.identity(E, N, S)] * 2
    config = ControllerConfig(forecast_window=6)
    ctl = PlacementController(base, H100_IB, WL, config)
    for t in range(cut):
        ctl.observe(t, trace[t])
    state = ctl.state_dict()
    in_flight = {101: any(state["shifted"]), 104: state["realized"]["followed"], 150: True}
    assert in_flight[cut]
    # Built with other figures (as a re-measured model would be): the saved ones are restored.
    restored = PlacementController(base, H100_NVLINK, WL, config)
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.hardware == H100_IB
    assert restored.placements == ctl.placements
    for t in range(cut, trace.shape[0]):
        got, want = restored.observe(t, trace[t]), ctl.observe(t, trace[t])
        assert [(d.layer, d.new) for d in got] == [(d.layer, d.new) for d in want], t
    assert len(ctl.accepted) > len(restored.accepted) > 0
    np.testing.assert_array_equal(restored.ema, ctl.ema)
    assert restored.realized_ratio == ctl.realized_ratio
    assert restored.realized.matured == ctl.realized.matured > 0
    assert restored.state_dict()["realized"] == ctl.state_dict()["realized"]


def test_load_state_dict_rejects_another_shape():
    ctl = PlacementController(Placement.identity(E, N, S), H100_IB, WL)
    ctl.observe(0, np.ones(E))
    other = PlacementController(Placement.identity(E, N, S + 1), H100_IB, WL)
    with pytest.raises(ValueError, match=r"tables of shapes \[\(24,\)\], expected \[\(32,\)\]"):
        other.load_state_dict(ctl.state_dict())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(decide_every=0), "decide_every must be >= 1, got 0"),
        (dict(ema_decay=1.0), "ema_decay must lie in \\[0, 1\\), got 1.0"),
        (dict(min_interval=-1), "min_interval must be >= 0, got -1"),
        (dict(urgent_gain=0.01), "urgent_gain must be >= min_relative_gain"),
        (dict(forecast_window=0), "forecast_window must be >= 1, got 0"),
        (dict(react_gain=0.0), "react_gain must be > 0 or None, got 0.0"),
        (dict(react_steps=0), "react_steps must be >= 1, got 0"),
        (dict(react_urgent=0.2), "react_urgent must be None or > react_gain=0.25, got 0.2"),
        (dict(apply_lag=0), "apply_lag must be >= 1, got 0"),
        (dict(calibration_events=0), "calibration_events must be >= 1, got 0"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ControllerConfig(**kwargs)
