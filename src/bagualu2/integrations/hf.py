"""Hugging Face transformers MoE models under the exec layer, exactly.

    from bagualu2.integrations import hf
    instrumented = hf.instrument(model)                      # a transformers MoE model, or its inner model
    graph = instrumented.trace_graph(input_ids=ids, labels=ids, hardware=presets.hardware("cpu"),
                                     loss=lambda out: out.loss)
    executor = apply_plan(instrumented, greedy.solve(graph, budget).plan)

* :func:`op_map` finds the ops of a model from its module tree: per decoder layer the norms (``norm1``,
  ``norm2``, ...), the attention (``core_attn``, its projections ``qkv`` and ``attn_out``), the MoE block (``moe``)
  with its router (``router``), a linear-attention or state-space token mixer (``mixer``, kind ``core_attn``),
  its routed experts (``dispatch``: sorting and combining; ``expert_fc1``,
  ``expert_act``, ``expert_fc2``: the experts' GEMMs and gate) and its shared experts (``shared_fc1``,
  ``shared_act``, ``shared_fc2``), and the dense MLP layers (``mlp_fc1``, ``mlp_act``, ``mlp_fc2``). Everything
  else (embedding, final norm, output layer, loss) is saved outside the ops: in the traced graph those savings
  are pinned, kept by every plan and counted.
* :func:`instrument` runs the routed experts through the ``"bagualu2"`` experts implementation
  (:mod:`.hf_experts`), so that the experts' fc1, activation and fc2 are ops of their own; turns the KV cache off
  for training, as transformers' own activation checkpointing does (a re-run attention would update it a second
  time); and reports every router's routed token copies to the gate. ``remove()`` on what it returns undoes all
  of it (and a refused model is left as it was).

A model is supported when its routed experts are a module transformers' experts implementations run (its class
decorated with ``use_experts_implementation``): the families in :data:`SUPPORTED_FAMILIES` and others built
the same way. This module imports without transformers; :func:`instrument` needs it.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from bagualu2.exec import GateReport, InstrumentedModel
from bagualu2.exec import instrument as instrument_ops
from bagualu2.exec.instrument import check_instrumentable

from .hf_experts import GATE_ATTRIBUTE, PARTS, install, is_experts

# every causal-LM MoE family (model_type) of transformers 5.24 whose routed experts its experts implementations run;
# the tests build each from a tiny config with its defaults and check it exactly (docs/hf.md)
SUPPORTED_FAMILIES = (
    "afmoe", "aria_text", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "deepseek_v2", "deepseek_v3",
    "deepseek_v32", "deepseek_v4", "dots1", "dots3_note_text", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint",
    "gemma4_text", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt_oss", "granitemoe", "granitemoe_swa",
    "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "hy_v4", "inkling2_loop_text",
    "inkling2_text", "inkling_text", "jamba", "kimi_linear", "kolibri1", "laguna", "lara_mini", "lfm2_moe", "mellum",
    "mimo_v2_flash", "minimax", "minimax_m2", "minimax_m3_vl_text", "mistral4", "mixtral", "nemotron_h", "olmoe",
    "phimoe", "qwen2_moe", "qwen3_5_moe_text", "qwen3_moe", "qwen3_next", "qwen4_exp_text", "sarvam_mla",
    "sarvam_moe", "solar_open", "zaya")
EXAMPLES = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")  # what an error names of the supported families
ATTENTION_NAMES = ("self_attn", "self_attention", "attention", "attn")
QKV_NAMES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
             "kv_proj", "Wqkv")
OUT_NAMES = ("o_proj", "out_proj", "o_b_proj")
MIXER_NAMES = ("linear_attn", "mamba", "mixer", "conv", "short_conv")
SHARED_NAMES = ("shared_experts", "shared_expert", "shared_mlp")
FC1_NAMES, ACT_NAMES, FC2_NAMES = ("gate_proj", "up_proj"), ("act_fn",), ("down_proj",)
NORM_ORDER = ("input_layernorm", "post_attention_layernorm")


def _is_norm(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith("RMSNorm") or name.endswith("LayerNorm") or isinstance(module, torch.nn.LayerNorm)


def _layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(path, layer)`` of every decoder layer: the items of a ``ModuleList`` named ``layers``."""
    found = []
    for path, module in model.named_modules():
        if path.rsplit(".", 1)[-1] == "layers" and isinstance(module, torch.nn.ModuleList):
            found += [(f"{path}.{i}", layer) for i, layer in enumerate(module)]
    return found


def _mlp(prefix: str, module: torch.nn.Module, fc1: str, act: str, fc2: str, labels: dict) -> None:
    """The gate/up, activation and down modules of a gated MLP, when it has them."""
    children = dict(module.named_children())
    for names, label in ((FC1_NAMES, fc1), (ACT_NAMES, act), (FC2_NAMES, fc2)):
        for name in names:
            if name in children:
                labels[f"{prefix}.{name}"] = label


def _experts(path: str, experts: torch.nn.Module, labels: dict) -> None:
    """The routed experts: sorting and combining (``dispatch``) and, once :func:`instrument` gave them their
    parts, the experts' fc1, activation and fc2."""
    labels[path] = "dispatch"
    for part, label in zip(PARTS, ("expert_fc1", "expert_act", "expert_fc2")):
        if hasattr(experts, part):
            labels[f"{path}.{part}"] = label


def _moe(path: str, block: torch.nn.Module, experts_name: str, labels: dict) -> None:
    """The MoE block at ``path``: the block, its router, routed experts and shared experts."""
    labels[path] = "moe"
    experts = f"{path}.{experts_name}"
    _experts(experts, getattr(block, experts_name), labels)
    for name, child in block.named_children():
        kind = type(child).__name__
        if name in ("gate", "router") or "Router" in kind or kind.endswith("Gate"):
            if name != experts_name and not name.startswith("shared"):
                labels[f"{path}.{name}"] = "router"
        elif name in SHARED_NAMES:
            _mlp(f"{path}.{name}", child, "shared_fc1", "shared_act", "shared_fc2", labels)


def op_map(model: torch.nn.Module) -> dict[str, str]:
    """The op map (``{module path: op label}``, as :func:`bagualu2.exec.instrument` takes it) of a transformers
    MoE model or its inner model; one ``ValueError`` naming the class for a model with no supported experts. The
    experts' fc1 / activation / fc2 ops are in it once :func:`instrument` (or ``hf_experts.install``) gave the
    experts modules their parts; before, the routed experts are one op."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}")
    labels: dict[str, str] = {}
    found_experts = False
    layers = _layers(model)
    for layer_path, layer in layers:
        norms = [name for name, child in layer.named_children() if _is_norm(child)]
        ordered = [n for n in NORM_ORDER if n in norms] + [n for n in norms if n not in NORM_ORDER]
        for i, name in enumerate(ordered, start=1):
            labels[f"{layer_path}.{name}"] = f"norm{i}"
        for name, child in layer.named_children():
            path = f"{layer_path}.{name}"
            if name in (*ATTENTION_NAMES, *MIXER_NAMES) and "Attention" in type(child).__name__:
                labels[path] = "core_attn"
                for inner, _ in child.named_children():
                    if inner in QKV_NAMES:
                        labels[f"{path}.{inner}"] = "qkv"
                    elif inner in OUT_NAMES:
                        labels[f"{path}.{inner}"] = "attn_out"
                continue
            experts = next((n for n, c in child.named_children() if is_experts(c)), None)
            if experts is not None:
                _moe(path, child, experts, labels)
                found_experts = True
            elif is_experts(child):  # experts beside the layer's dense MLP (its router a sibling too)
                _experts(path, child, labels)
                found_experts = True
            elif name in ("mlp", "feed_forward", "ffn"):
                _mlp(path, child, "mlp_fc1", "mlp_act", "mlp_fc2", labels)
            elif name == "router" and "Router" in type(child).__name__:
                labels[path] = "router"
            elif name in MIXER_NAMES and not _is_norm(child):  # a linear-attention or state-space token mixer
                labels[path] = "mixer:core_attn"
    if not found_experts and not layers and any(is_experts(module) for module in model.modules()):
        raise ValueError(f"{type(model).__name__} holds routed experts but no decoder layers (a ModuleList named "
                         "'layers'): instrument the whole transformers model or its inner model, not a layer, MoE "
                         "block or experts module of it")
    if not found_experts:
        inside = tuple(f"{layer_path}." for layer_path, _ in layers)
        deeper = [path for path, module in model.named_modules() if is_experts(module) and path.startswith(inside)]
        if deeper:
            more = f" and {len(deeper) - 1} more" if len(deeper) > 1 else ""
            raise ValueError(f"{type(model).__name__} keeps its routed experts at {deeper[0]}{more}, deeper than "
                             "op_map reads them (a decoder layer's child or its MoE block's child): not supported")
        moe = next((name for name in (type(module).__name__ for module in model.modules())  # not the model's own
                    if re.search(r"moe|expert", name, re.IGNORECASE) and not re.search(r"Model$|For[A-Z]", name)),
                   None)
        why = (f"its MoE layers ({moe}) run experts of their own, not transformers' experts implementations"
               if moe is not None else "its layers are all dense")
        raise ValueError(f"{type(model).__name__} has no routed-experts module that transformers' experts "
                         f"implementations run ({why}); supported: the {len(SUPPORTED_FAMILIES)} families of "
                         f"hf.SUPPORTED_FAMILIES ({', '.join(f for f in EXAMPLES if f in SUPPORTED_FAMILIES)}, ...)")
    return labels


def _indices(router: torch.nn.Module, output) -> torch.Tensor:
    """A router's top-k expert indices: the integer tensor of its output."""
    values = output if isinstance(output, tuple) else (output,)
    indices = next((v for v in values if isinstance(v, torch.Tensor) and not v.is_floating_point()), None)
    if indices is None:
        raise ValueError(f"{type(router).__name__} returns no top-k indices; instrument(..., gate=False)")
    return indices


def _expert_group(experts: torch.nn.Module | None):
    """``(process group, ranks, local experts)`` of experts sharded by transformers' expert parallelism (their
    3-D weights DTensors on the expert-parallel mesh), else None."""
    if experts is None or not getattr(experts, "_is_expert_parallel", False):
        return None
    weight = experts.gate_up_proj if getattr(experts, "gate_up_proj", None) is not None else experts.up_proj
    mesh = getattr(weight, "device_mesh", None)
    if mesh is None or mesh.ndim != 1:
        raise ValueError(f"{type(experts).__name__}: expert parallelism needs the experts' weights sharded on a "
                         "one-dimensional expert-parallel mesh")
    return mesh.get_group(), mesh.size(), experts.num_experts


def _gate_report(router: torch.nn.Module, inputs, output, experts: torch.nn.Module | None = None) -> GateReport:
    """The routed token copies this rank's experts receive after ``router``: all its top-k picks, or, under
    transformers' expert parallelism (all-to-all dispatch), what every rank's router sends to this rank's
    experts (one all-to-all of per-rank counts over the expert-parallel group, whose ranks then agree on the
    gate's decision)."""
    indices = _indices(router, output)
    sent = int(indices.numel())
    sharded = _expert_group(experts)
    if sharded is None:
        return GateReport(sent, sent=sent)
    group, ranks, local = sharded
    counts = torch.bincount(indices.reshape(-1), minlength=ranks * local)[:ranks * local].view(ranks, local).sum(1)
    received = torch.empty_like(counts)
    torch.distributed.all_to_all_single(received, counts, group=group)
    return GateReport(int(received.sum()), group, None, sent)


def _routers(model: torch.nn.Module, labels: Mapping[str, str]) -> dict[torch.nn.Module, torch.nn.Module]:
    """Each router module and the routed-experts module beside it (the same parent)."""
    modules = dict(model.named_modules())
    experts = {path.rpartition(".")[0]: modules[path] for path, label in labels.items() if label == "dispatch"}
    return {modules[path]: experts.get(path.rpartition(".")[0]) for path, label in labels.items()
            if label == "router"}


def _configs(model: torch.nn.Module) -> list:
    seen, configs = set(), []
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "use_cache") and id(config) not in seen:
            seen.add(id(config))
            configs.append(config)
    return configs


# id(config) -> [config, the use_cache it had, the instrumented models that hold it off]: models that share a
# config share its KV-cache switch, which the last of them taken off turns back
_CACHE_OFF: dict[int, list] = {}


def _cache_off(config, restores: list) -> None:
    """``config.use_cache = False`` while this model is instrumented (``restores`` gets what undoes it)."""
    entry = _CACHE_OFF.get(id(config))
    if entry is None or entry[0] is not config:
        entry = _CACHE_OFF[id(config)] = [config, config.use_cache, 0]
    entry[2] += 1
    config.use_cache = False

    def restore() -> None:
        entry[2] -= 1
        if entry[2] == 0:
            if _CACHE_OFF.get(id(config)) is entry:
                del _CACHE_OFF[id(config)]
            config.use_cache = entry[1]

    restores.append(restore)


def instrument(model: torch.nn.Module, *, gate: bool = True) -> InstrumentedModel:
    """:func:`bagualu2.exec.instrument` with :func:`op_map`, the experts split into three ops, the KV cache off for
    training and, with ``gate``, every router's routed copies reported to the gate (see the module docstring)."""
    if not isinstance(gate, bool):
        raise ValueError(f"gate must be True or False, got {gate!r}")
    try:
        import transformers  # noqa: F401
    except ModuleNotFoundError:
        raise ValueError("bagualu2.integrations.hf needs transformers: pip install 'bagualu2[hf]'") from None
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}")
    if getattr(model, "is_activation_checkpointing", False):
        raise ValueError(f"{type(model).__name__} has transformers' activation checkpointing on: its layers save "
                         "nothing a plan could act on; call activation_checkpointing_disable() first (plans "
                         "recompute per tensor)")
    check_instrumentable(model)  # before anything on the model changes
    restores = [install(model)]
    try:
        instrumented = _instrument(model, gate, restores)
    except BaseException:
        _undo(restores)  # a refused model is left as it was
        raise
    instrumented.on_remove(lambda: _undo(restores))
    return instrumented


def _instrument(model: torch.nn.Module, gate: bool, restores: list) -> InstrumentedModel:
    """:func:`instrument` once the experts implementation is installed; every change to the model goes on
    ``restores`` (what undoes it)."""
    labels: Mapping[str, str] = op_map(model)
    for config in _configs(model):
        _cache_off(config, restores)  # as transformers' activation checkpointing does: a re-run must not update it
    if not gate:
        for path, label in labels.items():
            if label == "dispatch":
                _flag(model.get_submodule(path), False, restores)
        return instrument_ops(model, labels)
    experts_of = _routers(model, labels)
    for experts in experts_of.values():
        if experts is not None:
            _flag(experts, True, restores)  # its count assumes each rank routes its own batch
    return instrument_ops(model, labels,
                          gate=lambda router, inputs, output: _gate_report(router, inputs, output,
                                                                           experts_of.get(router)))


def _flag(module: torch.nn.Module, value: bool, restores: list) -> None:
    """Set the gate flag of an experts module (``restores`` gets what undoes it)."""
    if GATE_ATTRIBUTE in vars(module):
        restores.append(lambda then=vars(module)[GATE_ATTRIBUTE]: setattr(module, GATE_ATTRIBUTE, then))
    else:
        restores.append(lambda: delattr(module, GATE_ATTRIBUTE) if GATE_ATTRIBUTE in vars(module) else None)
    setattr(module, GATE_ATTRIBUTE, value)


def _undo(restores: list) -> None:
    """Undo the changes in ``restores``, the latest first."""
    while restores:
        restores.pop()()
