"""Autotuner: per layer shape and routing-load bucket, time compiled candidate strategies once,
cache the fastest, and reuse it (and its compiled executable) on every later call.

A candidate is timed on what training runs: forward and backward (`objective="fwd+bwd"`, the
gradient of `sum(y)` with respect to the parameters and the tokens), one untimed run that
compiles it, then `repeats` timed runs; the median counts (one slow outlier on a shared machine
does not decide, nor one lucky run). Only the winner's forward is compiled for the calls. A whole
training step, with the rest of the model and the batch split, is tuned by
`moejax.training.tuning`.

The key is `(x shape, x dtype, bucket)`, where `bucket` is the dropless all-to-all bucket the host
chose from the previous step's routing (`choose_bucket`); a new bucket means new candidate
programs (the bucket is a static buffer size), so the tuner re-decides then and only then. In
steady state (same shape, same bucket) a call is a dictionary lookup plus a call of an
already-compiled `jax.jit` function: no tracing, no compilation.

>>> import jax, jax.numpy as jnp, moejax
>>> from moejax import parallel
>>> cfg = moejax.MoEConfig(d_model=16, d_ff=32, num_experts=8, top_k=2, block_size=8)
>>> mesh = parallel.make_mesh((8,), ("expert",))
>>> tuner = parallel.Autotuner(cfg, mesh, candidates=[parallel.Strategy(mode="data"),
...                                                   parallel.Strategy(dispatcher="allgather")])
>>> params = parallel.shard_params(moejax.init_moe_params(cfg, jax.random.key(0)), cfg, mesh)
>>> y, aux = tuner(params, parallel.shard_activations(jnp.ones((64, 16)), mesh), bucket=4)
>>> tuner.choice((64, 16), jnp.float32, 4) in tuner.candidates
True
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from moejax._config import MoEConfig
from moejax.parallel.layer import moe_apply_sharded
from moejax.parallel.mesh import token_shards
from moejax.parallel.strategy import PIPELINE_DEGREES, Strategy


def default_candidates(config: MoEConfig, chunks: Sequence[int] = PIPELINE_DEGREES):
    """Every valid (mode, dispatcher, pipeline degree) for `config` (bucket filled in per call)."""
    capacity = config.dispatch == "capacity" or config.router == "expert_choice"
    dispatchers = ("capacity", "dropless", "allgather") if capacity else ("dropless", "allgather")
    out = [Strategy(mode="expert", dispatcher=d, chunks=c) for d in dispatchers for c in chunks]
    out += [Strategy(mode=m, chunks=c) for m in ("data", "tensor") for c in chunks]
    return out


class Autotuner:
    """Chooses and caches a `Strategy` per (shape, dtype, bucket); see module docstring.

    Args:
      config: the layer config.
      mesh: the mesh.
      candidates: strategies to try (default `default_candidates(config)`); candidates that do
        not fit a shape (chunks not dividing the local tokens, tensor mode with F/M not divisible
        by N) are skipped.
      implementation: grouped matmul implementation.
      repeats: timed runs per candidate (the median is used) after one warm-up run.
      timer: a clock (seconds), replaceable in tests; `timing` is the strategy being timed
        while it runs (None otherwise), for a test clock to read.
      objective: what is timed: `"fwd+bwd"` (forward and backward, as in training) or
        `"fwd"`.
    """

    def __init__(
        self,
        config: MoEConfig,
        mesh,
        *,
        candidates: Sequence[Strategy] | None = None,
        implementation: str = "auto",
        repeats: int = 3,
        timer: Callable[[], float] = time.perf_counter,
        objective: str = "fwd+bwd",
    ):
        if objective not in ("fwd+bwd", "fwd"):
            raise ValueError(f"objective={objective!r}: must be 'fwd+bwd' or 'fwd'")
        self.config, self.mesh = config, mesh
        self.candidates = tuple(candidates or default_candidates(config))
        self.implementation, self.repeats, self.timer = implementation, repeats, timer
        self.objective = objective
        self.timings: dict[tuple, dict[Strategy, float]] = {}
        self.timing: Strategy | None = None
        self._choice: dict[tuple, Strategy] = {}
        self._fns: dict[Strategy, Callable] = {}
        self._timed_fns: dict[Strategy, Callable] = {}

    def fn(self, strategy: Strategy) -> Callable:
        """The jitted `(params, x) -> (y, aux)` of one strategy (one per strategy, reused)."""
        if strategy not in self._fns:
            self._fns[strategy] = jax.jit(
                functools.partial(
                    moe_apply_sharded,
                    config=self.config,
                    mesh=self.mesh,
                    strategy=strategy,
                    implementation=self.implementation,
                )
            )
        return self._fns[strategy]

    def timed_fn(self, strategy: Strategy) -> Callable:
        """The jitted function timed for `strategy`: `fn` itself with `objective="fwd"`, else
        `(params, x) -> gradients of sum(y)` with respect to both (one per strategy, reused)."""
        if self.objective == "fwd":
            return self.fn(strategy)
        if strategy not in self._timed_fns:
            forward = functools.partial(
                moe_apply_sharded,
                config=self.config,
                mesh=self.mesh,
                strategy=strategy,
                implementation=self.implementation,
            )
            loss = lambda params, x: forward(params, x)[0].astype(jnp.float32).sum()  # noqa: E731
            self._timed_fns[strategy] = jax.jit(jax.grad(loss, argnums=(0, 1)))
        return self._timed_fns[strategy]

    def choice(self, shape, dtype, bucket) -> Strategy | None:
        """The cached strategy for a key, or None if not tuned yet."""
        return self._choice.get(_key(shape, dtype, bucket))

    def __call__(self, params, x, *, bucket: int | None = None):
        """`moe_apply_sharded` with the tuned strategy for `(x.shape, x.dtype, bucket)`."""
        key = _key(x.shape, x.dtype, bucket)
        if key not in self._choice:
            self._choice[key] = self._tune(params, x, bucket, key)
        return self.fn(self._choice[key])(params, x)

    def _fits(self, strategy: Strategy, x) -> bool:
        local = x.shape[0] // token_shards(self.mesh)
        local_tokens = local * (x.size // x.shape[0] // x.shape[-1])
        if local_tokens % strategy.chunks:
            return False
        n, m = dict(self.mesh.shape).get("expert", 1), dict(self.mesh.shape).get("model", 1)
        return not (strategy.mode == "tensor" and (self.config.d_ff // m) % n)

    def _tune(self, params, x, bucket, key) -> Strategy:
        timings = {}
        for cand in self.candidates:
            if cand.mode == "expert" and cand.dispatcher == "dropless":
                cand = cand.replace(bucket=bucket)
            if not self._fits(cand, x):
                continue
            f = self.timed_fn(cand)
            jax.block_until_ready(f(params, x))  # compile + warm up
            samples = []
            self.timing = cand
            for _ in range(self.repeats):
                start = self.timer()
                jax.block_until_ready(f(params, x))
                samples.append(self.timer() - start)
            self.timing = None
            timings[cand] = statistics.median(samples)
        if not timings:
            raise ValueError(f"x.shape={x.shape}: no candidate strategy fits")
        self.timings[key] = timings
        return min(timings, key=timings.get)


def _key(shape, dtype, bucket) -> tuple:
    return (tuple(shape), str(jax.numpy.dtype(dtype)), bucket)
