"""Named models (the paper's Table II plus two tiny test models) and hardware profiles.

Table II gives hidden size, expert width, experts, top-k, head dim and DP/TP/EP/PP/VP; all models have 32
layers and 4,096-token sequences (§VI). The rest follows GLM-4.5: ``a = h / d`` query heads, 8 query groups,
one shared expert, no leading dense layer, a 151,552-token vocabulary, RMSNorm, SwiGLU, flash attention,
bf16, micro-batch 1, sequence parallelism and the distributed optimizer. With these, the parameter counts come
out at the names' totals (e.g. 423B total / 30B active). Table II's VP is the number of layers per virtual
pipeline stage (§VI-A; Megatron's ``--num-layers-per-virtual-pipeline-stage``), so a stage holds
``32 / (PP x VP)`` virtual chunks: ``ParallelConfig.vp``, Megatron's number of virtual chunks per stage.
``num_microbatches`` (not in the paper) is set to 64. The layouts are ``paired``: one more warmup forward than
Megatron's 1F1B, so that every steady scheduling point F_x B_y pairs two independent micro-batches. §V-B's scheduling
points need it (``x - y > 2`` holds exactly when the pipeline degree exceeds two, i.e. ``x - y = pp`` on the first
stage), and Megatron-Core's combined 1F1B adds the same forward (``--overlap-moe-expert-parallel-comm``).

The GPU profiles carry ``link_efficiency`` 0.86 (DeepEP's normal all-to-all kernels on H800 with CX7 400 Gb/s
InfiniBand reach 43 GB/s of the NIC's ~50 GB/s at EP16: github.com/deepseek-ai/DeepEP, V1 performance table)
and ``reserved_bytes`` 4 GiB (``RESERVED_BYTES``: 1 GiB for the CUDA context and the cuBLAS / NCCL workspaces,
2 GiB of expert-parallel communication buffers — DeepEP's examples allocate 1 GB of NVLink and 1 GB of RDMA
buffer — and 1 GiB of allocator fragmentation, an estimate). Their kernel efficiencies were measured on an H200
(``benchmarks/gpu/kernel_constants.py``, docs/benchmarks.md) at one tensor-parallel rank's shapes of
``glm-423b-a30b``: ``matmul_efficiency`` 0.72, the GEMMs of a layer (qkv, attention output, experts, shared
expert) weighted by their FLOPs, forward 0.714 and backward 0.720 of the 989 TFLOP/s datasheet peak;
``attention_efficiency`` 0.40, causal cuDNN attention (PyTorch's choice for bf16 on Hopper), forward at 0.46 and
backward (2.5 x the forward's FLOPs) at 0.375, weighted by their FLOPs. The paper's GPU is taken to reach the same
fractions of its own peak (an assumption: the paper gives no kernel efficiency).
"""

from __future__ import annotations

import dataclasses

from .config import Hardware, ModelConfig, ParallelConfig, check_compatible
from .validate import load_json

GIB = 1 << 30
TABLE_II_LAYERS = 32
RESERVED_BYTES = 4 * GIB  # CUDA context and workspaces 1 GiB + EP buffers 2 GiB + fragmentation 1 GiB
LINK_EFFICIENCY = 0.86    # DeepEP all-to-all: 43 of ~50 GB/s per 400 Gb/s NIC
MATMUL_EFFICIENCY = 0.72     # measured: a glm-423b-a30b layer's GEMMs on an H200, FLOP-weighted (0.714 / 0.720)
ATTENTION_EFFICIENCY = 0.40  # measured: its causal attention (cuDNN), forward and backward, FLOP-weighted

# name: (hidden, moe_hidden, experts, top_k, head_dim, gpus, dp, tp, ep, pp, VP = layers per virtual stage)
_TABLE_II = {
    "glm-188b-a20b": (7168, 4096, 64, 4, 112, 128, 16, 2, 32, 4, 2),
    "glm-319b-a30b": (8192, 4096, 96, 6, 128, 256, 16, 2, 32, 8, 1),
    "glm-423b-a30b": (8192, 4096, 128, 6, 128, 512, 32, 2, 64, 8, 2),
    "glm-629b-a30b": (8192, 4096, 192, 6, 128, 1024, 64, 2, 64, 8, 2),
    "glm-783b-a35b": (8192, 5120, 192, 6, 128, 2048, 128, 2, 64, 8, 1),
    "glm-835b-a30b": (8192, 4096, 256, 6, 128, 4096, 256, 2, 128, 8, 2),
    "glm-1041b-a35b": (8192, 5120, 256, 6, 128, 8192, 512, 2, 128, 8, 2),
    "glm-1041b-a35b-12k": (8192, 5120, 256, 6, 128, 12288, 768, 2, 128, 8, 2),
}


def _table_ii(name: str) -> tuple[ModelConfig, ParallelConfig]:
    hidden, moe_hidden, experts, top_k, head_dim, gpus, dp, tp, ep, pp, layers_per_virtual_stage = _TABLE_II[name]
    vp = TABLE_II_LAYERS // (pp * layers_per_virtual_stage)  # virtual chunks per stage
    model = ModelConfig(num_layers=TABLE_II_LAYERS, hidden_size=hidden, num_attention_heads=hidden // head_dim,
                        num_query_groups=8, head_dim=head_dim, ffn_hidden_size=4 * hidden,
                        moe_ffn_hidden_size=moe_hidden, num_experts=experts, top_k=top_k, num_shared_experts=1,
                        num_dense_layers=0, vocab_size=151552, seq_length=4096, micro_batch_size=1)
    parallel = ParallelConfig(dp=dp, tp=tp, ep=ep, pp=pp, vp=vp, sequence_parallel=True, num_microbatches=64,
                              distributed_optimizer=True, paired=True)
    assert parallel.world_size == gpus, name
    return model, parallel


def _tiny(name: str) -> tuple[ModelConfig, ParallelConfig]:
    if name == "tiny-dense":
        model = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=16,
                            ffn_hidden_size=192, vocab_size=512, seq_length=64, micro_batch_size=2,
                            dtype="fp32")
    else:
        model = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=16,
                            ffn_hidden_size=192, moe_ffn_hidden_size=32, num_experts=8, top_k=2,
                            num_shared_experts=1, num_dense_layers=1, vocab_size=512, seq_length=64,
                            micro_batch_size=2, dtype="fp32")
    return model, ParallelConfig(pp=2, num_microbatches=4)


_MODELS = {**{name: _table_ii for name in _TABLE_II}, "tiny-dense": _tiny, "tiny-moe": _tiny}

_HARDWARE = {
    # §VI-A: 480 TFLOP/s bf16, 64 GB HBM, 8 GPUs/node, 400 GB/s intra-node, 4 x 400 Gb/s = 200 GB/s per node.
    "paper-gpu": Hardware(name="paper-gpu", peak_flops=480e12, hbm_bytes=64 * GIB, hbm_bytes_per_s=1.6e12,
                          h2d_bytes_per_s=25e9, d2h_bytes_per_s=25e9, intra_node_bytes_per_s=400e9,
                          inter_node_bytes_per_s=200e9 / 8, devices_per_node=8, kernel_launch_s=5e-6,
                          matmul_efficiency=MATMUL_EFFICIENCY, attention_efficiency=ATTENTION_EFFICIENCY,
                          link_efficiency=LINK_EFFICIENCY, reserved_bytes=RESERVED_BYTES),
    # H100 SXM: 989 TFLOP/s dense bf16, 80 GiB HBM3 at 3.35 TB/s, PCIe Gen5, NVLink 450 GB/s per direction,
    # 8 x 400 Gb/s InfiniBand per node.
    "h100": Hardware(name="h100", peak_flops=989e12, hbm_bytes=80 * GIB, hbm_bytes_per_s=3.35e12,
                     h2d_bytes_per_s=50e9, d2h_bytes_per_s=50e9, intra_node_bytes_per_s=450e9,
                     inter_node_bytes_per_s=50e9, devices_per_node=8, kernel_launch_s=4e-6,
                     matmul_efficiency=MATMUL_EFFICIENCY, attention_efficiency=ATTENTION_EFFICIENCY,
                     link_efficiency=LINK_EFFICIENCY, reserved_bytes=RESERVED_BYTES),
    # H200: same compute as H100, HBM3e at 4.8 TB/s; the datasheet's "141 GB" is the device memory CUDA reports,
    # 150,109,880,320 bytes (139.8 GiB; torch.cuda.mem_get_info, benchmarks/gpu/results/h200)
    "h200": Hardware(name="h200", peak_flops=989e12, hbm_bytes=150_109_880_320, hbm_bytes_per_s=4.8e12,
                     h2d_bytes_per_s=50e9, d2h_bytes_per_s=50e9, intra_node_bytes_per_s=450e9,
                     inter_node_bytes_per_s=50e9, devices_per_node=8, kernel_launch_s=4e-6,
                     matmul_efficiency=MATMUL_EFFICIENCY, attention_efficiency=ATTENTION_EFFICIENCY,
                     link_efficiency=LINK_EFFICIENCY, reserved_bytes=RESERVED_BYTES),
    # A small CPU "device" for tests and the demo: memory copies stand in for the PCIe link.
    "cpu": Hardware(name="cpu", peak_flops=2e11, hbm_bytes=4 * GIB, hbm_bytes_per_s=2e10,
                    h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10, intra_node_bytes_per_s=5e9,
                    inter_node_bytes_per_s=1e9, devices_per_node=64, kernel_launch_s=1e-6,
                    matmul_efficiency=0.5),
}


def model_names() -> tuple[str, ...]:
    return tuple(_MODELS)


def hardware_names() -> tuple[str, ...]:
    return tuple(_HARDWARE)


def model(name: str) -> tuple[ModelConfig, ParallelConfig]:
    """``(ModelConfig, ParallelConfig)`` of preset ``name``; ``ValueError`` listing the valid names otherwise."""
    key = name.lower() if isinstance(name, str) else None
    if key not in _MODELS:
        raise ValueError(f"unknown model preset {name!r}; valid: {', '.join(_MODELS)}")
    model_config, parallel = _MODELS[key](key)
    check_compatible(model_config, parallel)
    return model_config, parallel


def hardware(name: str) -> Hardware:
    """Hardware profile ``name``; ``ValueError`` listing the valid names otherwise."""
    key = name.lower() if isinstance(name, str) else None
    if key not in _HARDWARE:
        raise ValueError(f"unknown hardware preset {name!r}; valid: {', '.join(_HARDWARE)}")
    return _HARDWARE[key]


def model_from_json(text: str) -> tuple[ModelConfig, ParallelConfig]:
    """``(ModelConfig, ParallelConfig)`` from JSON ``{"model": {ModelConfig fields}, "parallel": {ParallelConfig
    fields}}`` (``parallel`` optional: one device); ``ValueError`` in one line naming the bad field otherwise."""
    data = load_json(text, "model JSON", 'expected {"model": {...}, "parallel": {...}}')
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict) \
            or not isinstance(data.get("parallel", {}), dict) or set(data) - {"model", "parallel"}:
        raise ValueError('model JSON must be {"model": {ModelConfig fields}, "parallel": {ParallelConfig fields}}')
    configs = []
    for cls, section in ((ModelConfig, data["model"]), (ParallelConfig, data.get("parallel", {}))):
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(section) - fields)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} field(s) {', '.join(map(str, unknown))[:200]}; "
                             f"allowed: {', '.join(sorted(fields))}")
        missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in section
                         and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        if missing:
            raise ValueError(f"missing {cls.__name__} field(s): {', '.join(missing)}")
        integral = {f.name for f in dataclasses.fields(cls) if f.type == "int"}
        section = {name: int(value) if name in integral and isinstance(value, float) and value.is_integer() else value
                   for name, value in section.items()}  # JSON may write 64 as 64.0 or 6.4e1, as a hardware file may
        try:
            configs.append(cls(**section))
        except TypeError as exc:  # never expected with the checks above: keep it one line
            raise ValueError(f"invalid {cls.__name__}: {exc}") from None
    model_config, parallel = configs
    check_compatible(model_config, parallel)
    return model_config, parallel

