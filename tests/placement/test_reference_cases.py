"""experiments/simulate_placement.py --case: the EPLB README example and E=256 Zipf loads.

The numbers are recorded in BENCHMARKS.md ("Placement", reference cases); here only their
sanity: max / mean >= 1, the bound <= moejax's plan <= the static layout.
"""

import importlib.util
import os

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location(
    "simulate_placement",
    os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "simulate_placement.py"),
)
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)


@pytest.mark.parametrize("name", sim.CASES)
def test_reference_case_numbers_are_sane(name, capsys):
    result = sim.reference_case(name)
    layers = 2 if name == "eplb-readme" else 4
    assert len(result["rows"]) == layers
    for r in result["rows"]:
        assert 1.0 <= r["bound"] <= r["moejax"] + 1e-12, r
        assert r["moejax"] <= r["static"], r
        assert r["moejax"] < r["static"], r  # these loads are skewed: the plan must help
        if "eplb" in r:
            assert r["bound"] <= r["eplb"] + 1e-12, r
    sim.print_reference(result)
    out = capsys.readouterr().out
    assert f"case {name}:" in out and "| config | layer | static | moejax plan" in out


def test_eplb_readme_published_placement_is_valid():
    # The placement EPLB's README prints: every expert present, 2 slots on each of 8 GPUs.
    for layer, counts in enumerate(sim.EPLB_README_WEIGHT):
        p = sim.Placement(sim.EPLB_README_PHY2LOG[layer], 12, 8, 2)
        assert p.device_load(counts.astype(np.float64)).sum() == pytest.approx(counts.sum())


def test_load_bound_counts_distinct_devices():
    # One expert with all rows, 4 devices: at best split over 4 devices -> max / mean = 1.
    counts = np.array([100.0, 0, 0, 0])
    assert sim.load_bound(counts, 4, 2) == 1.0
    # 2 devices, 1 slot each, 2 experts 90 / 10: no replica possible; bound 90 / 50.
    assert sim.load_bound(np.array([90.0, 10.0]), 2, 1) == pytest.approx(1.8)
