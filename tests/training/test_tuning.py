"""The strategy tuner: with a clock whose step times depend on the candidate running, the fastest
candidate wins; a routing shift re-decides (and a bucket seen before costs nothing); each
distinct (candidate, bucket) compiles once; the budget bounds what is tried; `train` records its
decisions in the run's outputs."""

import collections
import json
import math

import pytest
from _helpers import MODEL, TRAIN, corpus, mesh

from moejax import parallel
from moejax.parallel import Strategy
from moejax.training import SetupError, report, train, tuning
from moejax.training.tuning import Candidate, StrategyTuner, TuningConfig

DROPLESS, DATA, ALLGATHER = (tuning.parse_candidate(s) for s in ("dropless", "data", "allgather"))
SPACE = (DROPLESS, DATA, ALLGATHER)
TOKENS, TOP_K, N = 1024, 2, 4  # balanced bucket 512 rows, quantum 64, cap 640


class CandidateClock:
    """A clock that is called twice around each timed step (as `StepRunner` does); the second
    call advances it by the running candidate's step time (by its label without the bucket: a
    number, or a list with one per run), plus `compile_s` on a program's first run. `tuner` is
    set after the tuner is built."""

    def __init__(self, step_s: dict, compile_s: float = 5.0):
        self.step_s, self.compile_s = step_s, compile_s
        self.tuner, self.now, self.calls, self.programs = None, 0.0, 0, []
        self.runs = collections.Counter()

    def __call__(self):
        self.calls += 1
        if self.calls % 2 == 0:
            running = self.tuner.running
            label = running.unbucketed().label
            step_s = self.step_s[label]
            self.now += step_s if isinstance(step_s, float) else step_s[self.runs[label]]
            self.runs[label] += 1
            if running not in self.programs:
                self.programs.append(running)
                self.now += self.compile_s
        return self.now


def _tuner(step_s, *, compile_s=5.0, space=SPACE, **config):
    clock = CandidateClock(step_s, compile_s)
    tuner = StrategyTuner(
        space, tokens=TOKENS, top_k=TOP_K, n=N, config=TuningConfig(**config), clock=clock
    )
    clock.tuner = tuner
    return tuner, clock


def _drive(tuner, clock, imbalances, start=0):
    """The loop without jax: steps `start + 1...`, each timed if asked, each step's record
    observed (here at once; the loop sees it one step late)."""
    tuner.begin(start, start + len(imbalances))
    ran = []
    for step, imbalance in enumerate(imbalances, start + 1):
        candidate, timed = tuner.next(step)
        if timed:
            t0 = clock()
            tuner.timed(candidate, clock() - t0)
        ran.append(candidate)
        tuner.observe({"device_imbalance": [imbalance, None]})
    return ran


@pytest.mark.parametrize("fastest", ["dropless", "data", "allgather"])
def test_the_fastest_candidate_wins(fastest):
    step_s = {"dropless": 0.30, "data": 0.25, "allgather": 0.35}
    step_s[fastest] = 0.10
    tuner, clock = _tuner(step_s, budget=math.inf)
    ran = _drive(tuner, clock, [1.0] * 40)
    measured = [d for d in tuner.decisions if d.kind == "measured"]
    assert len(measured) == 1
    assert tuner.current.unbucketed().label == fastest
    assert ran[-1] == tuner.current and ran[-10:] == [tuner.current] * 10
    times = dict(measured[0].times)
    assert measured[0].times[0][0] == tuner.current.label  # fastest first
    assert times[tuner.current.label] == pytest.approx(0.10)
    assert len(times) == 3 and min(times.values()) == pytest.approx(0.10)


def test_one_lucky_step_does_not_decide():
    # data is slower, but one of its timed steps is 20x faster (the machine was idle just
    # then): the fastest single step would pick it, the median does not.
    data = [0.20, 0.20, 0.01, 0.20]  # its compiling run (plus compile_s), then 3 timed
    tuner, clock = _tuner({"dropless": 0.10, "data": data, "allgather": 0.30}, budget=math.inf)
    _drive(tuner, clock, [1.0] * 40)
    assert clock.runs["data"] == 4 and tuner.current.unbucketed() == DROPLESS
    assert dict(tuner.decisions[-1].times)["data"] == pytest.approx(0.20)


def test_the_start_round_runs_when_the_load_wants_the_balanced_bucket():
    tuner, clock = _tuner({"dropless": 0.3, "data": 0.2, "allgather": 0.1}, budget=math.inf)
    _drive(tuner, clock, [None] * 20)  # no routing statistics: the balanced bucket stands
    assert [(d.kind, d.bucket) for d in tuner.decisions] == [
        ("probe", tuner.balanced),
        ("measured", tuner.balanced),
    ]
    assert tuner.current == ALLGATHER and dict(tuner.decisions[1].times)["dropless"] == 0.3


def test_a_routing_shift_redecides_once_per_bucket_and_compiles_once_per_program():
    step_s = {"dropless": 0.10, "data": 0.20, "allgather": 0.30}
    tuner, clock = _tuner(step_s, budget=math.inf, window=3)
    calm = tuning.wanted_bucket(1.0, TOKENS, TOP_K, N)
    skewed = tuning.wanted_bucket(1.2, TOKENS, TOP_K, N)
    assert tuner.balanced < calm < skewed
    imbalances = [1.0] * 20 + [1.2] * 20 + [1.0] * 20
    _drive(tuner, clock, imbalances)
    kinds = [(d.kind, d.bucket) for d in tuner.decisions]
    assert kinds[0] == ("probe", tuner.balanced)
    # start (the bucket the balanced load wants), the shift, and back (decided before: no round)
    assert kinds[1:] == [("measured", calm), ("measured", skewed), ("followed", calm)]
    shift = tuner.decisions[2]
    assert shift.reason.startswith(f"routing: bucket {calm} -> {skewed}")
    # Step 21's record (seen after step 21 here; one step late in the loop) starts the round
    # at step 22: dropless compiles at the new bucket (1 + 3 steps), the others are re-timed.
    assert (shift.started, shift.step) == (22, 22 + 4 + 3 + 3)
    assert len(shift.times) == 3 and shift.chosen == f"dropless,bucket={skewed}"
    assert tuner.current == tuner.at(DROPLESS, calm)
    as_json = [json.loads(json.dumps(d.to_json(), allow_nan=False)) for d in tuner.decisions]
    assert [tuning.Decision.from_json(d) for d in as_json] == tuner.decisions
    # One compile per distinct program: the default (bucket None), dropless at both buckets,
    # data and allgather once (their programs do not depend on the bucket).
    assert len(clock.programs) == len(set(clock.programs)) == len(tuner.programs) == 5
    assert {c.label for c in tuner.programs} == {
        "dropless",
        f"dropless,bucket={calm}",
        f"dropless,bucket={skewed}",
        "data",
        "allgather",
    }


def test_the_budget_bounds_the_compiles_and_the_log_says_why():
    step_s = {"dropless": 0.30, "data": 0.10, "allgather": 0.10}
    # 100 steps of 0.3 s with a 10% budget: 3 s, less than one 5 s compile.
    tuner, clock = _tuner(step_s, budget=0.1)
    _drive(tuner, clock, [1.0] * 100)
    assert [d.kind for d in tuner.decisions] == ["probe", "skipped"]
    assert tuner.decisions[0].budget_s == pytest.approx(3.0)
    assert tuner.decisions[0].compile_s == (("dropless", pytest.approx(5.0)),)
    assert "a compile is estimated at 5 s, 3 s of the 3 s budget left" in tuner.decisions[1].reason
    assert tuner.current.unbucketed() == DROPLESS and len(clock.programs) == 1
    # A 6 s budget affords one compile: the first candidate in priority order (the default at
    # the bucket the load wants), taken without timing (nothing to compare it with).
    tuner, clock = _tuner(step_s, budget=0.2)
    _drive(tuner, clock, [1.0] * 100)
    assert [d.kind for d in tuner.decisions] == ["probe", "followed"]
    assert tuner.current == tuner.at(DROPLESS, tuning.wanted_bucket(1.0, TOKENS, TOP_K, N))


def test_a_cost_function_ranks_without_timing():
    cost = {"dropless": 3.0, "data": 1.0, "allgather": 2.0}
    clock = CandidateClock({"dropless": 0.1, "data": 0.1, "allgather": 0.1})
    tuner = StrategyTuner(
        SPACE,
        tokens=TOKENS,
        top_k=TOP_K,
        n=N,
        config=TuningConfig(budget=math.inf),
        clock=clock,
        cost=lambda c: cost[c.unbucketed().label],
    )
    clock.tuner = tuner
    _drive(tuner, clock, [1.0] * 10)
    assert [d.kind for d in tuner.decisions] == ["probe", "cost"]
    assert tuner.current == DATA and len(clock.programs) == 1  # only the probe was timed


def test_candidates_parse_label_and_fit():
    c = tuning.parse_candidate("expert,dropless,chunks=2,stagger,split=2,bucket=40")
    assert c == Candidate(Strategy(chunks=2, stagger=True, bucket=40), batch_split=2)
    assert tuning.parse_candidate(c.label) == c
    assert tuning.parse_candidate("data,allgather") == DATA  # one spelling per program
    assert tuning.parse_candidates("data; allgather") == (DATA, ALLGATHER)
    with pytest.raises(ValueError, match="cannot read 'chunk=2'"):
        tuning.parse_candidate("dropless,chunk=2")
    m = mesh()  # 2 x 4; micro: 8 x 16 tokens, 1 sequence per token shard
    assert tuning.candidate_problems(Candidate(batch_split=2), MODEL, TRAIN, m) == [
        "batch_split=2 does not divide the 1 sequences of a token shard"
    ]
    capacity = tuning.parse_candidate("capacity")
    assert (
        "capacity dispatcher needs a capacity config"
        in tuning.candidate_problems(capacity, MODEL, TRAIN, m)[0]
    )
    space = tuning.candidate_space(MODEL, TRAIN, m, (DROPLESS, capacity, DATA, DROPLESS))
    assert space == (DROPLESS, DATA)
    assert tuning.candidate_space(MODEL, TRAIN, m) == SPACE  # CPU defaults


def test_wanted_bucket_grows_with_imbalance_up_to_the_cap():
    buckets = [tuning.wanted_bucket(x, 4096, 2, 4) for x in (1.0, 1.1, 1.3, 4.0)]
    assert buckets == sorted(buckets) and buckets[0] < buckets[-1] == 2560  # 1.25 x 2048
    assert tuning.wanted_bucket(1.0, 4096, 2, 4, margin=0) == 2048


def _tuned_run(run_dir, cfg, stop_at, monkeypatch):
    clock = CandidateClock({"allgather": 0.2, "data": 0.1})
    config = TuningConfig((ALLGATHER, DATA), repeats=2, budget=math.inf, redecide=False)
    real = tuning.tuner.tuner_for_run

    def with_clock(*args):  # the tuner `train` builds for `config`, on the test's clock
        clock.tuner = real(*args, clock=clock)
        return clock.tuner

    monkeypatch.setattr(tuning.runner, "tuner_for_run", with_clock)
    kw = dict(mesh=mesh(), strategy=config, stop_at=stop_at, progress=False)
    return train(MODEL, cfg, corpus(), run_dir=str(run_dir), **kw)


def test_train_tunes_records_its_decisions_compiles_each_program_once_and_resumes(
    tmp_path, monkeypatch
):
    cfg = TRAIN.replace(steps=16, eval_batches=1, checkpoint_every=0)
    result = _tuned_run(tmp_path, cfg, stop_at=12, monkeypatch=monkeypatch)
    assert result.step == 12 and result.final_loss is not None
    assert result.tuning["chosen"] == "data" and result.tuning["kind"] == "measured"
    assert list(result.tuning["times"])[0] == "data"
    # Each step function compiled exactly one executable; one per distinct program run.
    assert result.tuning["compiled"] == {"allgather": 1, "data": 1}
    events = [json.loads(line) for line in (tmp_path / "tuning_events.jsonl").open()]
    assert [e["kind"] for e in events] == ["probe", "measured"]
    assert events[1]["chosen"] == "data" and events[1]["times"] == {"data": 0.1, "allgather": 0.2}
    # The probe (steps 1-3), then the round for the bucket the load wants (steps 4-8: data
    # compiles and runs 2 timed steps, allgather is re-timed twice), then data.
    assert (events[1]["started"], events[1]["step"]) == (4, 9)
    assert result.tuning["switches"] == [(9, "data")]  # marked in loss.png
    assert (tmp_path / "loss.png").exists()
    rows = dict(report.summary_rows(result))
    assert rows["parallel strategy"] == "data (fastest median step of 2 timed)"
    assert rows["step times measured (median)"] == "data 0.1 s, allgather 0.2 s"

    # Resumed: it continues on data (the probe times it; the bucket was decided for) and the
    # log keeps the first run's decisions.
    resumed = _tuned_run(tmp_path, cfg, stop_at=None, monkeypatch=monkeypatch)
    assert resumed.steps_this_run == 4 and resumed.tuning["compiled"] == {"data": 1}
    events = [json.loads(line) for line in (tmp_path / "tuning_events.jsonl").open()]
    assert [(e["kind"], e["chosen"]) for e in events[2:]] == [("probe", "data")]


def test_one_device_runs_the_default(tmp_path):
    cfg = TRAIN.replace(steps=3, eval_batches=0, checkpoint_every=0)
    result = train(
        MODEL, cfg, corpus(), run_dir=str(tmp_path), strategy=TuningConfig(), progress=False,
        outputs=False,
    )  # fmt: skip
    assert result.tuning["kind"] == "fixed" and "one device" in result.tuning["reason"]


@pytest.mark.parametrize("strategy", ["tune", Strategy(), "default", None])
def test_train_takes_auto_a_candidate_or_a_tuning_config(tmp_path, strategy):
    cfg = TRAIN.replace(steps=3, eval_batches=0, checkpoint_every=0)
    with pytest.raises(SetupError, match="must be 'auto', a tuning.Candidate"):
        train(MODEL, cfg, corpus(), run_dir=str(tmp_path), mesh=mesh(), strategy=strategy)
    assert not any(tmp_path.iterdir())  # refused before anything is written


@pytest.mark.parametrize("drop_policy", ["dropless", "capacity"])
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_default_candidates_come_from_the_layer_strategy_space(drop_policy, platform):
    moe = MODEL.moe.replace(drop_policy=drop_policy)
    space = parallel.strategy_space(moe)
    assert space[0] == parallel.Strategy(dispatcher=drop_policy)  # the "auto" default
    assert len(set(space)) == len(space)
    assert ("capacity" in {s.dispatcher for s in space}) == (drop_policy == "capacity")
    candidates = tuning.default_candidates(moe, platform)
    assert candidates[0] == Candidate(space[0])
    assert {c.strategy for c in candidates} <= set(space)
    assert any(c.batch_split == 2 for c in candidates) == (platform != "cpu")


def test_summary_of_a_run_stopped_before_the_first_decision():
    """SIGTERM can land before the tuner decides anything: the summary says so instead of
    failing the run's last save (seen in test_resume's SIGTERM test)."""
    runner = tuning.runner.StepRunner(TuningConfig(), MODEL, TRAIN, mesh(), "blocked")
    assert runner.tuner is not None and not runner.tuner.decisions
    summary = runner.summary()
    assert summary["kind"] == "none" and "before the tuner's first decision" in summary["reason"]
    assert summary["decisions"] == 0 and summary["switches"] == []
