"""The command lines: each module is one command with `main(argv) -> int` (its exit code).

- `train_lm`: train an MoE language model (the README's main job); its inputs (flags, configs,
  mesh, corpus, starting weights) are read by `train_inputs`.
- `convert_hf`: Hugging Face directory <-> converted directory (`moejax.interop.hf`).
- `generate`: sample from a run, a checkpoint step or a converted directory.
- `simulate_placement`: placement strategies through the cost model, and the reference cases
  (`moejax.placement.reference_cases`).
- `replay_placement`: a placed run's routing trace through its placement controller.

Run one as `python -m moejax.cli.<name>`, or through its script in `experiments/`
(`python experiments/train_lm.py`), which only calls `main`.

The argument parsing they share, for scripts too (`experiments/plan_scale.py`): `OneLineParser`
(argparse whose errors are one line, exit 2) and the value types `positive_int`,
`nonnegative_int` and `positive_float` (a `0` is not "unset", a NaN not a number).
"""

from moejax.cli._parser import OneLineParser as OneLineParser
from moejax.cli._parser import nonnegative_int as nonnegative_int
from moejax.cli._parser import positive_float as positive_float
from moejax.cli._parser import positive_int as positive_int
