"""moejax.placement.reference_cases (`simulate_placement --case`): the EPLB README example,
E=256 Zipf loads, DeepSeek-V3.

The numbers are recorded in BENCHMARKS.md ("Placement", reference cases); here only their
sanity: max / mean >= 1, the bound <= moejax's plan <= the static layout.
"""

import numpy as np
import pytest

from moejax.cli import simulate_placement as cli
from moejax.placement import H100_IB, Placement, Workload
from moejax.placement import reference_cases as cases


@pytest.mark.parametrize("name", cases.CASES)
def test_reference_case_numbers_are_sane(name, capsys):
    result = cases.reference_case(name)
    layers = 2 if name == "eplb-readme" else 4
    assert len(result["rows"]) == layers
    for r in result["rows"]:
        assert 1.0 <= r["bound"] <= r["moejax"] + 1e-12, r
        assert r["moejax"] <= r["static"], r
        assert r["moejax"] < r["static"], r  # these loads are skewed: the plan must help
        if "eplb" in r:
            assert r["bound"] <= r["eplb"] + 1e-12, r
    cli.print_reference(result)
    out = capsys.readouterr().out
    assert f"case {name}:" in out and "| config | layer | static | moejax plan" in out


def test_eplb_readme_published_placement_is_valid():
    # The placement EPLB's README prints: every expert present, 2 slots on each of 8 GPUs.
    for layer, counts in enumerate(cases.EPLB_README_WEIGHT):
        p = Placement(cases.EPLB_README_PHY2LOG[layer], 12, 8, 2)
        assert p.device_load(counts.astype(np.float64)).sum() == pytest.approx(counts.sum())


def test_load_bound_counts_distinct_devices():
    # One expert with all rows, 4 devices: at best split over 4 devices -> max / mean = 1.
    counts = np.array([100.0, 0, 0, 0])
    assert cases.load_bound(counts, 4, 2) == 1.0
    # 2 devices, 1 slot each, 2 experts 90 / 10: no replica possible; bound 90 / 50.
    assert cases.load_bound(np.array([90.0, 10.0]), 2, 1) == pytest.approx(1.8)


def test_deepseek_v3_case_keeps_groups_on_their_nodes(capsys):
    # E=256 in 8 groups on 4 and 8 nodes: 1 node per group is the least (2 groups per node, or
    # 1). With groups kept whole, every group is on 1 node and max / mean lies within 1% of
    # the groups bound (the busiest node's groups, spread evenly over its 8 devices); the
    # planner spreads a group only when the modeled step falls, and beats the group-blind plan.
    result = cases.deepseek_case()
    rows = {(r["config"], r["layer"], r["layout"]): r for r in result["rows"]}
    configs = {(r["config"], r["layer"]) for r in result["rows"]}
    assert len(configs) == 4
    for key in configs:
        static, blind = rows[key + ("static",)], rows[key + ("plan",)]
        whole, planned = rows[key + ("whole",)], rows[key + ("plan_groups",)]
        assert whole["nodes_min"] == 1
        assert whole["nodes_max"] == 1 and static["nodes_max"] == 1, key
        assert whole["group_bound"] <= whole["imbalance"] <= 1.01 * whole["group_bound"], key
        assert blind["nodes_mean"] > 3, key  # the group-blind plan spreads every group
        assert planned["step_ms"] <= whole["step_ms"] * (1 + 1e-12), key
        if planned["nodes_max"] > 1:
            assert planned["step_ms"] < whole["step_ms"], key
        assert planned["step_ms"] < min(static["step_ms"], blind["step_ms"]), key
        assert planned["copies_per_token"] < blind["copies_per_token"], key
    cli.print_deepseek(result)
    out = capsys.readouterr().out
    assert "hardware: HardwareModel(name='h100-ib'" in out and "num_groups=8" in out
    assert "| config | layer | layout | max/mean | nodes/group |" in out


def test_help_names_the_workload_and_hardware_modeled(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert repr(Workload()) in out and repr(cases.DEEPSEEK_V3) in out
    for hw in cli.HARDWARE.values():
        assert repr(hw) in out
    assert cli._models_line(H100_IB, Workload()).startswith("modeling hardware: ")
