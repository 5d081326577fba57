"""Presets, plan text round trips, strategy knees, and that the pure packages never import torch."""


import pytest
from hypothesis import given
from hypothesis import strategies as st

from bagualu2.costmodel import OP_KINDS, Plan, Strategy, fit_knee, knee, num_parameters, presets
from bagualu2.costmodel.strategy import calibrate

TABLE_II_TOTALS_B = {"glm-188b-a20b": (188, 20), "glm-319b-a30b": (319, 30), "glm-423b-a30b": (423, 30),
                     "glm-629b-a30b": (629, 30), "glm-783b-a35b": (783, 35), "glm-835b-a30b": (835, 30),
                     "glm-1041b-a35b": (1041, 35), "glm-1041b-a35b-12k": (1041, 35)}
TABLE_II_GPUS = {"glm-188b-a20b": 128, "glm-319b-a30b": 256, "glm-423b-a30b": 512, "glm-629b-a30b": 1024,
                 "glm-783b-a35b": 2048, "glm-835b-a30b": 4096, "glm-1041b-a35b": 8192, "glm-1041b-a35b-12k": 12288}


def test_preset_names():
    assert set(TABLE_II_TOTALS_B) | {"tiny-dense", "tiny-moe"} == set(presets.model_names())
    assert {"paper-gpu", "h100", "h200", "cpu"} == set(presets.hardware_names())


@pytest.mark.parametrize("name", sorted(TABLE_II_TOTALS_B))
def test_table_ii_parameter_counts_match_names(name):
    model, parallel = presets.model(name)
    total, active = num_parameters(model)
    expected_total, expected_active = TABLE_II_TOTALS_B[name]
    assert total / 1e9 == pytest.approx(expected_total, rel=0.01)
    assert active / 1e9 == pytest.approx(expected_active, rel=0.03)
    assert parallel.world_size == TABLE_II_GPUS[name]


keys = st.one_of(st.sampled_from(OP_KINDS),
                 st.builds(lambda a, b: f"L{a}.{b}/L{a}.t{b}", st.integers(0, 99), st.sampled_from(OP_KINDS)))


@given(st.dictionaries(keys, st.sampled_from(list(Strategy)), max_size=12))
def test_plan_text_round_trip(entries):
    plan = Plan.of(entries)
    assert Plan.from_str(repr(plan)) == plan
    assert Plan.from_str(str(plan)) == plan


@pytest.mark.parametrize("text", ["foo=BAR", "core_attn", "core_attn=X", "a/b/c=R", "qkv=R,qkv=O"])
def test_bad_plan_text(text):
    with pytest.raises(ValueError):
        Plan.from_str(text)


def test_knees_and_fit():
    hw = presets.hardware("paper-gpu")
    off = knee(Strategy.OFFLOAD, hw)
    assert off.peak_bytes_per_s == pytest.approx(hw.d2h_bytes_per_s / 2)
    q = knee(Strategy.QUANTIZE, hw)
    # bandwidth is launch-bound below the knee and saturates above it
    assert off.bandwidth(off.knee_bytes / 100) < 0.02 * off.peak_bytes_per_s
    assert off.bandwidth(off.knee_bytes * 100) > 0.98 * off.peak_bytes_per_s
    sizes = [2**k for k in range(10, 30)]
    fitted = fit_knee(sizes, [off.overhead_s(s) for s in sizes])
    assert fitted.knee_bytes == pytest.approx(off.knee_bytes, rel=1e-6)
    assert fitted.peak_bytes_per_s == pytest.approx(off.peak_bytes_per_s, rel=1e-9)
    slower = calibrate(hw, Strategy.OFFLOAD, type(off)(off.knee_bytes, off.peak_bytes_per_s / 2))
    assert knee(Strategy.OFFLOAD, slower).peak_bytes_per_s == pytest.approx(off.peak_bytes_per_s / 2)
    assert knee(Strategy.QUANTIZE, calibrate(hw, Strategy.QUANTIZE, q)).peak_bytes_per_s == pytest.approx(
        q.peak_bytes_per_s)
    with pytest.raises(ValueError):
        fit_knee([1, 1], [1, 2])


PURE = ["bagualu2.costmodel", "bagualu2.budget", "bagualu2.mitigation", "bagualu2.fusion", "bagualu2.runtime",
        "bagualu2.sim"]


def test_calibrate_quantize_round_trips_for_fp32():
    hw = presets.hardware("h100")
    q = knee(Strategy.QUANTIZE, hw, dtype="fp32")
    again = calibrate(hw, Strategy.QUANTIZE, q, dtype="fp32")
    assert knee(Strategy.QUANTIZE, again, dtype="fp32").peak_bytes_per_s == pytest.approx(q.peak_bytes_per_s)
    assert again.hbm_bytes_per_s == pytest.approx(hw.hbm_bytes_per_s)
    with pytest.raises(ValueError, match="dtype"):
        calibrate(hw, Strategy.QUANTIZE, q, dtype="fp8")
