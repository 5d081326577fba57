"""Recipes: plain functions returning a keyword-only, validated :class:`TrainConfig`; flags override fields.

    glm_moe_debug   CPU (gloo), 4 processes: 8 layers (pp*vp up to 8 stages), 8 experts top-2, 4,096-token BPE
                    vocabulary, fp32, 64-token sequences; the default layout PP=2 x DP=2 (EP=2).
    glm_moe_bench   CPU (gloo), 4 processes (PP=2 x DP=2, EP=2): a step dominated by matmuls and attention (hidden
                    384, 512-token sequences, 4 MoE layers of 8 experts top-4), so what a memory decision costs
                    shows in the step time; its cap lets ordinary micro-batches run unmitigated, spikes do not fit.
    glm_moe_small   one GPU: 8 layers, hidden 512, 16 experts top-2, 1,024-token sequences, bf16.
    glm_moe_multi   8 GPUs (PP=4 x DP=2, EP=2, VP=2): GLM-423B-A30B's shape (128 experts / top-6, head dim 128,
                    8 query groups, 1 shared expert) scaled down to hidden 1,024, 32 experts, top-6 — the same
                    experts-per-rank routing pattern on a node.

The activation capacity ``M_max`` per rank (``memory_cap_bytes``) defaults to ``memory_cap_fraction`` of what the
busiest stage would keep unmitigated at balanced load (the cost model's in-flight chunks x unmitigated chunk
bytes) or, with ``memory_cap_imbalance``, what it would keep unmitigated at that routing imbalance; never below
full recompute of every in-flight chunk (``bagualu2.costmodel``; see :func:`default_cap`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Callable

from bagualu2.costmodel import ModelConfig, ParallelConfig, build_graph, imbalance_limit, presets, stage_memory
from bagualu2.costmodel.validate import require_int, require_number

from .policies import POLICIES

SCHEDULES = ("runtime", "plain")
DEVICES = ("cpu", "cuda")
DOWNGRADES = ("graded", "paper")
NONFINITE = ("stop", "skip")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "k": 2**10, "m": 2**20, "g": 2**30}


def parse_bytes(text: str, option: str = "--memory-cap") -> int:
    """``48MiB``, ``1.5GiB``, ``500000`` -> bytes (an int > 0); ValueError naming ``option`` otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{option} must be a byte count with an optional unit (B, KiB, MiB, GiB, KB, MB, GB), "
                         f"e.g. 48MiB; got {text!r}")
    value = float(match.group(1)) * _UNITS[unit]
    if not 1 <= value < 2**62:
        raise ValueError(f"{option} must be between 1 byte and 4 EiB, got {text!r}")
    if _UNITS[unit] == 1 and value != int(value):
        raise ValueError(f"{option} must be a whole number of bytes (or a number with a unit, e.g. 1.5MiB), "
                         f"got {text!r}")
    return round(value)  # with a unit: the nearest byte


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run. Every field but ``model``, ``weight_decay`` and ``extra`` can be overridden by the flag of
    the same name (``--memory-cap`` for ``memory_cap_bytes``).

      model                 the GLM-MoE architecture (``bagualu2.costmodel.ModelConfig``).
      pp, dp, ep, vp        pipeline, data, expert (carved from dp) parallel degrees, virtual chunks per stage.
      num_microbatches      micro-batches per iteration per data-parallel replica (>= pp).
      steps                 optimizer steps to run (in total, counting a resumed run's earlier steps).
      lr, weight_decay      AdamW; ``warmup_steps`` linear warm-up of the learning rate.
      seed                  model initialisation, data order and spikes.
      schedule              ``runtime`` (generated action list, fused OVERLAP_F_B points; at pp = 1 under EP the
                            combined 1F1B: F_(i+1) fused with B_i) or ``plain`` (stock Schedule1F1B /
                            ScheduleInterleaved1F1B; at pp = 1 F_i then B_i; no fusion).
      paired                Megatron-Core's combined 1F1B (``--overlap-moe-expert-parallel-comm``): one more warmup
                            forward per stage (one more chunk in flight), so every steady point pairs a forward with
                            another micro-batch's backward, the last stage's too. None (default): on for ``runtime``
                            at pp = 1 under expert parallelism, off otherwise; True needs ``--schedule runtime`` and
                            ``ep >= 2``.
      policy                ``flexible`` (BaGuaLu-2 runtime provisioning), ``static-under``, ``static-over``, ``kwai``,
                            ``adapipe`` or ``ideal`` (:mod:`reference_trainer.policies`).
      prediction_scale      in (0, 1]: the flexible runtime plans as if the cost model's bytes were this share of
                            what they are (a deliberate misprediction that exercises the safety net; 1: exact).
      downgrade             after-gate decision: ``graded`` re-plan or the paper's full MoE downgrade.
      memory_cap_bytes      activation capacity M_max per rank; None: ``memory_cap_fraction`` of the default.
      memory_cap_fraction   in (0, 1]: the default cap's share of the busiest stage's unmitigated in-flight bytes.
      memory_cap_imbalance  None, or >= 1: the default cap is instead the busiest stage's unmitigated in-flight bytes
                            at this device imbalance (max/mean load): micro-batches routed up to it run unmitigated.
      spike_rate            share of micro-batches whose routing is forced towards one expert-parallel rank.
      spike_max             the largest forced imbalance (max/mean device load); one EP rank can receive at most
                            ``min(ep, num_experts / top_k)`` x the mean (``costmodel.imbalance_limit``), so spikes
                            are drawn up to the smaller of ``spike_max`` and that limit.
      bias_update_rate      aux-loss-free balancing: router expert-bias step per iteration (0: off).
      device                ``cpu`` (gloo) or ``cuda`` (NCCL).
      hardware              cost-model hardware profile (``bagualu2 presets``) for the runtime's durations.
      data                  the user's .txt / .jsonl file or directory; None: the bundled corpus.
      metrics_file, checkpoint_dir, checkpoint_every, resume   see docs/trainer.md.
      collective_timeout_s  seconds (at least 0.1): the process groups' timeout and the step watchdog's limit; a
                            rank that makes no progress for that long dumps its stacks and exits for torchrun to
                            restart.
      on_nonfinite          a non-finite loss or gradient: ``stop`` (one line naming the step, the last complete
                            checkpoint kept) or ``skip`` (every rank drops that step's update).
    """

    model: ModelConfig
    pp: int = 1
    dp: int = 1
    ep: int = 1
    vp: int = 1
    num_microbatches: int = 4
    steps: int = 50
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 5
    seed: int = 0
    schedule: str = "runtime"
    paired: bool | None = None
    policy: str = "flexible"
    downgrade: str = "graded"
    memory_cap_bytes: int | None = None
    memory_cap_fraction: float = 0.7
    memory_cap_imbalance: float | None = None
    spike_rate: float = 0.0
    spike_max: float = 2.0
    bias_update_rate: float = 1e-3
    prediction_scale: float = 1.0
    device: str = "cpu"
    hardware: str = "cpu"
    data: str | None = None
    metrics_file: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    collective_timeout_s: float = 600.0
    on_nonfinite: str = "stop"
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelConfig):
            raise ValueError(f"model must be a ModelConfig, got {type(self.model).__name__}")
        for name in ("pp", "dp", "ep", "vp", "num_microbatches", "steps"):
            require_int(f"--{name.replace('_', '-')}", getattr(self, name), 1)
        require_int("--seed", self.seed, 0, 2**63)
        require_int("--warmup-steps", self.warmup_steps, 0)
        require_int("--checkpoint-every", self.checkpoint_every, 0)
        for option, name in (("--data", "data"), ("--metrics-file", "metrics_file"),
                             ("--checkpoint-dir", "checkpoint_dir")):
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                value = os.fspath(value)
                object.__setattr__(self, name, value)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{option} must be a path, got {value!r}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("--checkpoint-every needs --checkpoint-dir (where the checkpoints go)")
        require_number("--lr", self.lr, 0, 1e4, low_open=True)
        require_number("--weight-decay", self.weight_decay, 0, 1e4)
        require_number("--memory-cap-fraction", self.memory_cap_fraction, 0, 1, low_open=True)
        if self.memory_cap_imbalance is not None:
            require_number("--memory-cap-imbalance", self.memory_cap_imbalance, 1, 1e9)
        require_number("--spike-rate", self.spike_rate, 0, 1)
        require_number("--bias-update-rate", self.bias_update_rate, 0, 1)
        require_number("--prediction-scale", self.prediction_scale, 0, 1, low_open=True)
        if self.prediction_scale != 1.0 and self.policy != "flexible":
            raise ValueError(f"--prediction-scale applies to --policy flexible only (a fixed policy plans before "
                             f"training, from no prediction), got --policy {self.policy}")
        # at least 0.1 s: the process groups' stores count whole milliseconds, and a stall is reported to a tenth
        require_number("--collective-timeout", self.collective_timeout_s, 0.1, 1e7)
        for option, value, allowed in (("--schedule", self.schedule, SCHEDULES), ("--policy", self.policy, POLICIES),
                                       ("--device", self.device, DEVICES), ("--downgrade", self.downgrade, DOWNGRADES),
                                       ("--on-nonfinite", self.on_nonfinite, NONFINITE)):
            if value not in allowed:
                raise ValueError(f"{option} must be one of {', '.join(allowed)}, got {value!r}")
        if self.memory_cap_bytes is not None:
            require_int("--memory-cap", self.memory_cap_bytes, 1)
        if self.paired is not None and not isinstance(self.paired, bool):
            raise ValueError(f"--paired must be true, false or unset, got {self.paired!r}")
        if self.paired and self.schedule != "runtime":
            raise ValueError("--paired needs --schedule runtime (the stock schedules run F then B at every step)")
        if self.paired and self.ep < 2:
            raise ValueError("--paired needs --ep >= 2 (combined 1F1B runs one micro-batch's expert-parallel "
                             "all-to-alls beside the other's compute)")
        self.check_layout()
        if self.spike_rate > 0 and self.ep < 2:
            raise ValueError(f"--spike-rate {self.spike_rate:g} needs --ep >= 2 (a spike forces routing towards one "
                             "expert-parallel rank; with ep=1 every expert is local); --spike-rate 0 runs without "
                             "spikes (a recipe may set a rate of its own)")
        require_number("--spike-max", self.spike_max, 1, 1e9)  # spikes are drawn up to min(spike_max, the limit)
        if self.model.tie_embeddings and self.pp > 1:
            raise ValueError("a model with tie_embeddings needs --pp 1 (the embedding and the output layer on one "
                             "stage)")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir")
        if self.hardware not in presets.hardware_names():
            raise ValueError(f"--hardware must be one of {', '.join(presets.hardware_names())}, got {self.hardware!r}")

    def check_layout(self) -> None:
        """The layout rules (one line each): ep | dp, layers divisible by pp*vp, experts by ep, m >= pp."""
        m = self.model
        if self.dp % self.ep:
            raise ValueError(f"--ep={self.ep} must divide --dp={self.dp} (experts are carved out of the "
                             "data-parallel ranks)")
        if m.num_layers % (self.pp * self.vp):
            raise ValueError(f"the model's {m.num_layers} layers must be divisible by --pp x --vp = "
                             f"{self.pp * self.vp}")
        if m.num_experts and m.num_experts % self.ep:
            raise ValueError(f"the model's {m.num_experts} experts must be divisible by --ep={self.ep}")
        if self.vp > 1 and self.pp < 2:
            raise ValueError(f"--vp={self.vp} needs --pp >= 2 (interleaved 1F1B)")
        if self.num_microbatches < self.pp:
            raise ValueError(f"--num-microbatches={self.num_microbatches} must be >= --pp={self.pp}")
        if self.vp > 1 and self.schedule == "runtime" and self.num_microbatches == self.pp:
            raise ValueError(f"--schedule runtime with --vp={self.vp} needs --num-microbatches > --pp={self.pp} "
                             f"(at {self.pp} every forward is warmup and torch cannot lower the action list); "
                             f"use --num-microbatches {2 * self.pp} or --schedule plain")
        if self.vp > 1 and self.num_microbatches % self.pp:
            raise ValueError(f"with --vp > 1, --num-microbatches={self.num_microbatches} must be a multiple of "
                             f"--pp={self.pp} (interleaved 1F1B)")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def parallel(self) -> ParallelConfig:
        """The cost model's layout of this run."""
        return ParallelConfig(dp=self.dp, ep=self.ep, pp=self.pp, vp=self.vp, num_microbatches=self.num_microbatches,
                              distributed_optimizer=False, paired=self.combined_1f1b)

    @property
    def combined_1f1b(self) -> bool:
        """Does this run pair its steady points (``paired``, or by default ``runtime`` without a pipeline under
        expert parallelism: F_(i+1) beside B_i)?"""
        if self.paired is not None:
            return self.paired
        return self.pp == 1 and self.ep > 1 and self.schedule == "runtime"

    @property
    def global_batch_sequences(self) -> int:
        return self.dp * self.num_microbatches * self.model.micro_batch_size

    def with_overrides(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)


def default_cap(config: TrainConfig) -> int:
    """``memory_cap_fraction`` x the busiest stage's unmitigated in-flight chunk bytes at balanced load (or, with
    ``memory_cap_imbalance``, 1 x those bytes at that imbalance), but at least full recompute (M0) of every
    in-flight chunk of every stage."""
    hardware = presets.hardware(config.hardware)
    parallel = config.parallel
    imbalance = config.memory_cap_imbalance
    fraction = config.memory_cap_fraction if imbalance is None else 1.0
    limit = imbalance_limit(config.model, parallel)  # a higher imbalance is clamped: no routing reaches it
    unmitigated = floor = 0
    for stage in range(config.pp):
        memory = stage_memory(config.model, parallel, hardware, stage=stage)
        worst = max(build_graph(config.model, parallel, hardware, stage=stage, chunk=c,
                                imbalance=min(imbalance or 1.0, limit)).unmitigated_bytes
                    for c in range(config.vp))
        unmitigated = max(unmitigated, memory.inflight_chunks * worst)
        floor = max(floor, memory.inflight_chunks * memory.m0_bytes)
    return max(int(fraction * unmitigated), floor)


def minimum_cap(config: TrainConfig) -> int:
    """The smallest cap that can run: full recompute of every in-flight chunk on the busiest stage."""
    hardware = presets.hardware(config.hardware)
    return max(stage_memory(config.model, config.parallel, hardware, stage=s).inflight_chunks
               * stage_memory(config.model, config.parallel, hardware, stage=s).m0_bytes for s in range(config.pp))


def _glm(**fields) -> ModelConfig:
    base = dict(num_query_groups=2, num_shared_experts=1, num_dense_layers=1, vocab_size=4096, dtype="fp32")
    base.update(fields)
    return ModelConfig(**base)


def glm_moe_debug() -> TrainConfig:
    """CPU, 4 processes (PP=2 x DP=2, EP=2); well under a second per step."""
    model = _glm(num_layers=8, hidden_size=64, num_attention_heads=4, head_dim=16, ffn_hidden_size=192,
                 moe_ffn_hidden_size=32, num_experts=8, top_k=2, seq_length=64, micro_batch_size=2)
    return TrainConfig(model=model, pp=2, dp=2, ep=2, num_microbatches=4, steps=50, lr=3e-3)


def glm_moe_bench() -> TrainConfig:
    """CPU, 4 processes (PP=2 x DP=2, EP=2); compute-bound steps of a few seconds; spikes 0.15 up to 2.6 (drawn up
    to 2: one of 2 EP ranks receives at most twice the mean, and 8 experts / top-4 allow no more)."""
    model = _glm(num_layers=4, hidden_size=384, num_attention_heads=6, head_dim=64, ffn_hidden_size=1024,
                 moe_ffn_hidden_size=384, num_experts=8, top_k=4, num_dense_layers=0, seq_length=512,
                 micro_batch_size=1)
    return TrainConfig(model=model, pp=2, dp=2, ep=2, num_microbatches=4, steps=16, lr=1e-3, bias_update_rate=1e-2,
                       memory_cap_imbalance=1.2, spike_rate=0.15, spike_max=2.6)


def glm_moe_small() -> TrainConfig:
    """One GPU."""
    model = _glm(num_layers=8, hidden_size=512, num_attention_heads=8, head_dim=64, ffn_hidden_size=1536,
                 moe_ffn_hidden_size=256, num_experts=16, top_k=2, seq_length=1024, micro_batch_size=4,
                 num_query_groups=4, dtype="bf16")
    return TrainConfig(model=model, num_microbatches=4, steps=200, lr=1e-3, device="cuda", hardware="h100")


def glm_moe_multi() -> TrainConfig:
    """8 GPUs (PP=4 x DP=2, EP=2, VP=2); GLM-423B-A30B's expert shape scaled down."""
    model = _glm(num_layers=16, hidden_size=1024, num_attention_heads=8, head_dim=128, ffn_hidden_size=4096,
                 moe_ffn_hidden_size=512, num_experts=32, top_k=6, num_query_groups=8, num_dense_layers=0,
                 seq_length=2048, micro_batch_size=1, dtype="bf16")
    return TrainConfig(model=model, pp=4, dp=2, ep=2, vp=2, num_microbatches=8, steps=500, lr=5e-4,
                       device="cuda", hardware="h100", spike_rate=0.03, spike_max=2.0)


RECIPES: dict[str, Callable[[], TrainConfig]] = {"glm_moe_debug": glm_moe_debug, "glm_moe_bench": glm_moe_bench,
                                                 "glm_moe_small": glm_moe_small, "glm_moe_multi": glm_moe_multi}


def recipe(name: str) -> TrainConfig:
    try:
        return RECIPES[name.lower() if isinstance(name, str) else name]()  # in any case, like the CLI's presets
    except (KeyError, TypeError):
        raise ValueError(f"--recipe must be one of {', '.join(RECIPES)}, got {name!r}") from None
