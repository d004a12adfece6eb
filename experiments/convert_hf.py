"""Convert a Hugging Face MoE decoder to an orbax checkpoint that training starts from, and back:
`moejax.cli.convert_hf`, whose docstring and `--help` say everything.

  python experiments/convert_hf.py to-orbax path/to/OLMoE-1B-7B converted/olmoe
  python experiments/convert_hf.py to-hf converted/olmoe out/olmoe-hf
"""

import sys

from moejax.cli import convert_hf

if __name__ == "__main__":
    sys.exit(convert_hf.script())
