"""Training tests share one persistent XLA compilation cache (also used by the subprocesses
they launch, through the environment), so each distinct step program compiles once per machine
instead of once per test and process.

In this process the cache is on only while a training test runs (`_persistent_cache`), not from
collection on: pytest imports this file in every worker, and a cache turned on here at import
would also serve the other directories' programs from disk. With jaxlib 0.12.0.1 an XLA:CPU
executable of 8 simulated devices loaded back from the cache intermittently pairs different
collectives across devices: NaN rows in `tests/parallel/test_dropless_ragged.py` (about one run
in seven of its `all_on_one-d2e4` case), or a rendezvous abort; compiled in-process it never did.
"""

import os
import tempfile

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

CACHE_DIR = os.path.join(tempfile.gettempdir(), "moejax_test_jax_cache")
os.environ["JAX_COMPILATION_CACHE_DIR"] = CACHE_DIR
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


@pytest.fixture(autouse=True)
def _persistent_cache():
    """The persistent cache on for one training test, then back off for the worker's next test
    (whatever its directory). `reset_cache` because jax decides once per process whether the
    cache is used."""
    jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
