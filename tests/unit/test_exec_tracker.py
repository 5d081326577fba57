"""ActivationTracker on real autograd: storage-deduplicated saved bytes, parameters excluded, the CPU cap."""

import pytest
import torch

from bagualu2.exec import ActivationOutOfMemoryError, ActivationTracker


def _mlp(width=64):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))


def test_counts_what_autograd_saves_once_per_storage():
    model = _mlp()
    tracker = ActivationTracker(exclude=[model])
    x = torch.randn(8, 64, requires_grad=True)
    with tracker.micro_batch("mb0"):
        out = model(x)
    # Linear1 keeps x, GELU keeps its input, Linear2 keeps GELU's output (fp32): weights are parameters
    assert tracker.kept_bytes("mb0") == 4 * (8 * 64 + 8 * 256 + 8 * 256)
    out.sum().backward()
    assert tracker.release("mb0") == 4 * (8 * 64 + 2 * 8 * 256)
    assert tracker.in_flight_bytes == 0


def test_views_and_shared_consumers_count_once():
    tracker = ActivationTracker()
    x = torch.randn(16, 32, requires_grad=True)
    with tracker.micro_batch("a"):
        y = x * 2  # saves nothing of x (scalar multiply)
        z = (y.sin() + y.view(32, 16).cos().view(16, 32)).sum()  # sin and cos both keep (views of) y
    assert tracker.kept_bytes("a") == y.numel() * 4
    z.backward()


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(64))

    def forward(self, x):
        return x * self.scale  # saves the buffer (the gradient of x needs it)


def test_parameters_never_counted_buffers_unless_excluded():
    model = _mlp()
    x = torch.randn(4, 64, requires_grad=True)
    plain, excluded = ActivationTracker(), ActivationTracker(exclude=[model])
    for tracker in (plain, excluded):
        with tracker.micro_batch("m"):
            model(x).sum()
    assert plain.kept_bytes("m") == excluded.kept_bytes("m")  # a parameter (or a view of one) is not an activation
    scaled = _Scaled()
    plain, excluded = ActivationTracker(), ActivationTracker(exclude=[scaled])
    for tracker in (plain, excluded):
        with tracker.micro_batch("m"):
            scaled(x).sum()
    assert plain.kept_bytes("m") == excluded.kept_bytes("m") + scaled.scale.untyped_storage().nbytes()


def test_cap_raises_an_out_of_memory_error():
    model = _mlp()
    x = torch.randn(8, 64)
    tracker = ActivationTracker(cap_bytes=4 * (8 * 64 + 8 * 256 + 8 * 256), exclude=[model])
    with tracker.micro_batch("first"):
        model(x).sum()
    with pytest.raises(torch.OutOfMemoryError) as caught, tracker.micro_batch("second"):
        model(x).sum()
    assert isinstance(caught.value, ActivationOutOfMemoryError) and "cap" in str(caught.value)
    assert tracker.in_flight_bytes == tracker.kept_bytes("first")  # the failed micro-batch is not in flight
    tracker.release("first")
    with tracker.micro_batch("third"):  # fits again once the first one is released
        model(x).sum()


def test_bad_use_raises_value_error():
    with pytest.raises(ValueError, match="cap_bytes"):
        ActivationTracker(cap_bytes=-1)
    tracker = ActivationTracker()
    with pytest.raises(ValueError, match="not in flight"):
        tracker.kept_bytes("x")
    with tracker.micro_batch("x"):
        with pytest.raises(ValueError, match="already in flight"):
            with tracker.micro_batch("x"):
                pass
