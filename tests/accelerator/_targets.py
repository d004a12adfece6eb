"""Skip markers for the deviceless accelerator tests: each needs its compiler wheels."""

import pytest

from pallas_kernels import targets

needs_cuda = pytest.mark.skipif(
    targets.missing("cuda") is not None, reason=f"deviceless H100: {targets.missing('cuda')}"
)
needs_tpu = pytest.mark.skipif(
    targets.missing("tpu") is not None, reason=f"deviceless TPU: {targets.missing('tpu')}"
)

# The training tests turn on jax's persistent compilation cache in their worker process; an
# executable compiled for a deviceless target cannot be loaded back from it, and jax says so in
# a UserWarning before compiling anyway. Harmless here.
CACHE_WARNING = pytest.mark.filterwarnings(
    "ignore:Error reading persistent compilation cache entry:UserWarning"
)
