"""One training session on this rank: process groups, the model's stages, the schedule, the step loop."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


from . import checkpoint, startup
from .steps import finite, flops_per_token, lr_at, spikes_of
from .metrics import MetricsWriter, Progress, mfu, print_summary
from .chunks import ChunkModule
from .model import GLMMoEModel
from .parallel import build_groups, is_expert_parameter, reduce_gradients
from .policies import OOM_EXIT_CODE, fallback, fixed_plans
from .provision import Provisioner
from .resilience import NONFINITE_EXIT_CODE, Guard
from .restarts import (RunState, lock_directory, lock_wait_s, read_refusal, state_directory, sweep_finished_runs,
                       write_refusal)
from .routing import record_routing, routing_stats
from .watchdog import find_cause
from bagualu2.exec import ActivationOutOfMemoryError
from bagualu2.sim import native_execution


WORKSPACE_BYTES = 1 << 30  # allocator slack, recompute and communication buffers, cuBLAS workspaces


def card_bytes(config, stage: int, cap_bytes: int) -> int:
    """The emulated card of a CUDA run: the cost model's static bytes of the stage (weights, fp32 gradients, Adam
    states), the activation cap ``M_max``, the last stage's logits and ``WORKSPACE_BYTES``."""
    from bagualu2.costmodel.memory import logits_bytes, static_bytes

    logits = logits_bytes(config.model, config.parallel) if stage == config.pp - 1 else 0
    return static_bytes(config.model, config.parallel, stage=stage) + cap_bytes + logits + WORKSPACE_BYTES


def _out_of_memory_cause(exc: BaseException | None) -> BaseException | None:
    """The out-of-memory error (activation cap or CUDA allocator) behind ``exc``, if any."""
    return find_cause(exc, lambda e: isinstance(e, (ActivationOutOfMemoryError, torch.cuda.OutOfMemoryError)))


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Session:
    def __init__(self, run):  # a loop.Run
        self.run, config = run, run.config
        self.config = config
        if "WORLD_SIZE" in os.environ:
            backend = "nccl" if config.device == "cuda" else "gloo"
            if config.device == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=config.collective_timeout_s),
                                    store=startup.store(), rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]))
        self.device = (torch.device("cuda", torch.cuda.current_device()) if config.device == "cuda"
                       else torch.device("cpu"))
        self.groups = groups = build_groups(pp=config.pp, dp=config.dp, ep=config.ep,
                                            timeout_s=config.collective_timeout_s)
        self.restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.resume = config.resume or (self.restarts > 0 and bool(config.checkpoint_dir))
        state_dir = state_directory(config.checkpoint_dir, config.metrics_file)
        # the run's state is in a temp folder of its own (no checkpoint directory or metrics file was given)
        self.in_temp_folder = state_dir is not None and not (config.checkpoint_dir or config.metrics_file)
        self._refuse_another_runs_directory(state_dir)  # before this launch touches the directory
        self.run_state = RunState(state_dir, fresh=self.restarts == 0 and not config.resume,
                                  first_launch=self.restarts == 0)
        if self.restarts == 0:  # the history a restart of this launch reads (saved once --resume is accepted)
            self.run_state.launched(config.policy, fresh=not config.resume, is_logger=False)
        self.guard = Guard(timeout_s=config.collective_timeout_s, rank=groups.rank, world_size=groups.world_size,
                           launch=self.restarts, run_state=self.run_state)
        policy = self._policy_in_force(config.policy)
        if policy != config.policy:  # the operator's fallback after running out of memory
            config = self.config = config.with_overrides(policy=policy)
        self.counts = {"skipped": 0, "checkpoint_failures": 0, "reruns": 0}  # over the run's steps (checkpointed)
        self.parallel = config.parallel
        torch.manual_seed(config.seed)
        model = GLMMoEModel(config.model, ep_group=groups.ep_group)
        record_routing(model)  # the balancing's load and the metrics' routing, from outside
        self.local_layers = [i for c in range(config.vp) for i in self._chunk_layers(c)]
        self._prune(model)
        self.model = model.to(self.device)
        if config.device == "cuda":  # emulate a card of static + activation cap + logits + workspace bytes
            self.card_bytes = card_bytes(config, groups.pp_rank, run.cap_bytes)
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.card_bytes / total), self.device)
        self.provisioner = Provisioner(config.model, self.parallel, run.hardware, stage=groups.pp_rank,
                                       cap_bytes=run.cap_bytes, ep_group=groups.ep_group,
                                       downgrade=config.downgrade, dual=config.schedule == "runtime"
                                       and (config.pp > 1 or config.combined_1f1b), exclude=[model],
                                       fixed=fixed_plans(config, groups.pp_rank, run.cap_bytes),
                                       capped=config.policy != "ideal", prediction_scale=config.prediction_scale,
                                       execution=native_execution(config.policy))
        self.params = [(self._global_name(n), p) for n, p in model.named_parameters()]
        self.optimizer = torch.optim.AdamW([p for _, p in self.params], lr=config.lr,
                                           weight_decay=config.weight_decay, fused=True)  # one kernel per tensor
        self.chunks = []
        self.schedule = None
        if config.pp > 1:  # torch.distributed.pipelining (1.4 s to import) only where there is a pipeline
            from .pipeline import RuntimeSchedule, build_stages, plain_schedule

            stages = build_stages(model, self.parallel, pp_rank=groups.pp_rank, provisioner=self.provisioner,
                                  device=self.device, group=groups.pp_group,
                                  micro_batch_shape=(config.model.micro_batch_size, config.model.seq_length))
            self.chunks = [stage.submod for stage in stages]
            self.schedule = (RuntimeSchedule(stages, self.parallel, loss_fn=_loss, provisioner=self.provisioner)
                             if config.schedule == "runtime" else plain_schedule(stages, self.parallel, loss_fn=_loss))
        else:
            self.chunks = [ChunkModule(model, stage_index=0, num_stages=1, chunk=0, layers=range(len(model.layers)),
                                       provisioner=self.provisioner)]
        self.is_last = groups.pp_rank == config.pp - 1
        gc.collect()  # what set-up made (graphs, warmed plans) never needs scanning again: no later GC pauses
        gc.freeze()
        self.start_step = 0

    def _refuse_another_runs_directory(self, state_dir: str | None) -> None:
        """A checkpoint directory another launch is running in (its rank 0 holds the directory's lock) is refused:
        the two would resume from and delete each other's checkpoints; rank 0 keeps the lock for the life of its
        process. So is a launch without ``--resume`` into a checkpoint directory that holds checkpoints (its
        restart would resume from the newest there, another run's, and retention would delete its own), and so
        are torchrun's restarts of it (rank 0 reads and tells every rank)."""
        config, groups = self.config, self.groups
        box: list[str | None] = [None]
        self.directory_lock = None  # rank 0's open lock file: the lock lasts as long as this process
        if groups.rank == 0 and config.checkpoint_dir:  # a restart waits for its previous attempt's rank 0 to exit
            wait_s = lock_wait_s(config.collective_timeout_s, restart=self.restarts > 0)
            self.directory_lock, busy = lock_directory(config.checkpoint_dir, wait_s=wait_s)
            if busy is not None:
                box[0] = f"--checkpoint-dir {config.checkpoint_dir}: {busy}; give another directory"
        elif groups.rank == 0 and self.in_temp_folder:
            self.directory_lock, _ = lock_directory(state_dir)  # held, so that no other launch's sweep removes it
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        message = box[0]
        if message is None and self.restarts > 0:
            box = [read_refusal(state_dir) if groups.rank == 0 else None]
            if dist.is_initialized():
                dist.broadcast_object_list(box, src=0)
            message = box[0]
        elif message is None and not config.resume and config.checkpoint_dir:
            earlier = checkpoint.step_dirs(config.checkpoint_dir)  # a collective: every rank sees rank 0's list
            if earlier:
                message = (f"--checkpoint-dir {config.checkpoint_dir} holds the checkpoints of an earlier run "
                           f"({', '.join(earlier[-2:])}); continue that run with --resume, or give an empty "
                           "directory")
                if groups.is_logger:
                    write_refusal(state_dir, message)
        if message is not None:
            self._user_error(message)

    def _policy_in_force(self, policy: str) -> str:
        """After a torchrun restart, the policy to run, as rank 0 reads the state (broadcast: every rank runs the
        same): the fallback of a policy that ran out of memory, else the one the last launch ran (a fallback stays
        in force), else ``policy``."""
        if self.restarts == 0:
            return policy
        box = [None, None]
        if self.groups.rank == 0:
            box = [self.run_state.last_oom(), self.run_state.policy_in_force()]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        incident, previous = box
        return fallback(incident["policy"]) if incident is not None else previous or policy

    # ---- model pieces -------------------------------------------------------------------------------------------
    def _chunk_layers(self, chunk: int) -> range:
        from bagualu2.costmodel.build import chunk_layers

        return chunk_layers(self.config.model, self.parallel, stage=self.groups.pp_rank, chunk=chunk)

    def _prune(self, model: GLMMoEModel) -> None:
        """Drop what this rank does not run (after initialising the whole model: the same weights as one
        process)."""
        keep = set(self.local_layers)
        for index in range(len(model.layers)):
            if index not in keep:
                model.layers[index] = torch.nn.Identity()
        num_stages = self.config.pp * self.config.vp
        stages = {c * self.config.pp + self.groups.pp_rank for c in range(self.config.vp)}
        if 0 not in stages and not (num_stages - 1 in stages and model.output is None):
            model.embedding = None
        if num_stages - 1 not in stages:
            model.final_norm = None
            model.output = None

    def _global_name(self, name: str) -> str:
        """Parameter names with global expert ids (``...experts.<local>...`` -> the expert's global id)."""
        if not is_expert_parameter(name):
            return name
        head, tail = name.split(".experts.", 1)
        local, rest = tail.split(".", 1)
        layer = int(head.split(".")[1])
        moe = self.model.layers[layer].mlp
        return f"{head}.experts.{moe.first_expert + int(local)}.{rest}"

    def _moes(self):
        return [layer.mlp for layer in self.model.layers if getattr(layer, "is_moe", False)]

    # ---- checkpoint state ---------------------------------------------------------------------------------------
    def _state(self, step: int) -> dict:
        model_state = {name: p.data for name, p in self.params}
        for layer in self.local_layers:
            if getattr(self.model.layers[layer], "is_moe", False):
                model_state[f"layers.{layer}.mlp.expert_bias"] = self.model.layers[layer].mlp.expert_bias
        optim = {}
        for name, p in self.params:
            state = self.optimizer.state[p]
            if not state:  # a fresh optimizer: AdamW's lazy initial state, so a load fills it in place
                state.update(step=torch.zeros((), dtype=torch.float32, device=p.device),  # fused AdamW's step
                             exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            optim[name] = state
        extra = {"step": step, "data": self.run.batches.state_dict(), "provisioner": self.provisioner.state_dict(),
                 "counts": self.counts}
        return {"model": model_state, "optim": optim,
                f"rank{self.groups.rank}": {"extra": checkpoint.pack_json(extra, size=1 << 16),
                                            **checkpoint.rng_state()}}

    def _run_flags(self) -> dict:
        """What the run's numbers depend on beyond the checkpoint's tensors and the data loader's state (which
        checks the seed and the corpus), by flag: a resume must give the same (``checkpoint.load``). The plans'
        flags (policy, cap, hardware, schedule) choose between recompute and offload, which change no numbers;
        the layout and the micro-batch count may change (docs/trainer.md)."""
        config = self.config
        return {"--recipe": dataclasses.asdict(config.model), "--seed": config.seed, "--lr": config.lr,
                "--warmup-steps": config.warmup_steps, "weight_decay": config.weight_decay,
                "--bias-update-rate": config.bias_update_rate, "--spike-rate": config.spike_rate,
                "--spike-max": config.spike_max}

    def _resume(self) -> None:
        found = checkpoint.find_latest(self.config.checkpoint_dir)
        if found is None:
            if self.groups.rank == 0:
                print(f"note: no complete checkpoint in {self.config.checkpoint_dir}; starting from step 0",
                      file=sys.stderr, flush=True)
            return
        state = self._state(0)
        path, step = checkpoint.load_latest(self.config.checkpoint_dir, state, run=self._run_flags(), found=found)
        mine = state[f"rank{self.groups.rank}"]
        extra = checkpoint.unpack_json(mine.pop("extra"))
        if extra.get("step") != step:  # every rank saved the step it agreed on; only an edited manifest differs
            raise checkpoint.CheckpointError(f"checkpoint {path}: its manifest records step {step}, its ranks saved "
                                             f"step {extra.get('step')}")
        checkpoint.set_rng_state(mine)
        self.run.batches.load_state_dict(extra["data"])
        self.provisioner.load_state_dict(extra["provisioner"])
        self.counts.update(extra.get("counts", {}))
        self.start_step = step

    # ---- steps --------------------------------------------------------------------------------------------------
    def _microbatches(self, step: int):
        m, d = self.config.num_microbatches, self.groups.dp_rank
        inputs, targets, domains = [], [], []
        for i in range(m):
            x, y, domain = self.run.batches.micro_batch(step, d * m + i)
            inputs.append(torch.from_numpy(x))
            targets.append(torch.from_numpy(y))
            domains.append(domain)
        return torch.cat(inputs).to(self.device), torch.cat(targets).to(self.device), domains

    def _set_spikes(self, step: int) -> None:
        groups = self.groups
        spikes = spikes_of(self.config, step, groups.dp_rank // groups.ep, self.config.num_microbatches, groups.ep,
                           self.config.model.top_k)
        for chunk in self.chunks:
            chunk.next_microbatch = 0
            chunk.spikes = {i: (target, picks[groups.ep_rank]) for i, (target, picks) in spikes.items()}

    def _run_step(self, step: int) -> tuple[float, int]:
        """Forward and backward of every micro-batch; returns (sum of this rank's micro-batch losses, count)."""
        inputs, targets, _ = self._microbatches(step)
        m = self.config.num_microbatches
        if self.schedule is not None:
            losses: list = []
            if self.groups.pp_rank == 0:
                self.schedule.step(inputs, target=targets if self.is_last else None, losses=losses)
            elif self.is_last:
                self.schedule.step(target=targets, losses=losses)
            else:
                self.schedule.step()
            return (sum(float(loss.detach()) for loss in losses), len(losses))
        b = self.config.model.micro_batch_size
        total = 0.0
        chunk = self.chunks[0]
        if self.config.combined_1f1b:
            total = self._run_paired(chunk, inputs, targets)
        else:
            for i in range(m):  # pp = 1: the cost model's order (F_i, B_i)
                loss = _loss(chunk(inputs[i * b:(i + 1) * b]), targets[i * b:(i + 1) * b])
                loss.backward()
                total += float(loss.detach())
        for _, p in self.params:
            if p.grad is not None:
                p.grad.div_(m)
        return total, m

    def _run_paired(self, chunk: ChunkModule, inputs, targets) -> float:
        """No pipeline, ``paired``: the cost model's combined-1F1B order; each F_(i+1) B_i is one fused point, run
        by the dual-batch executor in the policy's order (``Provisioner.point``: the all-to-alls of one beside the
        other's compute). With a pipeline the ``RuntimeSchedule`` runs the same points.
        Returns the sum of the micro-batch losses."""
        from bagualu2.costmodel import points

        b, provisioner = self.config.model.micro_batch_size, self.provisioner
        losses: dict[int, torch.Tensor] = {}

        def forward(i: int) -> None:
            losses[i] = _loss(chunk(inputs[i * b:(i + 1) * b]), targets[i * b:(i + 1) * b])

        for group in points(self.parallel):
            if len(group) == 2:
                x, y = (step.microbatch for step in group)
                provisioner.point(forward=(0, x), backward=(0, y), previous=None, following=None,
                                  run_forward=lambda x=x: forward(x), run_backward=losses[y].backward)
            elif group[0].kind == "F":
                provisioner.prepare(0, group[0].microbatch)
                forward(group[0].microbatch)
                provisioner.flush_offloads()  # its copies start now, as after every point
            else:
                losses[group[0].microbatch].backward()
        return sum(float(loss.detach()) for loss in losses.values())

    def _balance(self) -> None:
        """Aux-loss-free balancing: move each expert's bias towards the mean load (counts summed over dp)."""
        rate = self.config.bias_update_rate
        for moe in self._moes():
            stats = routing_stats(moe)
            load = stats.load if stats.load is not None else torch.zeros_like(moe.expert_bias)
            load = load.to(torch.float64)
            if self.groups.dp_group is not None:
                dist.all_reduce(load, group=self.groups.dp_group)
            if rate > 0:
                moe.expert_bias.add_(torch.sign(load.mean() - load).to(moe.expert_bias.dtype), alpha=rate)
            stats.load = None

    def _gather(self, record: dict) -> list[dict] | None:
        if not dist.is_initialized():
            return [record]
        gathered = [None] * self.groups.world_size if self.groups.rank == 0 else None
        dist.gather_object(record, gathered, dst=0)
        return gathered

    def _user_error(self, message: str) -> None:
        """A user error every rank found alike after set-up: one line from rank 0, exit code 2 (the others wait a
        moment first, so that torchrun does not stop rank 0 before it reports)."""
        if self.groups.is_logger:
            sys.stderr.write(f"error: {message}\n")
            sys.stderr.flush()
        else:
            time.sleep(5.0)
        os._exit(2)

    def train(self) -> dict:
        config, groups = self.config, self.groups
        if self.resume:
            self.guard.beat("the resume load")
            try:
                self._resume()
            except ValueError as exc:  # another world size, seed or corpus: every rank raises the same error
                self._user_error(f"--resume: {' '.join(str(exc).split())}")
            if self.start_step > config.steps:  # every rank loaded the same checkpoint
                self._user_error(f"--steps {config.steps} is below step {self.start_step} of the checkpoint --resume "
                                 "loads; --steps is the total, counting the steps already done")
        if self.restarts == 0 and groups.is_logger:  # a refused launch leaves the run's history as it was
            self.run_state.save()
            if self.in_temp_folder:  # the folders that runs like this one left when they failed
                sweep_finished_runs(self.run_state.dir)
        incident = None
        stopped = self.run_state.data.get("stopped")
        if self.restarts > 0 and stopped:  # torchrun restarted a run that stopped on purpose: do not go on
            if groups.is_logger:
                sys.stderr.write(f"error: the run stopped at step {stopped['step']} ({stopped['message']}); not "
                                 "restarting it: fix the cause, then launch again with --resume\n")
                sys.stderr.flush()
            os._exit(NONFINITE_EXIT_CODE)
        if self.restarts > 0:
            incident = self.run_state.restarted(restart_count=self.restarts, resume_step=self.start_step,
                                                policy=config.policy, is_logger=groups.is_logger)
        writer = MetricsWriter(config.metrics_file, rank=groups.rank,
                               resume_step=self.start_step if self.resume else None)
        if incident is not None:
            writer.write({"step": incident["step"], "oom": True, "policy": incident["policy"],
                          "restart": self.restarts, "resumed_from_step": self.start_step,
                          "continues_as": config.policy, "message": incident["message"],
                          "peak_activation_bytes": incident.get("peak_activation_bytes", 0)})
        progress = Progress(config.steps, rank=groups.rank, start_step=self.start_step)
        tokens_per_step = config.global_batch_sequences * config.model.seq_length
        flops = flops_per_token(config)
        peak_flops = self.run.hardware.peak_flops
        began = time.perf_counter()
        totals = {"steps": 0, "planning_s": 0.0, "peak": 0, "recompute_flops": 0.0, "loss": None, "step_s": 0.0,
                  "first_loss": None, "error": 0.0}
        guard = self.guard
        self.provisioner.progress = lambda kind, name: (guard.forward(f"the forward of {name}") if kind == "forward"
                                                        else guard.beat(f"the backward of {name}"))
        guard.start()
        own_peak = 0  # this rank's activation peak over the steps this launch completed
        try:
            for step in range(self.start_step, config.steps):
                started = time.perf_counter()
                for group in self.optimizer.param_groups:
                    group["lr"] = lr_at(config, step)
                guard.beat("the step's start", step)
                self.provisioner.begin_step()
                self._set_spikes(step)
                try:
                    loss_sum, count = self._run_step(step)
                    guard.beat("the non-finite check")
                    bad = guard.nonfinite(step, loss_sum, self.params)
                    if bad and config.on_nonfinite == "stop":
                        self._stop_nonfinite(step, bad)
                    guard.beat("the gradient reduction")
                    if bad:  # --on-nonfinite skip: every rank drops the step's update alike
                        self.optimizer.zero_grad(set_to_none=True)
                        for moe in self._moes():
                            routing_stats(moe).load = None
                        self.counts["skipped"] += 1
                    else:
                        reduce_gradients(self.params, groups)
                        self.optimizer.step()
                        self.optimizer.zero_grad(set_to_none=True)
                        self._balance()
                    self.run.batches.advance()
                except Exception as exc:  # pipelining wraps a stage's errors: look for an OOM in the chain
                    guard.fatal(exc, step)  # a failed collective: one line, exit for torchrun to restart
                    oom = _out_of_memory_cause(exc)
                    if oom is None:
                        raise
                    # the completed steps' peak (all ranks' on the logger, this rank's elsewhere); the failed
                    # step is lost, as in the simulator
                    self._out_of_memory(step, oom, max(totals["peak"], own_peak))
                guard.updated(step)
                step_s = time.perf_counter() - started
                own_peak = max(own_peak, self.provisioner.tracker.peak_bytes)
                mine = {"loss_sum": loss_sum, "count": count, "peak": self.provisioner.tracker.peak_bytes,
                        "microbatches": self.provisioner.log, "order": self.provisioner.points,
                        "planning_s": self.provisioner.planning_s, "agree_s": self.provisioner.agree_s,
                        "reruns": self.provisioner.reruns,
                        "step_s": step_s}
                try:
                    guard.beat("the step's records")
                    gathered = self._gather(mine)
                    if gathered is not None:  # the logger's counts (in its checkpoint) are the run's
                        self.counts["reruns"] += sum(r["reruns"] for r in gathered)
                    guard.end_step(step)
                    self.run_state.step_done(groups.is_logger)
                    record = None
                    if gathered is not None:
                        record = self._record(step, gathered, tokens_per_step, flops, peak_flops)
                        if bad:
                            record["skipped"] = "non-finite loss or gradient on rank " + ", ".join(map(str, bad))
                        # before the checkpoint: a resume from it keeps the records of the steps before it
                        writer.write(record)
                    if config.checkpoint_every and config.checkpoint_dir and (step + 1) % config.checkpoint_every == 0:
                        warning = guard.save(config.checkpoint_dir, step + 1, self._state(step + 1),
                                             run=self._run_flags())
                        if warning is not None:
                            self.counts["checkpoint_failures"] += 1
                            if groups.is_logger:
                                print(warning, file=sys.stderr, flush=True)
                except Exception as exc:
                    guard.fatal(exc, step)
                    raise
                if record is None:
                    continue
                progress.update(step, record["loss"], record["tokens_per_s"])
                totals["steps"] += 1
                totals["planning_s"] += record["planning_s"]
                totals["step_s"] += record["step_s"]
                totals["peak"] = max(totals["peak"], record["peak_activation_bytes"])
                totals["recompute_flops"] += record["recompute_flops"]
                totals["loss"] = record["loss"]
                if totals["first_loss"] is None:
                    totals["first_loss"] = record["loss"]
                totals["error"] = max([totals["error"]] + [abs(mb["kept_bytes"] - mb["predicted_bytes"])
                                                           / max(mb["predicted_bytes"], 1)
                                                           for mb in record["microbatches"]])
        finally:
            progress.close()
            guard.beat("the run's end")
        elapsed = time.perf_counter() - began
        summary = self._summary(totals, elapsed, tokens_per_step, flops, peak_flops)
        writer.write(summary)
        writer.close()
        print_summary(summary, rank=groups.rank)
        if groups.is_logger and self.in_temp_folder:
            shutil.rmtree(self.run_state.dir, ignore_errors=True)  # the temp folder of a run that finished
        return summary

    def _stop_nonfinite(self, step: int, ranks: list[int]) -> None:
        """--on-nonfinite stop: one line from rank 0 naming the step, the run marked stopped, every rank exits."""
        try:
            found = checkpoint.find_latest(self.config.checkpoint_dir) if self.config.checkpoint_dir else None
            kept = f"the last complete checkpoint is {found[0]}" if found else "no checkpoint was written"
        except checkpoint.CheckpointError:  # every rank gets it alike (rank 0 verified and broadcast)
            kept = "no checkpoint verifies"
        message = f"non-finite loss or gradient at step {step} on rank {', '.join(map(str, ranks))}"
        self.run_state.record_stop(step=step, message=message, is_logger=self.groups.is_logger)
        if self.groups.is_logger:
            sys.stderr.write(f"error: {message}; stopping (--on-nonfinite stop; skip drops such steps); {kept}; "
                             f"exit code {NONFINITE_EXIT_CODE}\n")
            sys.stderr.flush()
        if dist.is_initialized():
            dist.barrier()  # rank 0's line is out before any rank exits (torchrun stops the others at the first)
        self.guard.close()
        os._exit(NONFINITE_EXIT_CODE)

    def _out_of_memory(self, step: int, exc: BaseException, peak_bytes: int) -> None:
        """A fixed policy overflowed the cap: leave a marker, say so in one line, exit for torchrun to restart."""
        message = " ".join(str(exc).split())
        self.run_state.record_oom(rank=self.groups.rank, step=step, policy=self.config.policy, message=message,
                                  peak_bytes=peak_bytes)
        sys.stderr.write(f"error: rank {self.groups.rank} ran out of activation memory at step {step} under "
                         f"--policy {self.config.policy} ({message}); exit code {OOM_EXIT_CODE} (torchrun "
                         "--max-restarts restarts the run)\n")
        sys.stderr.flush()
        os._exit(OOM_EXIT_CODE)

    def _record(self, step: int, gathered: list[dict], tokens: int, flops: float, peak_flops: float) -> dict:
        losses = [(r["loss_sum"], r["count"]) for r in gathered if r["count"]]
        loss = sum(s for s, _ in losses) / sum(c for _, c in losses)
        step_s = max(r["step_s"] for r in gathered)
        microbatches = [mb for r in gathered for mb in r["microbatches"]]
        recompute = sum(mb.pop("recompute_flops", 0) for mb in microbatches)
        devices = self.groups.world_size
        return {"step": step, "loss": loss, "tokens_per_s": tokens / step_s,
                "mfu": mfu(flops * tokens, step_s, peak_flops=peak_flops, num_devices=devices),
                "hfu": mfu(flops * tokens + recompute, step_s, peak_flops=peak_flops, num_devices=devices),
                "oom": False, "peak_activation_bytes": max(r["peak"] for r in gathered),
                "microbatches": microbatches, "order": [o for r in gathered for o in r["order"]],
                "planning_s": max(r["planning_s"] for r in gathered),
                "planning_s_all_ranks": sum(r["planning_s"] for r in gathered),
                "agree_s": max(r["agree_s"] for r in gathered), "step_s": step_s, "recompute_flops": recompute,
                "reruns": sum(r["reruns"] for r in gathered), "policy": self.config.policy}

    def _summary(self, totals: dict, elapsed: float, tokens: int, flops: float, peak_flops: float) -> dict:
        steps = totals["steps"]
        state = self.run_state.data
        seconds = max(time.time() - state["started_at"] if self.restarts or self.config.resume else elapsed, 1e-9)
        done_tokens = tokens * (self.config.steps if self.restarts or self.config.resume else steps)
        return {"summary": True, "recipe": self.config.extra.get("recipe"), "steps": self.config.steps,
                "steps_run": steps, "first_loss": totals["first_loss"], "max_prediction_error": totals["error"],
                "seconds": elapsed,
                "final_loss": finite(totals["loss"]) if totals["loss"] is not None else None,
                "oom_events": state["oom_events"], "stalls": state.get("stalls", 0), "restarts": state["restarts"],
                "restart_s": state["restart_s"], "skipped_steps": self.counts["skipped"],
                "checkpoint_failures": self.counts["checkpoint_failures"],
                "steps_lost": state["steps_lost"], "reruns": self.counts["reruns"], "policy": self.config.policy,
                "policies": state["policies"] or [self.config.policy],
                "tokens_per_s": done_tokens / seconds,
                "mfu": mfu(flops * done_tokens, seconds, peak_flops=peak_flops, num_devices=self.groups.world_size),
                "hfu": mfu(flops * done_tokens + totals["recompute_flops"], seconds, peak_flops=peak_flops,
                           num_devices=self.groups.world_size),
                "peak_activation_bytes": totals["peak"], "memory_cap_bytes": self.run.cap_bytes,
                "setup_s": self.provisioner.setup_s,
                "planning_fraction": totals["planning_s"] / max(totals["step_s"], 1e-9),
                "schedule": self.config.schedule, "layout": {"pp": self.config.pp, "dp": self.config.dp,
                                                             "ep": self.config.ep, "vp": self.config.vp}}
