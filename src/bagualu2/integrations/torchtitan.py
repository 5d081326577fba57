"""Per-micro-batch activation provisioning inside torchtitan, as a model converter.

    torchrun ... -m torchtitan.train --job.custom_config_module bagualu2.integrations.torchtitan \\
        --model.converters bagualu2 --bagualu2.memory_cap_mib 96 --bagualu2.policy flexible

Importing this module registers the converter ``"bagualu2"`` with torchtitan (when torchtitan imports) and gives
torchtitan's job config a ``[bagualu2]`` section (:class:`Bagualu2Config`, through ``JobConfig`` here and
``--job.custom_config_module``). ``convert(model)`` runs on the whole model on the meta device, before the pipeline
split; it checks the model and puts two closures on it (a forward pre-hook and a forward hook), which the split's
deep copies keep. At the first forward the pipeline schedule runs on a stage's part of the model, the part gets a
:class:`~.torchtitan_stage.StageProvisioner`: the part is instrumented from outside (:func:`op_map`, the exec
layer's hooks), its graph is traced on that micro-batch (its arguments and keyword arguments: flex attention's
masks), and from then on every micro-batch of the schedule runs Algorithm 1's budget (from the stage's in-flight
count under torchtitan's 1F1B), the greedy plan on the traced graph, the gate's deferred re-plan, and feeds the
bytes it kept back into the budget. A forward outside the
schedule (torch's shape inference before the first step) runs unplanned and is not counted.

This module imports without torchtitan; the converter needs it (``pip install "bagualu2[torchtitan]"``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tomllib
import weakref
from collections.abc import Mapping

import torch

from bagualu2.costmodel.validate import require_fields

from .torchtitan_config import (MIB, POLICIES, SCHEDULES, Bagualu2Config, JobConfig, gate_report, op_map,
                                padded_rows)
from .torchtitan_stage import (ACTIVE_FORWARD, ScheduleInfo, StageProvisioner, check_report_path, read_report,
                               scheduled_forward)


#: the decoders :func:`op_map` reads: importing this module gives their train specs a metrics processor builder that
#: hands torchtitan's metrics processor to the live converters (the spec is otherwise torchtitan's own)
MODELS = ("deepseek_v3", "qwen3", "llama4", "gpt_oss")
_CONVERTERS: "weakref.WeakSet[Bagualu2Converter]" = weakref.WeakSet()
_CONVERTED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # the models a converter put its hooks on


def _warn(message: str) -> None:
    """``message`` through torchtitan's logger (the ``bagualu2`` logger without torchtitan)."""
    try:
        from torchtitan.tools.logging import logger
    except ImportError:
        logger = logging.getLogger("bagualu2")
    logger.warning(message)


def _section(config) -> Bagualu2Config:
    """The ``[bagualu2]`` section as a :class:`Bagualu2Config` checked now (a field set after it was built, a dict,
    another dataclass): one ``ValueError`` naming what does not fit."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if isinstance(config, Mapping):
        config = dict(config)
    if not isinstance(config, dict):
        raise ValueError(f"the job config's bagualu2 section must be a Bagualu2Config or a mapping of its fields, got "
                         f"{type(config).__name__}")
    require_fields("bagualu2", config, [f.name for f in dataclasses.fields(Bagualu2Config)])
    return Bagualu2Config(**config)


def _check_toml_section(path) -> None:
    """``ValueError`` if the job's TOML file sets ``bagualu2`` to something else than a table (``bagualu2 = 5``):
    the config parser replaces such a value by the section's defaults without a word."""
    if not isinstance(path, str) or not path:
        return
    try:
        with open(path, "rb") as f:
            value = tomllib.load(f).get("bagualu2", {})
    except (OSError, tomllib.TOMLDecodeError):  # the config parser read it, or said why not
        return
    if not isinstance(value, dict):
        raise ValueError(f"{path}: bagualu2 must be a table ([bagualu2] with its fields below it), got "
                         f"{type(value).__name__} {value!r:.40}")


# ---- the converter --------------------------------------------------------------------------------------------------
class Bagualu2Converter:
    """torchtitan's model-converter protocol (``__init__(job_config, parallel_dims)``, ``convert(model)``,
    ``post_optimizer_hook(model_parts)``); see the module docstring. ``provisioners`` holds this rank's
    :class:`~.torchtitan_stage.StageProvisioner` per pipeline stage once its first micro-batch ran."""

    def __init__(self, job_config, parallel_dims):
        _check_toml_section(getattr(getattr(job_config, "job", None), "config_file", None))
        config = getattr(job_config, "bagualu2", None)
        if config is None:
            _warn("bagualu2: the job config has no [bagualu2] section (set job.custom_config_module = "
                           "\"bagualu2.integrations.torchtitan\"): running with its defaults, no memory cap")
            config = Bagualu2Config()
        else:  # tyro gives back the dataclass, a dict may come from elsewhere; either may have been changed since
            config = _section(config)  # it was built, so its fields are checked again here
        self.config = config
        parallelism = job_config.parallelism
        mode = getattr(job_config.activation_checkpoint, "mode", "none")
        if mode != "none":
            raise ValueError("activation_checkpoint.mode must be none with the bagualu2 converter: it decides what "
                             f"each micro-batch recomputes; got {mode!r}")
        compile_config = getattr(job_config, "compile", None)
        if getattr(compile_config, "enable", False) and "model" in (getattr(compile_config, "components", ()) or ()):
            raise ValueError("compile.enable with compile.components including model is not supported with the "
                             "bagualu2 converter: a compiled block hides the modules its plans name (compile the "
                             "loss only, or turn compile off)")
        if parallel_dims.tp_enabled or parallel_dims.cp_enabled:
            raise ValueError("parallelism.tensor_parallel_degree and parallelism.context_parallel_degree must be 1 "
                             "with the bagualu2 converter (it supports pipeline, data and expert parallelism), got "
                             f"{getattr(parallel_dims, 'tp', '?')} and {getattr(parallel_dims, 'cp', '?')}")
        self.expert_parallel_degree = parallel_dims.ep if parallel_dims.ep_enabled else 1
        backend = getattr(parallelism, "expert_parallel_comm_backend", "standard")
        if self.expert_parallel_degree > 1 and backend != "standard":
            raise ValueError("parallelism.expert_parallel_comm_backend must be standard with the bagualu2 converter "
                             f"(its gate counts the rows torchtitan's all-to-all dispatch pads), got {backend!r}")
        pipelined = parallel_dims.pp_enabled
        if pipelined and str(parallelism.pipeline_parallel_schedule).lower() not in {s.lower() for s in SCHEDULES}:
            raise ValueError(f"parallelism.pipeline_parallel_schedule must be one of {', '.join(SCHEDULES)} with "
                             f"the bagualu2 converter, got {parallelism.pipeline_parallel_schedule!r}")
        if pipelined and getattr(parallelism, "pipeline_parallel_schedule_csv", None):
            raise ValueError("parallelism.pipeline_parallel_schedule_csv must be empty with the bagualu2 converter "
                             "(a schedule from a file replaces 1F1B, whose in-flight micro-batches the budgets "
                             f"assume), got {parallelism.pipeline_parallel_schedule_csv!r}")
        check_report_path(config.report_path, int(os.environ.get("WORLD_SIZE", "1")),
                          stages=getattr(parallel_dims, "pp", 1) if pipelined else 1)  # 1F1B: a stage a rank
        local = job_config.training.local_batch_size
        # without a pipeline each forward (one per gradient-accumulation micro-step) is backwarded before the next
        size = parallelism.pipeline_parallel_microbatch_size if pipelined else local
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            name = "parallelism.pipeline_parallel_microbatch_size" if pipelined else "training.local_batch_size"
            raise ValueError(f"{name} must be an integer >= 1, got {size!r}")
        self.schedule = ScheduleInfo(pipelined=pipelined, num_microbatches=max(local // size, 1))
        model_config = getattr(job_config, "model", None)
        self.model_name = f"{getattr(model_config, 'name', '?')} / {getattr(model_config, 'flavor', '?')}"
        self.provisioners: dict[int, object] = {}
        self.unplanned: set[int] = set()  # pipeline stages without a transformer layer: they run unplanned
        self.step = 0
        self._counted = False  # whether self.step went on from the optimizer's count (post_optimizer_hook)
        self._tracing = False
        self.metrics = None  # torchtitan's metrics processor, once the trainer built it (a supported model)
        _CONVERTERS.add(self)

    def convert(self, model: torch.nn.Module) -> None:
        labels = op_map(model)
        if "router" not in labels.values():  # one ValueError now for a model this converter cannot instrument
            raise ValueError(f"model.name / model.flavor {self.model_name}: {type(model).__name__} has no MoE layer "
                             f"(a module with a router and experts); the bagualu2 converter runs the MoE flavors of "
                             f"{', '.join(MODELS)}")
        if self.expert_parallel_degree > 1 and not all(getattr(model.get_submodule(path), "use_grouped_mm", False)
                                                       for path, label in labels.items() if label == "dispatch"):
            # the per-expert loop saves one tensor per expert, whose rows the gate cannot know before the dispatch
            raise ValueError("expert_parallel_degree > 1 with the bagualu2 converter needs torchtitan's grouped-GEMM "
                             "experts (moe_args.use_grouped_mm, torchtitan's choice on GPUs of compute capability "
                             "9.0 and later), not the per-expert loop")
        if model in _CONVERTED:  # two converters on one model would put two sets of hooks on it
            raise ValueError(f"{type(model).__name__} is converted by bagualu2 already (is bagualu2 listed twice in "
                             "model.converters?)")
        # plain functions (closures): the pipeline split deep-copies the model with its hooks, and a bound method
        # would be copied with its converter; a function is not copied
        def before(part, args, kwargs):
            return self._before(part, args, kwargs)

        def after(part, args, kwargs, output):
            return self._after(part, args, kwargs, output)

        model.register_forward_pre_hook(before, with_kwargs=True)
        model.register_forward_hook(after, with_kwargs=True, always_call=True)
        _CONVERTED.add(model)

    def _provisioner(self, part: torch.nn.Module, args, kwargs):
        where = scheduled_forward(self.schedule)
        if where is None:
            return None, None
        stage_index, num_stages, microbatch = where
        if stage_index in self.unplanned:
            return None, None
        found = self.provisioners.get(stage_index)
        if found is None and not any(layer is not None for layer in getattr(part, "layers", {}).values()):
            self.unplanned.add(stage_index)  # the split left it only the norm and the output (or the embedding)
            _warn(f"bagualu2: pipeline stage {stage_index} holds no transformer layer: it runs unplanned")
            return None, None
        if found is None:
            self.step = self._steps_taken()  # a resumed run: the steps its checkpoint had taken
            self._tracing = True  # the trace runs the part: its forwards are not micro-batches
            try:
                found = self.provisioners[stage_index] = StageProvisioner(
                    part, args, kwargs, config=self.config, stage_index=stage_index, num_stages=num_stages,
                    num_microbatches=self.schedule.num_microbatches,
                    expert_parallel_degree=self.expert_parallel_degree, step=self.step)
            finally:
                self._tracing = False
        return found, microbatch

    def _before(self, part, args, kwargs):
        if self._tracing:
            return None
        provisioner, microbatch = self._provisioner(part, args, kwargs)
        if provisioner is not None:
            provisioner.begin(microbatch)
        return None

    def _after(self, part, args, kwargs, output):
        provisioner = ACTIVE_FORWARD.get()
        if provisioner is not None:
            provisioner.end(failed=output is None)
        return None

    def _steps_taken(self) -> int:
        """The optimizer steps taken so far: as the optimizer's state counts them where it does (torchtitan's Adam
        and AdamW keep a step per parameter, restored with a checkpoint, so a resumed run counts on from the step it
        resumed at), else as this converter counted them."""
        optimizers = getattr(self.metrics, "optimizers", None)
        counted = []  # a parameter that had no gradient at a step (an expert nothing reached) lags: the largest
        for optimizer in getattr(optimizers, "optimizers", None) or ():
            for state in getattr(optimizer, "state", {}).values():
                step = state.get("step") if isinstance(state, Mapping) else None
                if step is not None:
                    try:
                        counted.append(int(step.item() if isinstance(step, torch.Tensor) else step))
                    except (TypeError, ValueError, RuntimeError):
                        return self.step
        return max(counted, default=self.step)

    def post_optimizer_hook(self, model_parts) -> None:
        # the optimizer's count is read at the launch's first step only (one read per parameter, a device sync
        # each where the steps live on the device); then the steps are counted here
        if not self._counted and self.config.report_path and self.provisioners and self.metrics is None:
            _warn("bagualu2: no metrics processor reached bagualu2 (its train spec is not one it wrapped: "
                  f"{', '.join(MODELS)}, registered after this import), so it cannot read the optimizer's step count "
                  "and counts steps from this launch's first: a resumed run's report_path starts again at step 1")
        self.step = self.step + 1 if self._counted else max(self._steps_taken(), self.step + 1)
        self._counted = True
        for provisioner in self.provisioners.values():
            provisioner.end_step(self.step)
        metrics = self.metrics
        if metrics is not None and self.provisioners and metrics.should_log(self.step):
            metrics.logger.log(self.step_metrics(), self.step)

    def step_metrics(self) -> dict[str, float]:
        """The last step's memory per stage and micro-batch (MiB), as torchtitan's metric loggers take them:
        ``bagualu2/stage{s}/kept_mib/mb{m}``, ``.../budget_mib/mb{m}``, and ``bagualu2/stage{s}/replanned``."""
        out: dict[str, float] = {}
        for stage, provisioner in sorted(self.provisioners.items()):
            rows = provisioner.last_rows
            for row in rows:
                key = f"mb{row['forward']}"
                out[f"bagualu2/stage{stage}/kept_mib/{key}"] = row["kept_bytes"] / MIB
                if row["budget_bytes"] is not None:
                    out[f"bagualu2/stage{stage}/budget_mib/{key}"] = row["budget_bytes"] / MIB
            out[f"bagualu2/stage{stage}/replanned"] = float(sum(bool(row["downgraded_layers"]) for row in rows))
        return out


def unlisted_section(job_config) -> str | None:
    """The warning for a job whose ``[bagualu2]`` section sets a field while ``model.converters`` does not list
    ``bagualu2`` (the section alone provisions nothing), else None."""
    section = getattr(job_config, "bagualu2", None)
    converters = getattr(getattr(job_config, "model", None), "converters", None) or ()
    if isinstance(converters, str):  # torchtitan's is a list; a config built elsewhere may give "a,b"
        converters = [name.strip() for name in converters.split(",") if name.strip()]
    if section is None or "bagualu2" in converters:
        return None
    try:
        config = _section(section)
    except ValueError as exc:  # what the converter would refuse: still not listed
        return f"bagualu2: {exc}; and model.converters does not list bagualu2, so nothing reads the section"
    changed = [f.name for f in dataclasses.fields(Bagualu2Config) if getattr(config, f.name) != f.default]
    if not changed:
        return None
    listed = ", ".join(map(str, converters)) or "none"
    return (f"bagualu2: the [bagualu2] section sets {', '.join(changed)}, but model.converters ({listed}) does not "
            "list bagualu2, so nothing is provisioned; add --model.converters bagualu2")


def _metrics_builder(original):
    """torchtitan's metrics processor builder (``original``, or its default), handing what it builds to the live
    converters, which log each step's memory through its loggers (TensorBoard, W&B); it also says when the job's
    ``[bagualu2]`` section goes unread (:func:`unlisted_section`)."""

    def build(job_config, parallel_dims, model_args=None):
        from torchtitan.components.metrics import build_metrics_processor

        unread = unlisted_section(job_config)
        if unread is not None:
            _warn(unread)
        processor = (original or build_metrics_processor)(job_config, parallel_dims, model_args)
        for converter in list(_CONVERTERS):
            converter.metrics = processor
        return processor

    return build


def _register() -> None:
    try:
        from torchtitan.protocols.model_converter import register_model_converter
    except ImportError:  # torchtitan is not installed (or cannot import here): nothing to register
        return
    try:
        register_model_converter(Bagualu2Converter, "bagualu2")
    except AssertionError:  # registered already (this module imported under another name)
        return
    from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

    for name in MODELS:  # a spec registered from outside takes precedence over torchtitan's own of that name
        spec = get_train_spec(name)
        try:
            register_train_spec(name, dataclasses.replace(
                spec, build_metrics_processor_fn=_metrics_builder(spec.build_metrics_processor_fn)))
        except ValueError:  # one registered from outside before this import: it stays as it is
            _warn(f"bagualu2: the train spec {name!r} was registered before bagualu2.integrations.torchtitan was "
                  "imported: its metrics loggers get no bagualu2 memory metrics (the log and report_path do)")


_register()

__all__ = ["MODELS", "POLICIES", "Bagualu2Config", "Bagualu2Converter", "JobConfig", "StageProvisioner",
           "gate_report", "op_map", "padded_rows", "read_report", "unlisted_section"]
