"""Subprocess of `test_outputs.py`: replace the converted model directory OUT (micro preset,
every parameter `value`) with `--overwrite` semantics, and SIGKILL itself at POINT:

  mid-write    after the parameters are written into the temporary sibling, before model.json
  before-swap  just before the atomic exchange
  after-swap   just after it, before the old output is deleted
  mid-remove   half-way through deleting the old output
  fallback     without an atomic exchange: between renaming the old output aside and the
               new one into place
  timer:S      S seconds after the write starts (wherever it is then)
  none         not at all

  python _replace_worker.py OUT VALUE POINT
"""

import os
import signal
import sys
import threading

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def write(out: str, value: float) -> None:
    import jax
    import jax.numpy as jnp

    from moejax.interop.hf import save_converted
    from moejax.models import abstract_params, presets

    cfg = presets.get("micro")
    params = jax.tree.map(lambda a: jnp.full(a.shape, value, a.dtype), abstract_params(cfg))
    save_converted(out, cfg, params, {"model_type": "micro"}, "micro", overwrite=True)


def arm(point: str) -> None:
    from moejax.interop.hf import _converted, _outputs

    if point == "mid-write":
        import json

        class _Json:  # save_converted's first json.dump is model.json, after the params
            load, loads = json.load, json.loads

            @staticmethod
            def dump(*args, **kw):
                die()

        _converted.json = _Json
    elif point == "before-swap":
        _outputs._exchange = lambda a, b: die()
    elif point == "after-swap":
        real = _outputs._exchange

        def exchange(a, b):
            real(a, b)
            die()

        _outputs._exchange = exchange
    elif point == "mid-remove":

        def half_then_die(path):  # the old output, at the temporary name after the swap
            files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
            for f in [f for f in files if not f.endswith(_outputs.MARKER)][: len(files) // 2]:
                os.unlink(f)
            die()

        _outputs._remove_ours = half_then_die
    elif point == "fallback":

        def no_exchange(a, b):
            real = os.rename

            def rename(src, dst):
                if os.fspath(src) == a:  # the second rename: the new output into place
                    die()
                real(src, dst)

            _outputs.os.rename = rename
            return False

        _outputs._exchange = no_exchange
    elif point.startswith("timer:"):
        threading.Timer(float(point.split(":", 1)[1]), die).start()
    elif point != "none":
        raise SystemExit(f"unknown point {point!r}")


def main():
    out, value, point = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    import jax  # noqa: F401  (imported before the timer starts: it times the write only)
    import orbax.checkpoint  # noqa: F401

    arm(point)
    write(out, value)
    print("done", flush=True)


if __name__ == "__main__":
    main()
