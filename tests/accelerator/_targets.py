"""Skip markers for the deviceless accelerator tests: each needs its compiler wheels."""

import pytest

from pallas_kernels import targets

needs_cuda = pytest.mark.skipif(
    targets.missing("cuda") is not None, reason=f"deviceless H100: {targets.missing('cuda')}"
)
needs_tpu = pytest.mark.skipif(
    targets.missing("tpu") is not None, reason=f"deviceless TPU: {targets.missing('tpu')}"
)
