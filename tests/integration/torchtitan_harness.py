"""torchrun entry point of the torchtitan tests: torchtitan's own trainer on CPU with the bagualu2 converter.

Harness only (the integration patches nothing): three narrow CPU shims, each needed because torchtitan 0.2.2
assumes a GPU — its MoE kernels module imports triton at import time (a stub module stands in: the kernels serve
only the grouped-GEMM path, which is off on CPU); its device selection falls back to CUDA without an accelerator
(the modules that copied ``device_type`` / ``device_module`` get "cpu" and a CPU stand-in with the memory calls its
metrics make); its router counts tokens per expert with ``torch.histc`` on int64, which CPU lacks (its MoE module
gets a ``torch`` whose ``histc`` counts integers through float, returning int64 as CUDA does). One more shim saves
test time only: rank 0 of torchtitan's trainer sleeps 2 s after its last step "for other ranks to complete", and
here nothing needs it (the last step's collectives have completed on every rank; torchrun's agent holds the store
and waits for every worker). Then a 4-layer flavor of the DeepSeek-V3 debug model, and a probe converter that
writes, per rank and step, a digest of every gradient and the converter's micro-batch rows to
``$BAGUALU2_PROBE_DIR``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
import types

import torch


def _kernels() -> None:
    """torchtitan's MoE kernels module with its CPU implementation: the module imports triton at import time (a CPU
    machine lacks it), so its source runs with a stand-in triton in ``sys.modules`` for that moment only (torch is
    already imported; the triton kernels are never launched), and the expert-parallel permutation gets the
    module's own ``use_cpu=True`` path."""
    import functools
    import importlib.util

    class Anything(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return object()

    triton, language = types.ModuleType("triton"), Anything("triton.language")
    triton.jit, triton.language = (lambda fn=None, **_: fn if fn is not None else (lambda f: f)), language
    package = os.path.dirname(importlib.util.find_spec("torchtitan").origin)  # finds, imports nothing
    path = os.path.join(package, "models", "moe", "kernels.py")
    kernels = types.ModuleType("torchtitan.models.moe.kernels")
    kernels.__file__ = path
    saved = {name: sys.modules.get(name) for name in ("triton", "triton.language")}
    sys.modules.update({"triton": triton, "triton.language": language})
    try:
        with open(path) as source:
            exec(compile(source.read(), path, "exec"), kernels.__dict__)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    kernels.generate_permute_indices = functools.partial(kernels.generate_permute_indices, use_cpu=True)
    sys.modules[kernels.__name__] = kernels


def _shims() -> None:
    _kernels()

    import torchtitan.components.metrics
    import torchtitan.distributed.parallel_dims
    import torchtitan.distributed.utils
    import torchtitan.tools.profiling
    import torchtitan.tools.utils

    class CpuDevice:
        def __getattr__(self, name):
            return getattr(torch.cpu, name)

        def get_device_name(self, device=None):
            return "cpu"

        def get_device_properties(self, device=None):
            return types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

        def memory_stats(self, device=None):
            return {}

        def reset_peak_memory_stats(self, device=None):
            pass

        def empty_cache(self):
            pass

        def set_device(self, device):
            pass

        def current_device(self):
            return 0

        def synchronize(self, device=None):
            pass

    device = CpuDevice()
    for module in (torchtitan.tools.utils, torchtitan.components.metrics, torchtitan.distributed.utils,
                   torchtitan.distributed.parallel_dims, torchtitan.tools.profiling):
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = device

    import torchtitan.models.moe.moe as moe

    class TorchWithIntegerHistc(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def histc(input, bins=100, min=0, max=0, *, out=None):
            if not input.is_floating_point():
                return torch.histc(input.float(), bins=bins, min=min, max=max).to(input.dtype)
            return torch.histc(input, bins=bins, min=min, max=max, out=out)

    moe.torch = TorchWithIntegerHistc("torch")

    import torchtitan.models.llama4.infra.parallelize as fsdp_setup  # DeepSeek-V3's FSDP set-up is Llama 4's

    divide_by_one = fsdp_setup.disable_fsdp_gradient_division

    def reduce_by_sum(model):
        divide_by_one(model)
        for module in model.modules():
            if isinstance(module, torch.distributed.fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp_setup.disable_fsdp_gradient_division = reduce_by_sum

    if os.environ.get("BAGUALU2_PROBE_GROUPED_MM") == "1":
        import torchtitan.models.deepseek_v3.model.args as deepseek_args

        deepseek_args.has_cuda_capability = lambda major, minor: True  # torch._grouped_mm runs on CPU too


def _flavor() -> None:
    """Debug models small enough for two CPU cores: DeepSeek-V3's cut to 4 layers, Qwen3 MoE's to 2 layers and 16
    experts (top-4; its experts on the per-expert loop, as DeepSeek-V3's debug model chooses on CPU by itself)."""
    from torchtitan.models.deepseek_v3 import deepseekv3_args
    from torchtitan.models.qwen3 import qwen3_args

    args = copy.deepcopy(deepseekv3_args["debugmodel"])
    args.n_layers = 4
    deepseekv3_args["debugmodel_4l"] = args
    args = copy.deepcopy(qwen3_args["debugmodel_moe"])
    args.n_layers = 2
    args.moe_args.num_experts, args.moe_args.top_k, args.moe_args.use_grouped_mm = 16, 4, False
    qwen3_args["debugmodel_moe_2l"] = args


class Probe:
    """Writes per step: a digest of every gradient of this rank's parts, and the bagualu2 converter's rows."""

    def __init__(self, job_config, parallel_dims):
        self.dir = os.environ["BAGUALU2_PROBE_DIR"]
        self.rank = int(os.environ.get("RANK", "0"))
        self.steps = []
        self.bias = float(os.environ.get("BAGUALU2_PROBE_BIAS", "0"))

    def convert(self, model):
        pass

    def post_optimizer_hook(self, model_parts):
        digest = hashlib.sha256()
        for part in model_parts:
            for name, param in sorted(part.named_parameters()):
                if param.grad is not None:
                    grad = param.grad.detach()
                    grad = grad.to_local() if hasattr(grad, "to_local") else grad  # this rank's shard (FSDP, EP)
                    digest.update(name.encode())
                    digest.update(grad.contiguous().numpy().tobytes())
        self.steps.append(digest.hexdigest())
        if self.bias and len(self.steps) == 1:  # from step 2 on, the first half of the experts win every pick
            for part in model_parts:
                for module in part.modules():
                    bias = getattr(module, "expert_bias", None)
                    if isinstance(bias, torch.Tensor) and bias.numel() > 1:
                        with torch.no_grad():
                            bias[: bias.numel() // 2] += self.bias
        with open(os.path.join(self.dir, f"grads.{self.rank}.json"), "w") as out:
            json.dump(self.steps, out)


def setup() -> None:
    """torchtitan importable and runnable on a CPU in this process: the kernels' and devices' stand-ins, the flavors."""
    _shims()
    _flavor()


def _no_final_wait() -> None:
    """torchtitan's trainer module gets a ``time`` whose ``sleep`` returns at once (test time only, see above)."""
    import time

    import torchtitan.train

    class TimeWithoutTheFinalWait(types.ModuleType):
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def sleep(seconds):
            pass

    torchtitan.train.time = TimeWithoutTheFinalWait("time")


def prepare() -> None:
    """Everything a run needs before its flags, once per process: the stand-ins, the flavors, the converters
    registered, no final wait. torchrun's agent of ``forkrun.py`` calls it before it forks the workers."""
    torch.set_num_threads(1)
    setup()
    from torchtitan.protocols.model_converter import register_model_converter

    import bagualu2.integrations.torchtitan  # noqa: F401  (registers the "bagualu2" converter)

    register_model_converter(Probe, "probe")
    _no_final_wait()


def main(argv: list[str]) -> None:
    """torchtitan's trainer on ``argv`` (its own ``main`` parses ``sys.argv`` as it was when torchtitan imported:
    a forked worker gets its flags through a ``ConfigManager`` defaulting to ``argv``)."""
    import torchtitan.train
    from torchtitan.train import Trainer

    class Flags(torchtitan.train.ConfigManager):
        def parse_args(self, args: list[str] | None = None):
            return super().parse_args(list(argv) if args is None else args)

    torchtitan.train.ConfigManager = Flags
    torchtitan.train.main(Trainer)


if __name__ == "__main__":
    prepare()
    main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # The run is done and its files are written: skip interpreter teardown, whose gloo
    # thread destructors can abort under load.
    os._exit(0)
