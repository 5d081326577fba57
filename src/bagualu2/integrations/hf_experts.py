"""The routed experts of a transformers MoE model as three ops: fc1, activation, fc2.

transformers 5 runs a model's routed experts as one module with 3-D parameters (``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]``, or transposed), through the *experts implementation* the config names
(``grouped_mm`` by default). :func:`install` registers one more implementation, ``"bagualu2"``, and gives every
experts module three parameter-free children, ``bagualu2_fc1``, ``bagualu2_act`` and ``bagualu2_fc2``, through
which it runs: the same computation as ``grouped_mm`` (tokens sorted by expert, one GEMM per expert, the gate,
the routing weights, the sum over the top-k), with each expert GEMM group and the activation a module of its own,
so the exec layer's hooks see them as ops and plan their saved tensors one by one.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable

import torch

from bagualu2.exec import routed
from bagualu2.exec.ops import ACTIVE
from bagualu2.exec.scope import TRACER

NAME = "bagualu2"
# set on experts modules whose routers report to the gate (``hf.instrument``): while a micro-batch records or a
# trace runs, their count of received copies must be right
GATE_ATTRIBUTE = "bagualu2_gate"
PARTS = ("bagualu2_fc1", "bagualu2_act", "bagualu2_fc2")


def is_experts(module: torch.nn.Module) -> bool:
    """Is ``module`` a routed-experts module that transformers' experts implementations run?"""
    weight = getattr(module, "gate_up_proj", None)
    if weight is None:
        weight = getattr(module, "up_proj", None)
    return (isinstance(weight, torch.nn.Parameter) and weight.dim() == 3 and hasattr(module, "has_gate")
            and hasattr(module, "is_transposed") and hasattr(module, "num_experts"))


class _Part(torch.nn.Module):
    """A child of an experts module that runs part of it; the experts module is held without registering it."""

    def __init__(self, experts: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "owner", experts)  # not a submodule: no cycle in the module tree


def _local(weight: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's experts of a weight sharded by transformers' expert parallelism (a ``DTensor``: what the experts
    module computes with, also when a part re-runs on its own in backward); a plain weight as it is."""
    return weight.to_local() if weight is not None and hasattr(weight, "device_mesh") else weight


def _grouped(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, counts: list[int],
             transposed: bool) -> torch.Tensor:
    """Each expert's rows of ``x`` times its weight (``[E, out, in]``, or ``[E, in, out]`` transposed). An expert
    that received no rows runs on its empty rows too: every call then saves the same tensors in the same order
    whatever the routing, so a plan traced on one batch names the savings of any other batch of its shape.

    As transformers' ``grouped_mm`` (not autocast-enabled), the GEMMs run in the weight's dtype on the rows cast to
    it, also under ``torch.autocast``: fp32 weights under bf16 autocast multiply in fp32 there, and here."""
    weight, bias = _local(weight), _local(bias)
    outputs = []
    device = x.device.type
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    off = torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext()
    with off:
        for expert, rows in enumerate(torch.split(x.to(weight.dtype), counts)):
            w = weight[expert]
            y = rows @ w if transposed else torch.nn.functional.linear(rows, w)
            outputs.append(y if bias is None else y + bias[expert])
    return torch.cat(outputs)


class ExpertsFC1(_Part):
    """The gate/up (or up) projection of every expert on its sorted rows."""

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        experts = self.owner
        weight = experts.gate_up_proj if experts.has_gate else experts.up_proj
        bias = None
        if experts.has_bias:
            bias = experts.gate_up_proj_bias if experts.has_gate else experts.up_proj_bias
        return _grouped(x, weight, bias, counts, experts.is_transposed)


class ExpertsAct(_Part):
    """The experts' gate (``_apply_gate``: activation of the gate half times the up half) or activation."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        experts = self.owner
        return experts._apply_gate(h) if experts.has_gate else experts.act_fn(h)


class ExpertsFC2(_Part):
    """The down projection of every expert (and the post-expert norm of the families that have one)."""

    def forward(self, a: torch.Tensor, counts: list[int]) -> torch.Tensor:
        experts = self.owner
        bias = experts.down_proj_bias if experts.has_bias else None
        y = _grouped(a, experts.down_proj, bias, counts, experts.is_transposed)
        return experts.post_expert_norm(y) if experts.has_post_expert_norm else y


def experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"bagualu2"`` experts implementation (``grouped_mm``'s computation through the three parts). Under
    transformers' expert parallelism it runs on what this rank's experts received (local expert ids); a route
    to another rank's expert (an id past the local ones, weight 0) is skipped. The rows of the routed experts are
    made under :func:`bagualu2.exec.routed`, so a traced graph resizes them with the imbalance."""
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.size(-1)
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    counts = torch.bincount(expert_ids, minlength=self.num_experts)[:self.num_experts].tolist()
    local = sum(counts)
    if local != expert_ids.numel():
        if not getattr(self, "_is_expert_parallel", False):
            raise ValueError(f"{type(self).__name__}: the router picked indices beyond its {self.num_experts} "
                             "experts (identity or skip experts); the bagualu2 experts implementation runs routed "
                             "experts only")
        if getattr(self, GATE_ATTRIBUTE, False) and (ACTIVE.get() is not None or TRACER.get() is not None):
            raise ValueError(f"{type(self).__name__}: routes to another rank's experts reached this rank (the "
                             "all-reduce expert parallelism, a batch the group shares); the gate counts routed "
                             "copies for the all-to-all one (each rank its own batch): use "
                             "ep_implementation='all_to_all', or instrument(model, gate=False)")
    with routed():
        if local != perm.numel():  # sorted: another rank's routes (ids past the local experts) come last
            perm = perm[:local].clone()
        rows = hidden_states[perm // top_k]
        weights = top_k_weights.reshape(-1)[perm]
        h = self.bagualu2_fc1(rows, counts)
        a = self.bagualu2_act(h)
        y = self.bagualu2_fc2(a, counts)
        weighted = y * weights.unsqueeze(-1)
    out = hidden_states.new_zeros((num_tokens * top_k, hidden), dtype=weighted.dtype)
    out = out.index_copy(0, perm, weighted) if local != expert_ids.numel() else _unsort(weighted, perm)
    return out.view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


def _unsort(weighted: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """The rows of ``weighted`` (sorted by expert) back in (token, top-k slot) order."""
    with routed():
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.size(0), device=perm.device)
        return weighted[inverse]


def install(model: torch.nn.Module) -> Callable[[], None]:
    """Register the ``"bagualu2"`` experts implementation, give every experts module of ``model`` its three parts
    and select the implementation for these modules alone; returns what undoes it on the model (the parts taken
    off, each module's own config back).

    transformers selects an experts implementation through a config that other models may share (two models from
    one config object, a teacher beside a student): each experts module here gets a shallow copy of its config
    that selects ``"bagualu2"``, so a model that shares the config and is not instrumented runs as it did, and
    taking one model's instrumentation off leaves another's in force."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, experts_forward)
    added: list[tuple[torch.nn.Module, str]] = []
    configs: list[tuple[torch.nn.Module, Any]] = []  # (experts module, the config it had)
    own: dict[int, Any] = {}  # id(shared config) -> its copy that selects NAME

    def undo() -> None:
        for module, name in reversed(added):
            delattr(module, name)
        for module, config in reversed(configs):
            module.config = config

    try:
        for module in model.modules():
            if is_experts(module):
                for name, part in zip(PARTS, (ExpertsFC1, ExpertsAct, ExpertsFC2)):
                    if not isinstance(getattr(module, name, None), part):
                        module.add_module(name, part(module))
                        added.append((module, name))
                if getattr(module.config, "_experts_implementation", None) != NAME:
                    config = module.config
                    if id(config) not in own:
                        own[id(config)] = _selecting(config)
                    configs.append((module, config))
                    module.config = own[id(config)]
    except BaseException:
        undo()  # what it changed before failing
        raise
    return undo


def _selecting(config: Any) -> Any:
    """A shallow copy of ``config`` that selects the ``"bagualu2"`` implementation (the copy alone: transformers'
    setter would also set it on the sub-configs the copy shares with ``config``)."""
    selecting = copy.copy(config)
    if isinstance(getattr(type(config), "_experts_implementation", None), property):
        selecting._experts_implementation_internal = NAME
    else:
        selecting._experts_implementation = NAME
    return selecting
