"""Tracing overhead of a model instrumented from outside: ``trace_graph`` (one recorded forward + backward) against
one plain forward + backward of the same 2-layer stock-module MoE decoder (``tests/byom_model.py``), measured in
the same run. Target: tracing adds under 2x the plain step, i.e. trace / plain < 3.

    python -m pytest benchmarks/bench_instrument.py --benchmark-only
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bagualu2.costmodel import presets  # noqa: E402
from bagualu2.exec import instrument  # noqa: E402
from byom_model import OP_MAP, StockConfig, make  # noqa: E402

CONFIG = StockConfig(hidden=256, heads=8, kv_heads=4, ffn=512, expert_ffn=256, num_experts=8, top_k=2,
                     num_layers=2, seq=256)
HW = presets.hardware("cpu")


def _plain(model, x):
    model(x).float().sum().backward()


def _best(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def test_plain_step(benchmark):
    model, x = make(CONFIG, batch=4)
    benchmark(_plain, model, x)


def test_trace_graph(benchmark):
    model, x = make(CONFIG, batch=4)
    instrumented = instrument(model, OP_MAP)
    graph = benchmark(lambda: instrumented.trace_graph(x, hardware=HW))
    assert graph.unmitigated_bytes > 0


def test_tracing_adds_under_twice_a_plain_step():
    """The ratio, both measured here (best of 5, interleaved, after a warm-up): trace / plain - 1 < 2."""
    model, x = make(CONFIG, batch=4)
    instrumented = instrument(model, OP_MAP)
    _plain(model, x)
    instrumented.trace_graph(x, hardware=HW)
    plain = traced = float("inf")
    for _ in range(5):  # interleaved, best of 5 each: both see the same machine load
        plain = min(plain, _best(lambda: _plain(model, x), repeat=1))
        traced = min(traced, _best(lambda: instrumented.trace_graph(x, hardware=HW), repeat=1))
    added = traced / plain - 1
    print(f"plain forward+backward {plain * 1e3:.1f} ms, trace_graph {traced * 1e3:.1f} ms: adds {added:.2f}x")
    assert added < 2, added
