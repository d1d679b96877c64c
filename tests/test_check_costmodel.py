"""scripts/check_costmodel.py's calibration arithmetic, on hand-made measurements (its runs on the emulated
cluster are the bandwidth study's; tests/test_bandwidth_study.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import check_costmodel  # noqa: E402

# per core: 1 ms a message, a stack of 1 GB/s, a combine of 10 GB/s; hosts at half a core
FIGURES = {"inter_latency_s": 1e-3, "inter_stack_gbyte_per_s": 1.0, "reduce_gbyte_per_s": 10.0}
CPU, N, NBYTES = 0.5, 4, 1e7


def test_the_switch_is_the_time_an_exchange_took_beyond_its_message_cost_and_combine():
    # one-peer exchange on 4 unshaped hosts: 1 ms, the stack's 2 x 10 MB at 0.5 GB/s (40 ms) or the switch's
    # 4 x 10 MB, then the combine of 2 vectors at 5 GB/s (4 ms); 85 ms measured leaves the switch 80 ms
    switch = check_costmodel.switch_figure(FIGURES, 0.085, N, NBYTES, CPU)
    assert switch == pytest.approx(4 * NBYTES / 0.080 / 1e9)
    cluster = check_costmodel.model_cluster({**FIGURES, "switch_gbyte_per_s": switch}, "none", CPU)
    assert check_costmodel.modeled(cluster, "neighbor_one_peer_exp2", N, NBYTES) == pytest.approx(0.085)


def test_an_exchange_no_slower_than_its_stack_leaves_the_switch_unlimited():
    assert check_costmodel.switch_figure(FIGURES, 0.045, N, NBYTES, CPU) == 0.0  # exactly the stack's price
    cluster = check_costmodel.model_cluster({**FIGURES, "switch_gbyte_per_s": 0.0}, "none", CPU)
    assert cluster.switch_bytes_per_s == float("inf")


def test_a_calibration_is_a_line_through_the_transfers_per_core():
    # transfers of 2 ms + bytes moved / 0.4 GB/s, at 0.4 cores: the stack is 1 GB/s per core; the combine of the
    # largest size (2 x 4 bytes x 4M floats in 10 ms) 3.36 GB/s at 0.4 cores, 8.4 per core
    sizes = {str(f): {"transfer_s": 2e-3 + 2 * 4 * f / 4e8, "combine_s": 0.01} for f in (1 << 19, 1 << 21, 1 << 22)}
    figures = check_costmodel.calibrated_figures({"one_float_s": 5e-4, "sizes": sizes}, 0.4)
    assert figures["inter_latency_s"] == pytest.approx(2e-3)
    assert figures["inter_stack_gbyte_per_s"] == pytest.approx(1.0)
    assert figures["reduce_gbyte_per_s"] == pytest.approx(2 * 4 * (1 << 22) / 0.01 / 0.4 / 1e9)


def test_the_calibrations_ends_are_the_same_lines_through_its_intervals_ends():
    # each size's interval: transfers of 1 ms + bytes / 0.8 GB/s at the fast end, 3 ms + bytes / 0.2 GB/s at the
    # slow end, at 0.4 cores (stacks of 2 and 0.5 GB/s per core); combines of 5 and 20 ms at the largest size
    sizes = {str(f): {"transfer_s": 2e-3 + 2 * 4 * f / 4e8, "combine_s": 0.01,
                      "transfer_s_low": 1e-3 + 2 * 4 * f / 8e8, "combine_s_low": 0.005,
                      "transfer_s_high": 3e-3 + 2 * 4 * f / 2e8, "combine_s_high": 0.02}
             for f in (1 << 19, 1 << 21, 1 << 22)}
    cal = {"one_float_s": 5e-4, "sizes": sizes}
    fast, slow = (check_costmodel.calibrated_figures(cal, 0.4, check_costmodel.ENDS[end]) for end in ("fast", "slow"))
    assert (fast["inter_latency_s"], slow["inter_latency_s"]) == (pytest.approx(1e-3), pytest.approx(3e-3))
    assert (fast["inter_stack_gbyte_per_s"], slow["inter_stack_gbyte_per_s"]) == (pytest.approx(2.0),
                                                                                pytest.approx(0.5))
    largest = 2 * 4 * (1 << 22) / 0.4 / 1e9
    assert (fast["reduce_gbyte_per_s"], slow["reduce_gbyte_per_s"]) == (pytest.approx(largest / 0.005),
                                                                        pytest.approx(largest / 0.02))
