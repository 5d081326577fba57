"""Activation cost model (paper §IV): configs, presets, op graphs, strategies, the one evaluator, pipeline
memory curves and static memory. Pure Python: never imports torch."""

from . import presets
from .build import build_graph, check_imbalance, chunk_layers, imbalance_limit
from .config import Hardware, ModelConfig, ParallelConfig, check_compatible
from .evaluate import PlanCost, evaluate, resolve
from .graph import OP_KINDS, Op, OpGraph, Resource, Saving, TensorSpec
from .memory import StageMemory, num_parameters, stage_memory, stage_parameters, static_bytes
from .pipeline import (inflight_chunks, inflight_microbatches, memory_curve, num_warmup, point_relation, points,
                       schedule)
from .plan import Plan
from .strategy import Knee, Strategy, calibrate, fit_knee, knee

__all__ = [
    "Hardware", "Knee", "ModelConfig", "OP_KINDS", "Op", "OpGraph", "ParallelConfig", "Plan", "PlanCost",
    "Resource", "Saving", "StageMemory", "Strategy", "TensorSpec", "build_graph", "calibrate",
    "check_compatible", "check_imbalance", "chunk_layers", "evaluate", "fit_knee", "imbalance_limit", "inflight_chunks",
    "inflight_microbatches", "knee", "memory_curve", "num_parameters", "num_warmup", "point_relation", "points",
    "presets", "resolve", "schedule", "stage_memory", "stage_parameters", "static_bytes",
]
