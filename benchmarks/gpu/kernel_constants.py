"""Measure, on a CUDA device, the kernel-level constants the simulator takes from datasheets and papers.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu/kernel_constants.py --out "$OUT"
    python benchmarks/gpu/kernel_constants.py --dry-run     # on CPU, tiny sizes: checks the script's own logic

Installs nothing, imports only torch. Writes ``kernel_constants.json`` under ``--out`` and prints a summary. The
shapes are one tensor-parallel rank's of ``glm-423b-a30b`` (Table II: hidden 8192, head dim 128, 64 query heads in 8
groups, expert width 4096, top-6 of 128 experts, TP 2 with sequence parallelism, EP 64, 4096-token sequences):

* ``gemm``: bf16 matrix products of every linear op (forward, and the backward's two products), achieved FLOP/s
  as a fraction of the datasheet's dense peak and of the large square product's rate (``matmul_efficiency``);
* ``attention``: causal attention (``scaled_dot_product_attention``, flash and cuDNN backends) forward and backward,
  achieved FLOP/s and the backward / forward time ratio (the cost model charges the backward 2.5 x the forward's
  FLOPs); k and v at the query heads' count: grouped queries change the memory traffic, not the FLOPs;
* ``elementwise``: a SwiGLU activation and a residual add, achieved bytes/s over the datasheet's HBM bandwidth;
* ``copies``: pinned host<->device copies, each direction alone and both at once (``h2d_bytes_per_s``);
* ``interference``: a GEMM loop and an element-wise loop alone and with both copy directions running beside them on
  side streams (the simulator takes copies to cost compute nothing);
* ``context``: device memory in use after CUDA's and cuBLAS's initialisation, outside PyTorch's allocator (part of
  ``reserved_bytes``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

DATASHEET = {"NVIDIA H200": (989e12, 4.8e12), "NVIDIA H100 80GB HBM3": (989e12, 3.35e12)}
H, D, HEADS, GROUPS, TP, S = 8192, 128, 64, 8, 2, 4096
EXPERT_WIDTH, TOP_K, EXPERTS, EP, VOCAB = 4096, 6, 128, 64, 151552


def linear_shapes(scale: int) -> dict[str, tuple[int, int, int, int]]:
    """name: (groups, tokens M, input K, output N) of one TP rank's linear ops; ``scale`` divides every size."""
    tokens, sp_tokens = S // scale, S // TP // scale
    h, heads, groups, d = H // scale, HEADS // TP, GROUPS // TP, D
    local_experts = EXPERTS // EP
    per_expert = sp_tokens * TOP_K // local_experts
    width = EXPERT_WIDTH // scale
    return {"qkv": (1, tokens, h, (heads + 2 * groups) * d // scale), "attn_out": (1, tokens, heads * d // scale, h),
            "expert_fc1": (local_experts, per_expert, h, 2 * width),
            "expert_fc2": (local_experts, per_expert, width, h),
            "shared_fc1": (1, tokens, h, 2 * width // TP), "shared_fc2": (1, tokens, width // TP, h),
            "lm_head": (1, tokens, h, VOCAB // TP // scale), "square": (1, h, h, h)}


class Timer:
    def __init__(self, device: str, repeats: int):
        self.device, self.repeats = device, repeats

    def __call__(self, fn, warmup: int = 2) -> float:
        """Median seconds of ``fn()`` over ``repeats`` runs after ``warmup``."""
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(self.repeats):
            if self.device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e-3)
            else:
                started = time.perf_counter()
                fn()
                times.append(time.perf_counter() - started)
        return statistics.median(times)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


def gemm(timer: Timer, device: str, scale: int, peak: float) -> dict:
    rows = {}
    for name, (groups, m, k, n) in linear_shapes(scale).items():
        x = torch.randn(groups, m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(groups, k, n, device=device, dtype=torch.bfloat16)
        dy = torch.randn(groups, m, n, device=device, dtype=torch.bfloat16)
        flops = 2 * groups * m * k * n
        fwd = timer(lambda: torch.bmm(x, w))
        bwd = timer(lambda: (torch.bmm(dy, w.transpose(1, 2)), torch.bmm(x.transpose(1, 2), dy)))
        rows[name] = {"groups": groups, "m": m, "k": k, "n": n, "forward_s": fwd, "backward_s": bwd,
                      "forward_flops_per_s": flops / fwd, "backward_flops_per_s": 2 * flops / bwd,
                      "forward_of_peak": flops / fwd / peak, "backward_of_peak": 2 * flops / bwd / peak}
        del x, w, dy
    square = rows["square"]["forward_flops_per_s"]
    for row in rows.values():
        row["forward_of_square"] = row["forward_flops_per_s"] / square
        row["backward_of_square"] = row["backward_flops_per_s"] / square
    return rows


def attention(timer: Timer, device: str, scale: int, peak: float) -> dict:
    """Per backend (CUDA: flash and cuDNN, PyTorch's first choice for bf16 on Hopper; CPU: math)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, s = HEADS // TP, S // scale
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION} if device == "cuda" \
        else {"math": SDPBackend.MATH}
    q, k, v = (torch.randn(1, heads, s, D, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    flops = 2 * 2 * s * s * heads * D // 2  # QK^T and PV, causal half (the cost model's attn_flops)
    rows = {}
    for name, backend in backends.items():
        with sdpa_kernel([backend]):
            fwd = timer(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            grad = torch.randn_like(out)
            bwd = timer(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
        rows[name] = {"heads": heads, "seq": s, "head_dim": D, "forward_s": fwd, "backward_s": bwd,
                      "forward_flops_per_s": flops / fwd, "forward_of_peak": flops / fwd / peak,
                      "backward_over_forward_time": bwd / fwd,
                      "backward_of_peak_at_2.5x_flops": 2.5 * flops / bwd / peak}
    return rows


def elementwise(timer: Timer, device: str, scale: int, hbm: float) -> dict:
    tokens = S // TP // scale * TOP_K // (EXPERTS // EP) * (EXPERTS // EP)
    width = EXPERT_WIDTH // scale
    fc1 = torch.randn(tokens, 2 * width, device=device, dtype=torch.bfloat16)
    x, y = (torch.randn(S // TP // scale, H // scale, device=device, dtype=torch.bfloat16) for _ in range(2))

    def swiglu():
        a, b = fc1.chunk(2, dim=-1)
        return torch.nn.functional.silu(a) * b
    rows = {}
    for name, fn, moved in (("swiglu", swiglu, fc1.nbytes * 3 // 2), ("residual_add", lambda: x + y, 3 * x.nbytes)):
        seconds = timer(fn)
        rows[name] = {"bytes": moved, "seconds": seconds, "bytes_per_s": moved / seconds,
                      "of_datasheet_hbm": moved / seconds / hbm}
    return rows


def copies(timer: Timer, device: str, nbytes: int) -> dict:
    pin = device == "cuda"
    host_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    host_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = timer(lambda: dev_dst.copy_(host_src, non_blocking=True))
    d2h = timer(lambda: host_dst.copy_(dev_src, non_blocking=True))
    if device == "cuda":
        up, down = torch.cuda.Stream(), torch.cuda.Stream()

        def both():
            current = torch.cuda.current_stream()
            up.wait_stream(current)
            down.wait_stream(current)
            with torch.cuda.stream(up):
                dev_dst.copy_(host_src, non_blocking=True)
            with torch.cuda.stream(down):
                host_dst.copy_(dev_src, non_blocking=True)
            current.wait_stream(up)
            current.wait_stream(down)
        together = timer(both)
    else:
        together = timer(lambda: (dev_dst.copy_(host_src), host_dst.copy_(dev_src)))
    return {"bytes": nbytes, "pinned": pin, "h2d_bytes_per_s": nbytes / h2d, "d2h_bytes_per_s": nbytes / d2h,
            "both_directions_each_bytes_per_s": nbytes / together}


def interference(timer: Timer, device: str, scale: int, nbytes: int, loops: int) -> dict:
    """Compute alone, then with a host->device and a device->host copy of ``nbytes`` each running beside it."""
    n = 8192 // scale
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    big = torch.randn(64 * 1024 * 1024 // scale ** 2, device=device, dtype=torch.bfloat16)
    host_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    host_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    dev_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    kernels = {"gemm": lambda: torch.mm(a, b), "elementwise": lambda: big.mul(1.0001)}
    rows = {}
    for name, kernel in kernels.items():
        alone = timer(lambda: [kernel() for _ in range(loops)])
        if device != "cuda":
            rows[name] = {"alone_s": alone, "with_copies_s": alone, "slowdown": 1.0}
            continue
        up, down = torch.cuda.Stream(), torch.cuda.Stream()
        compute_times = []
        for _ in range(timer.repeats):
            torch.cuda.synchronize()
            for stream, fn in ((up, lambda: dev_dst.copy_(host_src, non_blocking=True)),
                               (down, lambda: host_dst.copy_(dev_src, non_blocking=True))):
                with torch.cuda.stream(stream):
                    for _ in range(4):
                        fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(loops):
                kernel()
            end.record()
            torch.cuda.synchronize()
            compute_times.append(start.elapsed_time(end) * 1e-3)
        with_copies = statistics.median(compute_times)
        rows[name] = {"alone_s": alone, "with_copies_s": with_copies, "slowdown": with_copies / alone}
    return rows


def context(device: str) -> dict:
    if device != "cuda":
        return {}
    free0, total = torch.cuda.mem_get_info()
    x = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)
    (x @ x).sum().item()
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    outside = total - free1 - torch.cuda.memory_reserved()
    return {"total_bytes": total, "in_use_after_init_bytes": total - free0,
            "outside_allocator_after_cublas_bytes": outside}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--dry-run", action="store_true", help="run on CPU at 1/16 of every size (no GPU numbers)")
    args = parser.parse_args()
    if args.dry_run:
        device, scale, repeats, nbytes, loops = "cpu", 16, 2, 1 << 20, 2
    elif torch.cuda.is_available():
        device, scale, repeats, nbytes, loops = "cuda", 1, 10, 1 << 30, 40
    else:
        print("error: no CUDA device (this script is for a machine with a GPU; --dry-run runs it on CPU)",
              file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    peak, hbm = DATASHEET.get(name, (989e12, 3.35e12))
    if device == "cuda" and name not in DATASHEET:
        print(f"warning: no datasheet figures for {name!r}: fractions of peak use an H100's (989 TFLOP/s, "
              "3.35 TB/s)", file=sys.stderr)
    timer = Timer(device, repeats)
    result = {"device": name, "torch": torch.__version__, "datasheet_peak_flops": peak,
              "datasheet_hbm_bytes_per_s": hbm, "context": context(device)}
    for key, fn in (("gemm", lambda: gemm(timer, device, scale, peak)),
                    ("attention", lambda: attention(timer, device, scale, peak)),
                    ("elementwise", lambda: elementwise(timer, device, scale, hbm)),
                    ("copies", lambda: copies(timer, device, nbytes)),
                    ("interference", lambda: interference(timer, device, scale, nbytes, loops))):
        started = time.perf_counter()
        result[key] = fn()
        print(f"{key}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_constants.json").write_text(json.dumps(result, indent=1))
    print(f"device {name}, torch {torch.__version__}")
    for op, row in result["gemm"].items():
        print(f"gemm {op:11s} {row['groups']}x{row['m']}x{row['k']}x{row['n']}: forward "
              f"{row['forward_flops_per_s'] / 1e12:6.1f} TFLOP/s ({100 * row['forward_of_peak']:.0f}% of peak), "
              f"backward {row['backward_flops_per_s'] / 1e12:6.1f} ({100 * row['backward_of_peak']:.0f}%)")
    for backend, a in result["attention"].items():
        print(f"attention {backend}: forward {a['forward_flops_per_s'] / 1e12:.1f} TFLOP/s "
              f"({100 * a['forward_of_peak']:.0f}% of peak), backward/forward time "
              f"{a['backward_over_forward_time']:.2f}")
    for op, row in result["elementwise"].items():
        print(f"{op}: {row['bytes_per_s'] / 1e9:.0f} GB/s ({100 * row['of_datasheet_hbm']:.0f}% of datasheet HBM)")
    c = result["copies"]
    print(f"copies: h2d {c['h2d_bytes_per_s'] / 1e9:.1f} GB/s, d2h {c['d2h_bytes_per_s'] / 1e9:.1f} GB/s, both at "
          f"once {c['both_directions_each_bytes_per_s'] / 1e9:.1f} GB/s each")
    for op, row in result["interference"].items():
        print(f"interference {op}: {row['slowdown']:.3f}x with both copy directions beside it")
    if result["context"]:
        print(f"context: {result['context']['in_use_after_init_bytes'] / 2**20:.0f} MiB after init, "
              f"{result['context']['outside_allocator_after_cublas_bytes'] / 2**20:.0f} MiB outside the allocator "
              f"after a cuBLAS product")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
