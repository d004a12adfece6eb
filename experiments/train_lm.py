"""Train an MoE language model (the README's main job): `moejax.cli.train_lm`, whose docstring
and `--help` say everything.

  python experiments/train_lm.py                # tiny preset, 2x4 mesh of simulated CPU devices
  python experiments/train_lm.py --help
"""

import sys

from moejax.cli import train_lm

if __name__ == "__main__":
    sys.exit(train_lm.script())
