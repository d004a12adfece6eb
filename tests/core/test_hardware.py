"""The device table (`moejax.hardware`) and the views the models build from it."""

import dataclasses

import pytest

from moejax import hardware, placement
from moejax.aot import fit, schedule


def test_table_holds_the_datasheet_figures():
    h100, h200 = hardware.H100_SXM, hardware.H200_SXM
    assert h100.peak("bf16") == h200.peak("bf16") == 989e12  # same GH100 compute
    assert h100.peak("f8") == 1979e12 and h100.peak("f32") == 494.7e12  # dense, not 2:4 sparse
    assert (h100.hbm_bytes_per_s, h200.hbm_bytes_per_s) == (3.35e12, 4.8e12)
    assert h100.hbm_bytes < 80 * 2**30 < h200.hbm_bytes
    assert (h100.link_bytes_per_s, h100.node_size, h100.network_bytes_per_s) == (450e9, 8, 50e9)
    bf16 = {k: d.peak("bf16") for k, d in hardware.DEVICES.items() if d.platform == "tpu"}
    assert bf16 == {"v5e": 197e12, "v5p": 459e12, "v6e": 918e12}
    links = {k: d.link_bytes_per_s for k, d in hardware.DEVICES.items() if d.platform == "tpu"}
    assert links == {"v5e": 400e9 / 2, "v5p": 1200e9 / 2, "v6e": 800e9 / 2}  # bidirectional / 2
    assert hardware.TPU_V5E.peak("f16") == 197e12 / 6  # a dtype not listed: the slowest rate


def test_every_view_reads_the_table():
    h100, v5p = hardware.H100_SXM, hardware.TPU_V5P
    # Placement cost model: flat NVLink, nodes over InfiniBand, flat ICI.
    assert placement.H100_NVLINK.flops_per_s == h100.peak("bf16")
    assert placement.H100_NVLINK.link_bytes_per_s == h100.link_bytes_per_s
    ib = placement.H100_IB
    assert (ib.link_bytes_per_s, ib.devices_per_node, ib.node_link_bytes_per_s) == (
        h100.network_bytes_per_s,
        h100.node_size,
        h100.link_bytes_per_s,
    )
    assert placement.TPU_V5P_ICI.flops_per_s == v5p.peak("bf16")
    # Schedule model: every device, all rates and links.
    for key, device in hardware.DEVICES.items():
        view = schedule.HARDWARE[key]
        fields = ("flops_per_s", "hbm_bytes_per_s", "link_bytes_per_s", "node_size")
        assert all(getattr(view, f) == getattr(device, f) for f in fields), key
    # Fit planner: HBM and bf16 peak.
    for target in fit.TARGETS.values():
        assert target.device in (h100, v5p)
        assert target.hbm_bytes == target.device.hbm_bytes
        assert target.peak_flops == target.device.peak("bf16")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(platform="rocm"), "platform must be"),
        (dict(flops_per_s=()), "flops_per_s must be non-empty"),
        (dict(flops_per_s=(("bf16", 0.0),)), "flops_per_s must be non-empty and > 0"),
        (dict(flops_per_s=(("fp4", 1.0),)), r"flops_per_s keys must be in .*'fp4'"),
        (dict(hbm_bytes=0), "hbm_bytes must be > 0, got 0"),
        (dict(link_bytes_per_s=-1.0), "link_bytes_per_s must be > 0"),
        (dict(node_size=-1), "node_size must be >= 0"),
        (dict(network_bytes_per_s=0.0), "network_bytes_per_s must be > 0 when node_size > 0"),
    ],
)
def test_device_is_validated(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(hardware.H100_SXM, **change)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(flops_per_s=()), "flops_per_s must be non-empty"),
        (dict(hbm_bytes_per_s=0.0), "hbm_bytes_per_s must be > 0, got 0.0"),
        (dict(node_size=-1), "node_size must be >= 0"),
        (dict(network_bytes_per_s=0.0), "network_bytes_per_s must be > 0 when node_size > 0"),
    ],
)
def test_the_schedule_models_view_is_validated_as_the_device_is(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(schedule.H100_SXM, **change)
    dataclasses.replace(schedule.H100_SXM, node_size=0, network_bytes_per_s=0.0)  # one network
