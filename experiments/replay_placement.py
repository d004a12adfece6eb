"""Replays a placed training run's routing trace through its placement controller:
`moejax.cli.replay_placement`, whose docstring and `--help` say everything.

  python experiments/train_lm.py --placement --out runs/tiny_placed
  python experiments/replay_placement.py runs/tiny_placed --set react_steps=1
"""

import sys

from moejax.cli import replay_placement

if __name__ == "__main__":
    sys.exit(replay_placement.main())
