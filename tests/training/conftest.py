"""Training tests share one persistent XLA compilation cache (also used by the subprocesses
they launch, through the environment), so each distinct step program compiles once per machine
instead of once per test and process."""

import os
import tempfile

import jax

CACHE_DIR = os.path.join(tempfile.gettempdir(), "moejax_test_jax_cache")
os.environ["JAX_COMPILATION_CACHE_DIR"] = CACHE_DIR
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
