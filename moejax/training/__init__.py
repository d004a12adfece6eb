"""moejax.training: optimizer, jitted sharded train step, loop, checkpoints and metrics.

Input errors a user can cause (`INPUT_ERRORS`: bad shapes for the mesh, a missing or malformed
corpus, a foreign or corrupt checkpoint directory, a run directory in use by another run or
holding files moejax did not write, a resume with another model, batch or seed) are `ValueError`
subclasses with one-line messages that name the problem; `experiments/train_lm.py` prints them
(and `moejax.interop.hf.CheckpointError`, e.g. a converted model given as `train(init_params=...)`
failing its checksums) and exits 2.

Dynamic expert placement (`TrainConfig.expert_slots_per_device`, `train(controller=...)`,
`train_lm.py --placement`): `moejax.training.placed`. The parallel strategy chosen by timing
train steps (`train(strategy=tuning.TuningConfig())`, `train_lm.py --strategy auto`):
`moejax.training.tuning`.
"""

from moejax._disk import OutputWriteError as _OutputWriteError
from moejax.data import DataError as DataError
from moejax.training import placed as placed
from moejax.training import presets as presets
from moejax.training import tuning as tuning
from moejax.training._config import SetupError as SetupError
from moejax.training._config import TrainConfig as TrainConfig
from moejax.training._config import check_setup as check_setup
from moejax.training.checkpoint import Checkpointer as Checkpointer
from moejax.training.checkpoint import CheckpointError as CheckpointError
from moejax.training.loop import RunResult as RunResult
from moejax.training.loop import train as train
from moejax.training.metrics import flops_per_token as flops_per_token
from moejax.training.optimizer import learning_rate_schedule as learning_rate_schedule
from moejax.training.optimizer import make_optimizer as make_optimizer
from moejax.training.resume import ResumeMismatch as ResumeMismatch
from moejax.training.rundir import RunDirBusy as RunDirBusy
from moejax.training.rundir import RunDirError as RunDirError
from moejax.training.state import TrainState as TrainState
from moejax.training.state import abstract_state as abstract_state
from moejax.training.state import global_batch as global_batch
from moejax.training.state import init_train_state as init_train_state
from moejax.training.state import state_shardings as state_shardings
from moejax.training.step import StepMetrics as StepMetrics
from moejax.training.step import lm_loss as lm_loss
from moejax.training.step import make_eval_step as make_eval_step
from moejax.training.step import make_train_step as make_train_step
from moejax.training.step import train_step as train_step

INPUT_ERRORS = (DataError, CheckpointError, SetupError, RunDirError, _OutputWriteError)

__all__ = [
    "INPUT_ERRORS",
    "DataError",
    "CheckpointError",
    "Checkpointer",
    "ResumeMismatch",
    "RunDirBusy",
    "RunDirError",
    "RunResult",
    "SetupError",
    "StepMetrics",
    "TrainConfig",
    "TrainState",
    "abstract_state",
    "check_setup",
    "flops_per_token",
    "global_batch",
    "init_train_state",
    "learning_rate_schedule",
    "lm_loss",
    "make_eval_step",
    "make_optimizer",
    "make_train_step",
    "placed",
    "presets",
    "state_shardings",
    "train",
    "train_step",
    "tuning",
]
