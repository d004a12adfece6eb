"""Placement simulator: static vs shadowing vs the controller vs perfect balance, and the
reference cases: `moejax.cli.simulate_placement`, whose docstring and `--help` say everything.

  python experiments/simulate_placement.py
  python experiments/simulate_placement.py --trace runs/tiny/routing_trace.npy --devices 4 8
  python experiments/simulate_placement.py --case eplb-readme --case zipf-256 --case deepseek-v3
"""

import sys

from moejax.cli import simulate_placement

if __name__ == "__main__":
    sys.exit(simulate_placement.main())
