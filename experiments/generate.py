"""Sample text from a trained or converted model: `moejax.cli.generate`, whose docstring and
`--help` say everything.

  python experiments/generate.py runs/tiny --prompt "def "
  python experiments/generate.py converted/olmoe --ids 1,2,3 --max-new-tokens 20
"""

import sys

from moejax.cli import generate

if __name__ == "__main__":
    sys.exit(generate.main())
