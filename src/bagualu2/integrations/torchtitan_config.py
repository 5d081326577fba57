"""The torchtitan integration's job-config section and its knowledge of torchtitan's decoders: the op map of a
stage's part of the model and what a router reports to the gate (see :mod:`.torchtitan`)."""

# no "from __future__ import annotations": torchtitan merges JobConfig's fields with their types resolved

import threading
from dataclasses import dataclass, field

import torch

from bagualu2.exec import GateReport, routed

POLICIES = ("flexible", "static-over", "static-under", "off")
SCHEDULES = ("1F1B",)
MIB = 1 << 20
MAX_CAP_MIB = 1 << 30  # 1 PiB: far above any device's memory


@dataclass(kw_only=True)
class Bagualu2Config:
    """The ``[bagualu2]`` section of a torchtitan job config.

      policy          ``flexible`` (a plan per micro-batch, re-planned after the gate), ``static-over`` (one plan
                      for the most a rank's experts can receive), ``static-under`` (one plan for balanced routing)
                      or ``off`` (measured only).
      memory_cap_mib  the activation memory each pipeline stage may hold, in MiB (0: no cap: every micro-batch
                      keeps everything, as ``off``).
      downgrade       the gate's mode: ``graded`` (re-plan the MoE module) or ``paper`` (keep or full recompute).
      quantize        plans may store activations in FP8 (``false``: exact plans only, KEEP / OFFLOAD /
                      RECOMPUTE, whose gradients equal the plain run's bit for bit).
      report_path     a JSON-lines file, one line appended after every step with each micro-batch's budget,
                      plan and bytes ("": none); ``~`` is the home folder, ``{rank}`` is replaced by the rank
                      and ``{stage}`` by the pipeline stage.
    """

    policy: str = "flexible"
    memory_cap_mib: float = 0.0
    downgrade: str = "graded"
    quantize: bool = True
    report_path: str = ""

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"bagualu2.policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if isinstance(self.memory_cap_mib, bool) or not isinstance(self.memory_cap_mib, (int, float)) or not (
                0 <= self.memory_cap_mib <= MAX_CAP_MIB):
            raise ValueError(f"bagualu2.memory_cap_mib must be a number >= 0 and <= {MAX_CAP_MIB} (MiB; 0: no cap), "
                             f"got {self.memory_cap_mib!r}")
        if self.downgrade not in ("graded", "paper"):
            raise ValueError(f"bagualu2.downgrade must be graded or paper, got {self.downgrade!r}")
        if not isinstance(self.quantize, bool):
            raise ValueError(f"bagualu2.quantize must be true or false, got {self.quantize!r}")
        if not isinstance(self.report_path, str):
            raise ValueError(f"bagualu2.report_path must be a path string, got {self.report_path!r}")

    @property
    def cap_bytes(self) -> int | None:
        return int(self.memory_cap_mib * MIB) if self.memory_cap_mib > 0 and self.policy != "off" else None


@dataclass
class JobConfig:
    """What ``--job.custom_config_module bagualu2.integrations.torchtitan`` adds to torchtitan's job config."""

    bagualu2: Bagualu2Config = field(default_factory=Bagualu2Config)


# ---- the op map ---------------------------------------------------------------------------------------------------
QKV_NAMES = ("wq", "wq_a", "wq_b", "wk", "wv", "wkv_a", "wkv_b")
FFN_NAMES = (("w1", "fc1"), ("w3", "fc1"), ("w2", "fc2"))


def _is_moe(module: torch.nn.Module) -> bool:
    """A torchtitan MoE module: a router beside routed experts holding every expert's weights (``w1``/``w2``/``w3``
    of torchtitan's ``GroupedExperts``, ``mlp1_weight``/``mlp2_weight`` of gpt-oss's)."""
    experts = getattr(module, "experts", None)
    return (isinstance(getattr(module, "router", None), torch.nn.Module) and isinstance(experts, torch.nn.Module)
            and any(True for _ in experts.parameters(recurse=False)))


def op_map(part: torch.nn.Module) -> dict[str, str]:
    """``{module path: op label}`` of a torchtitan decoder (its ``layers`` a ``ModuleDict`` keyed by the global
    layer id, as a pipeline stage's part keeps it): per layer the norms (``attention_norm`` -> ``norm1``,
    ``ffn_norm`` -> ``norm2``), the attention (``core_attn``, its projections ``qkv`` and ``attn_out``), the MoE
    module (``moe``) with its ``router``, its routed experts as one op (``dispatch``: torchtitan runs all of a
    layer's experts in one call, its expert GEMMs are not modules of their own) and its shared experts
    (``shared_fc1``, ``shared_fc2``), and a dense layer's feed-forward (``mlp_fc1``, ``mlp_fc2``). The embedding,
    final norm and output layer are not ops: what they save is pinned and counted. ``ValueError`` for a model
    that is not a torchtitan decoder with MoE layers."""
    layers = getattr(part, "layers", None)
    if not isinstance(layers, torch.nn.ModuleDict):
        raise ValueError(f"{type(part).__name__} is not a torchtitan decoder: it has no ModuleDict 'layers'")
    labels: dict[str, str] = {}
    for key, layer in layers.items():
        if layer is None:
            continue
        prefix = f"layers.{key}"
        for name, label in (("attention_norm", "norm1"), ("ffn_norm", "norm2")):
            if getattr(layer, name, None) is not None:
                labels[f"{prefix}.{name}"] = label
        attention = getattr(layer, "attention", None)
        if attention is not None:
            labels[f"{prefix}.attention"] = "core_attn"
            for inner, _ in attention.named_children():
                if inner in QKV_NAMES:
                    labels[f"{prefix}.attention.{inner}"] = "qkv"
                elif inner == "wo":
                    labels[f"{prefix}.attention.{inner}"] = "attn_out"
        moe = getattr(layer, "moe", None)
        if moe is not None and _is_moe(moe):
            labels[f"{prefix}.moe"] = "moe"
            labels[f"{prefix}.moe.router"] = "router"
            labels[f"{prefix}.moe.experts"] = "dispatch"
            shared = getattr(moe, "shared_experts", None)
            if shared is not None:
                _ffn(f"{prefix}.moe.shared_experts", shared, "shared", labels)
        feed_forward = getattr(layer, "feed_forward", None)
        if feed_forward is not None:
            _ffn(f"{prefix}.feed_forward", feed_forward, "mlp", labels)
    return labels


def _ffn(path: str, module: torch.nn.Module, kind: str, labels: dict) -> None:
    for name, part in FFN_NAMES:
        if getattr(module, name, None) is not None:
            labels[f"{path}.{name}"] = f"{kind}_{part}"


def expert_group(experts: torch.nn.Module | None):
    """``(process group, degree)`` of torchtitan's expert parallelism over a routed-experts module (its weights
    sharded on the ``ep`` dimension of their device mesh), else None."""
    weight = next(experts.parameters(recurse=False), None) if isinstance(experts, torch.nn.Module) else None
    mesh = getattr(weight, "device_mesh", None)
    if mesh is None or "ep" not in (mesh.mesh_dim_names or ()):
        return None
    ep = mesh["ep"] if mesh.ndim > 1 else mesh
    return ep.get_group(), ep.size()


def padded_rows(copies: int, local_experts: int) -> int:
    """The rows torchtitan's expert-parallel dispatch hands a rank's experts for ``copies`` received routed copies:
    it pads them to ``copies + local_experts x alignment``, rounded up to the alignment (``_permute``), and the
    grouped GEMMs compute on all of them."""
    from torchtitan.models.moe import utils

    align = utils.TOKEN_GROUP_ALIGN_SIZE_M
    return -(-(copies + local_experts * align) // align) * align


def gate_report(router: torch.nn.Module, inputs, output, experts: torch.nn.Module | None = None) -> GateReport:
    """The routed rows a rank's experts compute on after a torchtitan router (``(scores, top-k indices, tokens
    per expert)``). Without expert parallelism every top-k pick of this rank's tokens goes to this rank's experts.
    Under it (``experts`` sharded on an ``ep`` mesh), one all-to-all of per-rank counts over the expert-parallel
    group gives the copies every rank's router sends here, as the dispatch will, and the report is in the rows the
    dispatch pads them to (:func:`padded_rows`), balanced routing's (each rank receiving what it sends) the mean;
    the group's ranks then agree on the gate's decision."""
    values = output if isinstance(output, tuple) else (output,)
    indices = next((v for v in values if isinstance(v, torch.Tensor) and not v.is_floating_point()), None)
    if indices is None:
        raise ValueError(f"{type(router).__name__} returns no top-k indices: not a torchtitan router")
    sent = int(indices.numel())
    sharded = expert_group(experts)
    if sharded is None:
        return GateReport(sent, sent=sent)
    group, degree = sharded
    local = experts.num_experts // degree
    counts = torch.bincount(indices.reshape(-1), minlength=experts.num_experts).view(degree, local).sum(1)
    received = torch.empty_like(counts)
    torch.distributed.all_to_all_single(received, counts, group=group)
    return GateReport(padded_rows(int(received.sum()), local), group, None, padded_rows(sent, local))


def gate_of(part: torch.nn.Module, labels: dict[str, str]):
    """The gate callable of a stage's part: :func:`gate_report` with the routed experts beside each router."""
    modules = dict(part.named_modules())
    experts_of = {modules[path]: modules.get(f"{path.rpartition('.')[0]}.experts")
                  for path, label in labels.items() if label == "router"}

    def gate(router: torch.nn.Module, inputs, output) -> GateReport:
        return gate_report(router, inputs, output, experts_of.get(router))

    return gate


def mark_routed_rows(part: torch.nn.Module, labels: dict[str, str]) -> list:
    """Under expert parallelism, mark what each routed-experts module makes from its dispatch to its combine as
    routed rows (``exec.routed``): the dispatch, a forward pre-hook torchtitan puts on the module, makes the padded
    rows and their permutation before the module's own forward, so the op's hooks alone would see them as its
    inputs. The marking starts in a pre-hook put first and ends in a hook put last (per thread). Returns the hook
    handles (none without expert parallelism)."""
    handles = []
    for path, label in labels.items():
        experts = part.get_submodule(path)
        if label != "dispatch" or expert_group(experts) is None:
            continue
        scopes: dict[int, list] = {}

        def enter(module, args, scopes=scopes):
            scope = routed()
            scope.__enter__()
            scopes.setdefault(threading.get_ident(), []).append(scope)

        def leave(module, args, output, scopes=scopes):
            open_scopes = scopes.get(threading.get_ident())
            if open_scopes:
                open_scopes.pop().__exit__(None, None, None)

        handles.append(experts.register_forward_pre_hook(enter, prepend=True))
        handles.append(experts.register_forward_hook(leave, always_call=True))
    return handles
