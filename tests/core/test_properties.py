"""Property test: over random small layers and routings, dropless drops nothing and every
implementation computes the reference's output."""

import functools

import hypothesis
import jax
import numpy as np
from hypothesis import strategies as st

import moejax
from moejax._config import ACTIVATIONS
from moejax.testing import assert_close, random_params

IMPLS = ("reference", "ragged_dot", "blocked")


@st.composite
def layers(draw):
    """`(config, tokens, routing kind, seed)` for a tiny dropless layer."""
    e = draw(st.integers(1, 8))
    router = draw(st.sampled_from(["softmax", "sigmoid", "topk_softmax"]))
    groups, topk_groups = 1, 1
    if router == "sigmoid" and e % 2 == 0 and e >= 4 and draw(st.booleans()):
        groups = 2
        topk_groups = draw(st.integers(1, 2))
    k = draw(st.integers(1, min(3, topk_groups * e // groups)))
    config = moejax.MoEConfig(
        d_model=draw(st.sampled_from([4, 8])),
        d_ff=draw(st.sampled_from([4, 8])),
        num_experts=e,
        top_k=k,
        router=router,
        norm_topk_prob=draw(st.booleans()),
        router_bias=router == "topk_softmax",
        score_correction_bias=router == "sigmoid",
        num_groups=groups,
        topk_groups=topk_groups,
        activation=draw(st.sampled_from(ACTIVATIONS)),
        expert_bias=draw(st.booleans()),
        block_size=draw(st.sampled_from([1, 2, 4, 8])),
    )
    tokens = draw(st.integers(1, 24))
    routing = draw(st.sampled_from(["random", "skewed", "one_hot"]))
    return config, tokens, routing, draw(st.integers(0, 2**16))


def _case(config, tokens, routing, seed):
    """Parameters and `x [T, D]` giving the requested routing."""
    params = jax.tree.map(np.array, random_params(config, seed))  # writable copies
    rng = np.random.default_rng(seed + 1)
    x = rng.normal(size=(tokens, config.d_model)).astype(np.float32)
    kernel = params["router"]["kernel"]
    if routing == "one_hot":  # every token's first choice is the last expert
        kernel[...] = 0.0
        kernel[:, -1] = 30.0
        for name in ("bias", "score_correction_bias"):
            params["router"].get(name, np.zeros(1))[...] = 0.0
        x = np.abs(x)
    elif routing == "skewed":  # logits shifted by up to 3 * sum|x| toward expert 0: Zipf-like
        kernel += np.linspace(3.0, 0.0, config.num_experts, dtype=np.float32)
        x = np.abs(x)
    return params, x


@functools.partial(jax.jit, static_argnames="config")
def _apply_all(params, x, config):
    return {impl: moejax.moe_apply(params, x, config, implementation=impl) for impl in IMPLS}


GROUPED = moejax.MoEConfig(  # always tried: group-limited sigmoid routing, GPT-OSS activation
    d_model=8,
    d_ff=4,
    num_experts=8,
    top_k=3,
    router="sigmoid",
    score_correction_bias=True,
    num_groups=4,
    topk_groups=2,
    activation="clamped_swiglu",
    swiglu_limit=0.5,
    expert_bias=True,
    block_size=4,
)


@hypothesis.settings(max_examples=8, deadline=None, derandomize=True)
@hypothesis.given(layers())
@hypothesis.example((GROUPED, 13, "skewed", 0))
def test_dropless_drops_nothing_and_implementations_agree(case):
    config, tokens, routing, seed = case
    params, x = _case(config, tokens, routing, seed)
    results = _apply_all(params, x, config)
    y_ref, aux_ref = results["reference"]
    for impl, (y, aux) in results.items():
        assert float(aux.dropped_fraction) == 0.0, impl
        assert not bool(aux.dropped_mask.any()), impl
        counts = np.asarray(aux.expert_counts)
        np.testing.assert_array_equal(aux.kept_counts, counts)
        assert counts.sum() == tokens * config.top_k
        if routing == "one_hot":
            assert counts[-1] == tokens
        assert_close(y, y_ref, err_msg=impl)
        assert_close(aux, aux_ref, err_msg=impl)
