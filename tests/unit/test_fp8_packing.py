"""FP8 copies of saved tensors (``exec.packing.quantize_fp8`` / ``dequantize_fp8``): finite values within e4m3's
precision of one per-tensor scale, infinities exact (an additive attention mask is -inf where it masks)."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from bagualu2.exec.packing import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8

values = st.one_of(st.floats(-1e6, 1e6, allow_nan=False, width=32), st.sampled_from([math.inf, -math.inf, 0.0]))


def roundtrip(x: torch.Tensor) -> torch.Tensor:
    data, scale = quantize_fp8(x.flatten())
    assert data.dtype is FP8_DTYPE and data.numel() == x.numel() and scale.dtype is torch.float32
    return dequantize_fp8(data, scale, x.dtype).view(x.shape)


@given(st.lists(values, max_size=64), st.sampled_from([torch.float32, torch.bfloat16]))
def test_infinities_exact_and_finite_values_within_e4m3_precision(items, dtype):
    x = torch.tensor(items, dtype=torch.float32).to(dtype)
    back = roundtrip(x)
    assert back.dtype is dtype
    infinite = torch.isinf(x)
    assert torch.equal(torch.isinf(back), infinite) and torch.equal(back[infinite], x[infinite])
    finite = x[~infinite].float()
    if finite.numel():
        amax = float(finite.abs().max())
        # e4m3: 3 mantissa bits (relative error <= 2**-4), subnormals below 2**-6 of the scale (step 2**-9 of it);
        # bf16 rounding of the result adds its own 2**-8
        bound = finite.abs() * (2 ** -4 + 2 ** -8) + amax / FP8_MAX * 2 ** -9 + 1e-30
        assert bool(((back[~infinite].float() - finite).abs() <= bound).all())


def test_a_causal_mask_is_stored_exactly():
    mask = torch.zeros(8, 8).masked_fill_(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.equal(roundtrip(mask), mask)
    scores = torch.randn(8, 8)
    assert torch.equal(torch.softmax(scores + roundtrip(mask), -1), torch.softmax(scores + mask, -1))


def test_nan_stays_non_finite_and_empty_and_zero_tensors_round_trip():
    back = roundtrip(torch.tensor([1.0, float("nan"), -2.0]))
    assert not math.isfinite(float(back[1])) and float(back[0]) == 1.0 and float(back[2]) == -2.0
    assert roundtrip(torch.empty(0)).numel() == 0
    assert torch.equal(roundtrip(torch.zeros(5)), torch.zeros(5))
    data, scale = quantize_fp8(torch.full((3,), float("inf")))
    assert float(scale) == 1.0
    assert torch.equal(dequantize_fp8(data, scale, torch.float32), torch.full((3,), float("inf")))


def test_subnormal_values_keep_a_finite_scale():
    x = torch.tensor([1e-44, 0.0, -1e-44])
    back = roundtrip(x)
    assert bool(torch.isfinite(back).all()) and float(back[1]) == 0.0
