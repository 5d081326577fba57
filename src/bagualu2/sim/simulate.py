"""The paper-scale simulator (§VI): whole training iterations of every pipeline stage under one policy, with OOMs,
restarts and MFU (docs/sim.md has the model and its sourced constants).

Per iteration and stage, the stage's (interleaved) 1F1B schedule (``runtime.Stage.steps``) is run by the
runtime's iteration driver (``runtime.run_iteration``): each forward asks the policy what it runs
(:class:`~.stage.Choice`: bytes kept, exact at the micro-batch's imbalance, and the seconds of its steps under
the policy's execution, :mod:`.execution`); in-flight bytes rise at forwards and fall at backwards; the peak
above the stage's ``M_max`` is an OOM (never for ``ideal``).

Time. A stage runs its steps — a warmup forward, a steady F_x B_y pair, a cooldown backward, each in the
policy's execution, the output layer and embedding on the steps of their micro-batches (:mod:`.overheads`) — on
the pipeline's timeline (:mod:`.timeline`): each step starts when its stage is free and its inputs have come
from the neighbouring stages, so the warmup and cooldown ramps (the interleaved 1F1B bubble) and every wait
between stages follow from the steps' own times::

    iteration_s = max over stages (the stage's last step ends + exposed gradient sync + optimizer_s)

The gradient reduce-scatter runs beside the stage's steps and waits from its first step holding a backward of the
last micro-batch on, the parameter all-gather until the first micro-batch's forwards have ended; what either
leaves is exposed (all of both under ``overlap="none"``). MFU = model FLOPs
per GPU per iteration / (iteration_s * peak_flops), the model FLOPs being the mean over stages of
:meth:`~.stage.StageContext.model_flops` (3 x forward matrix-product FLOPs at balanced load) plus the output
layer's; a run's ``mean_mfu`` averages it per iteration (§VI-A).

Restarts. When a policy with a fallback (``FALLBACKS``: static-under, kwai, adapipe, L1, L2) OOMs, the iteration
is lost — its whole time plus ``restart_s`` (the paper's 284 s) is paid — and the same iteration is run again:
``on_oom="fallback"`` (the default, the paper's §II and the trainer) under the fallback, static-over, which stays
in force; ``on_oom="replan"`` (the paper's §VI-A baselines: "we adjust the reduction strategy according to the
observed imbalance rate and manually restart") under the same policy with its plans re-made for that iteration's
highest rate (static-over if that still overruns), the next iteration back on the normal plans.

Speed: whole iterations are memoised by (policy in force, planned imbalance, the iteration's rates, and for a
decision path whether it has measured a gate, ``StagePolicy.state``). A later iteration of a decision path depends
slightly on what came before (its first gates start from the last ones measured); the memo keeps the first such
result per rate vector.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import NamedTuple

from ..costmodel import Hardware, ModelConfig, ParallelConfig
from ..costmodel.build import check_imbalance, imbalance_limit, limit_text
from ..costmodel.config import PARALLEL_MAX
from ..costmodel.validate import require_int, require_number, shown
from ..runtime import check_downgrade, run_iteration
from .execution import check_overlap
from .overheads import StageOverheads, stage_overheads
from .policies import FALLBACKS, StagePolicy, check_policy, make_policy
from .stage import StageContext
from .timeline import Step, spans

ON_OOM = ("fallback", "replan")
MAX_ITERATIONS = 10_000_000  # of a trace: far beyond any training run
MAX_RESTART_S = 1e9


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """restart_s: seconds an OOM restart costs (checkpoint reload, re-launch), a finite number in [0, 1e9].
    plan_imbalance: the imbalance the plans fixed before training are made for (>= 1; default 1: balanced load).
    on_oom: what a policy with a fallback restarts with after an OOM: ``"fallback"`` (``FALLBACKS``, static-over)
    or ``"replan"`` (the crashed iteration re-run on its own plans re-made for that iteration's imbalance, then back
    on the normal plans; the paper's §VI-A baselines).
    m_max_bytes: every stage's activation capacity instead of what its memory leaves (the trainer's
    ``--memory-cap``); None: ``stage_memory``'s ``M_max``.
    overlap: the execution model (``execution.OVERLAP``): ``"real"`` (every policy the overlap of its real
    system), ``"released"`` (the same without Megatron-Core's all-to-all overlap for the baselines),
    ``"fused-only"`` (only the fused policies' steady pairs overlap) or ``"none"`` (all serial, the gradient
    synchronisation included).
    hidden_copies: the flexible policies' decision path prices offload copies by what they leave exposed beside
    compute (``runtime.DecisionPath``'s ``hidden_copies``; True, as on a GPU whose copy engines run beside compute)
    or, False, in full (Algorithm 2's pricing; the CPU trainer's decisions); None (default): True under
    ``"real"`` and ``"released"``, False under ``"none"`` (nothing runs beside compute) and ``"fused-only"``
    (warmup forwards and cooldown backwards run serial there, their copies exposed).
    timeline: True (default): the iteration is the pipeline's timeline (:mod:`.timeline`: every stage waits for
    its neighbours' outputs); False: the busiest stage plus Megatron's interleaved 1F1B bubble, (pp - 1) chunk
    forwards and backwards each run alone, where no wait costs time — as on the calibration's CPU, whose ranks
    share cores that another rank keeps busy while one waits."""

    restart_s: float = 284.0
    plan_imbalance: float = 1.0
    on_oom: str = "fallback"
    m_max_bytes: int | None = None
    overlap: str = "real"
    hidden_copies: bool | None = None
    timeline: bool = True

    def __post_init__(self) -> None:
        check_overlap(self.overlap)
        if not isinstance(self.timeline, bool):
            raise ValueError(f"timeline must be true or false, got {self.timeline!r}")
        if self.hidden_copies is not None and not isinstance(self.hidden_copies, bool):
            raise ValueError(f"hidden_copies must be true, false or None, got {self.hidden_copies!r}")
        if self.m_max_bytes is not None:
            require_int("m_max_bytes", self.m_max_bytes, 1)
        require_number("restart_s", self.restart_s, 0, MAX_RESTART_S)
        require_number("plan_imbalance", self.plan_imbalance, 1, PARALLEL_MAX["ep"])  # no rank gets more than ep x
        if self.on_oom not in ON_OOM:
            raise ValueError(f"on_oom must be one of {', '.join(ON_OOM)}, got {self.on_oom!r}")

    @property
    def copies_hidden(self) -> bool:
        """``hidden_copies`` resolved: as given, or (None) True under ``"real"`` and ``"released"`` only."""
        return self.overlap in ("real", "released") if self.hidden_copies is None else self.hidden_copies


@dataclass(frozen=True)
class IterationResult:
    """One iteration: wall seconds (lost time included), MFU over them, the in-flight activation peak of every
    stage, whether it hit an OOM and was restarted, the policy it completed under, and the seconds lost."""

    time_s: float
    mfu: float
    peak_bytes: tuple[int, ...]
    oom: bool
    restarted: bool
    policy: str
    lost_s: float = 0.0


@dataclass(frozen=True)
class SimResult:
    policy: str
    iterations: tuple[IterationResult, ...]
    m_max_bytes: tuple[int, ...]   # per stage
    flops_per_iteration: float     # model FLOPs per GPU per iteration
    tokens_per_iteration: int      # global: seq_length * micro_batch_size * num_microbatches * dp
    peak_flops: float

    @property
    def total_time_s(self) -> float:
        return sum(it.time_s for it in self.iterations)

    @property
    def mean_mfu(self) -> float:
        """The paper's metric (§VI-A): per-iteration MFU averaged over the run, an iteration that hit an OOM
        counting its lost time and restart."""
        return sum(it.mfu for it in self.iterations) / len(self.iterations)

    @property
    def time_weighted_mfu(self) -> float:
        """All model FLOPs over all wall time, restarts included."""
        return self.flops_per_iteration * len(self.iterations) / (self.total_time_s * self.peak_flops)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_iteration * len(self.iterations) / self.total_time_s

    @property
    def oom_events(self) -> int:
        return sum(it.oom for it in self.iterations)

    @property
    def restarts(self) -> int:
        return sum(it.restarted for it in self.iterations)

    @property
    def time_lost_s(self) -> float:
        return sum(it.lost_s for it in self.iterations)

    def summary(self) -> dict:
        return {"policy": self.policy, "iterations": len(self.iterations), "mfu": self.mean_mfu,
                "tokens_per_s": self.tokens_per_s, "oom_events": self.oom_events, "restarts": self.restarts,
                "time_lost_s": self.time_lost_s, "total_time_s": self.total_time_s}


def check_trace(trace, parallel: ParallelConfig, model: ModelConfig | None = None) -> list:
    """The trace's entries as memo keys: a float (every micro-batch at that rate; also for a tuple of equal rates,
    so both spellings are one iteration) or a tuple of ``num_microbatches`` floats; each rate in [1, ep] (with
    ``model``: in [1, ``imbalance_limit``]). One-line
    ``ValueError`` naming the entry otherwise."""
    if isinstance(trace, (str, bytes, set, frozenset, dict)) or not hasattr(trace, "__len__"):
        raise ValueError(f"trace must be a sequence of rates or of per-micro-batch rates, got {type(trace).__name__}")
    if not 1 <= len(trace) <= MAX_ITERATIONS:
        raise ValueError(f"trace must have 1 to {MAX_ITERATIONS:,} iterations, got {len(trace):,}")
    keys = []
    count = parallel.num_microbatches
    for i, entry in enumerate(trace):
        try:
            if isinstance(entry, numbers.Real) and not isinstance(entry, bool):
                keys.append(check_imbalance(entry, ep=parallel.ep, model=model))
                continue
            if (isinstance(entry, (str, bytes, set, frozenset, dict)) or not hasattr(entry, "__len__")
                    or len(entry) != count):  # an unordered collection has no micro-batch order
                raise ValueError(f"must be a rate or a sequence of {count} per-micro-batch rates, "
                                 f"got {shown(entry)}")
            rates = []
            for m, rate in enumerate(entry):
                try:
                    rates.append(check_imbalance(rate, ep=parallel.ep, model=model))
                except ValueError as exc:
                    raise ValueError(f"micro-batch {m}: {exc}") from None
            keys.append(rates[0] if len(set(rates)) == 1 else tuple(rates))  # one rate: the scalar's key
        except ValueError as exc:
            raise ValueError(f"trace[{i}] (iteration {i}): {exc}") from None
    return keys


class StageTime(NamedTuple):
    """One stage over one iteration: seconds busy with chunk steps, the in-flight activation peak, the seconds of
    the first micro-batch's forwards and the last one's backwards (what gradient traffic can hide behind), and
    ``steps``, each as the pipeline's timeline runs it (:class:`~.timeline.Step`, the output layer and
    embedding included); ``alone_s``: every chunk-forward's forward and backward each timed alone, as the
    pipeline's ramp runs them (the bubble of ``timeline=False``)."""

    busy_s: float
    peak_bytes: int
    first_forward_s: float
    last_backward_s: float
    steps: tuple[Step, ...]
    alone_s: float


def stage_time(policy: StagePolicy, rates: tuple[float, ...], extra: StageOverheads | None = None) -> StageTime:
    """One stage over one iteration under ``policy`` (the runtime's iteration driver runs the schedule), its
    output layer and embedding (``extra``, default none) on the steps of their micro-batches."""
    ctx = policy.ctx
    forward = policy.forward
    run = run_iteration(ctx.engine, lambda step, rate, budget, limit: forward(step.chunk, rate, step.phase, budget,
                                                                              limit),
                        rates, m_max_bytes=ctx.plan_m_max_bytes, budgeted=policy.budgeted)
    choices = iter(f.result for f in run.forwards)
    running: dict[int, object] = {}
    first = final = alone = 0.0
    schedule = ctx.steps
    final_mb, vp = len(rates) - 1, ctx.parallel.vp
    # per chunk: seconds a forward and a backward add (output layer, embedding), and of a forward's the part before
    # its output leaves (the embedding runs before the chunk, the output layer after it)
    forward_add, forward_before, backward_add = [0.0] * vp, [0.0] * vp, [0.0] * vp
    if extra is not None and ctx.stage == ctx.parallel.pp - 1:
        forward_add[vp - 1] += extra.head_forward_s
        backward_add[vp - 1] += extra.head_backward_s
    if extra is not None and ctx.stage == 0:
        forward_add[0] += extra.embed_forward_s
        forward_before[0] += extra.embed_forward_s
        backward_add[0] += extra.embed_backward_s

    steps: list[Step] = []
    i = 0
    while i < len(schedule):
        step = schedule[i]
        if step.forward:
            choice = running[step.index] = next(choices)
            added, before = forward_add[step.chunk], forward_before[step.chunk]
            alone += choice.forward_s + choice.backward_s + added + backward_add[step.chunk]
            if step.microbatch == 0:
                first += choice.forward_s
            if (step.microbatch, step.chunk) in ctx.point_leads:  # F_x B_y: the backward is the next step
                after = schedule[i + 1]
                back = running[after.index]
                pair = ctx.pair(choice, back)  # a steady F_x B_y point, each its own plan
                lead, behind = (step.microbatch, step.chunk), (after.microbatch, after.chunk)
                if pair.forward_out_s < pair.seconds:  # F then B: each its own step, as Megatron runs them
                    steps.append(Step(lead, None, pair.forward_out_s + added, pair.forward_out_s + before))
                    steps.append(Step(None, behind, pair.seconds - pair.forward_out_s + backward_add[after.chunk],
                                      0.0))
                else:  # together: the point starts with both inputs and sends after it
                    seconds = pair.seconds + added + backward_add[after.chunk]
                    steps.append(Step(lead, behind, seconds, seconds))
                if after.microbatch == final_mb:  # the last backward ran inside the pair: sync hides behind it
                    final += back.backward_s
                i += 2
                continue
            steps.append(Step((step.microbatch, step.chunk), None, choice.forward_s + added,
                              choice.forward_s + before))
        else:
            back = running[step.index]
            steps.append(Step(None, (step.microbatch, step.chunk), back.backward_s + backward_add[step.chunk], 0.0))
            if step.microbatch == final_mb:
                final += back.backward_s
        i += 1
    return StageTime(sum(step.seconds for step in steps), run.peak_bytes, first, final, tuple(steps), alone)


class _Way(NamedTuple):
    """One way of running a stage's iteration: its whole seconds alone (steps, output layer and embedding, the
    gradient traffic its own steps leave exposed), its steps, its stage's overheads, and its activation peak."""

    whole_s: float
    steps: tuple[Step, ...]
    extra: StageOverheads
    peak_bytes: int
    alone_s: float


class _Run:
    """The stages of one simulation, with each policy built on first use and whole iterations memoised."""

    def __init__(self, model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, config: SimConfig,
                 plan_hardware: Hardware | None = None, downgrade: str = "graded"):
        self.parallel, self.hardware, self.config = parallel, hardware, config
        self.stages = [StageContext(model, parallel, hardware, s, plan_hardware=plan_hardware, downgrade=downgrade,
                                    m_max_bytes=config.m_max_bytes, hidden_copies=config.copies_hidden)
                       for s in range(parallel.pp)]
        for ctx in self.stages:
            ctx.check_room(capped=config.m_max_bytes is not None)
        self.overheads = [stage_overheads(model, parallel, hardware, s) for s in range(parallel.pp)]
        self.flops = sum(ctx.model_flops() + extra.head_flops
                         for ctx, extra in zip(self.stages, self.overheads)) / parallel.pp
        self._policies: dict[tuple, list[StagePolicy]] = {}
        self._memo: dict[tuple, IterationResult] = {}

    def iteration(self, name: str, key, plan_imbalance: float) -> IterationResult:
        policies = self._policies.get((name, plan_imbalance))
        if policies is None:
            policies = self._policies[(name, plan_imbalance)] = [
                make_policy(name, ctx, plan_imbalance=plan_imbalance, overlap=self.config.overlap)
                for ctx in self.stages]
        memo_key = (name, plan_imbalance, key, tuple(policy.state() for policy in policies))
        found = self._memo.get(memo_key)
        if found is not None:
            return found
        parallel = self.parallel
        rates = key if isinstance(key, tuple) else (key,) * parallel.num_microbatches
        hides = self.config.overlap != "none"  # all serial: nothing hides the gradient traffic either
        ways = []  # per stage, each way the policy may run it (the oracle's two)
        for policy, extra in zip(policies, self.overheads):
            timed = [stage_time(way, rates, extra) for way in policy.alternatives()]
            ways.append([_Way(t.busy_s + extra.sync_s(t.last_backward_s * hides, t.first_forward_s * hides),
                              t.steps, extra, t.peak_bytes, t.alone_s) for t in timed])

        def iteration_s(chosen: list[_Way]) -> float:
            if not self.config.timeline:  # the busiest stage and Megatron's bubble: (pp - 1) chunk steps alone
                chunk_s = sum(way.alone_s for way in chosen) / len(chosen) / (parallel.num_microbatches * parallel.vp)
                return max(way.whole_s for way in chosen) + (parallel.pp - 1) * chunk_s
            # every stage's steps on the pipeline's timeline (its ramps and waits), then what its gradient traffic
            # leaves exposed — the reduction runs from the first backward of the last micro-batch on, the gather
            # until the first micro-batch's forwards have ended, each beside the stage's steps and waits — and the
            # optimizer step
            return max(span.end_s + way.extra.sync_s((span.end_s - span.last_backwards_start_s) * hides,
                                                     span.first_forwards_end_s * hides)
                       for span, way in zip(spans([way.steps for way in chosen], parallel.vp), chosen))

        # each stage's fastest way, or one way on every stage (the timeline is every stage's: a stage's fastest
        # may hold up another), whichever iteration is the shortest
        fastest = [min(options, key=lambda way: way.whole_s) for options in ways]  # a way holds steps: no order
        candidates = [fastest] + [[options[i] for options in ways] for i in range(len(ways[0]))]
        chosen = min(candidates, key=iteration_s)
        time_s = iteration_s(chosen)
        peaks = tuple(way.peak_bytes for way in chosen)
        oom = any(policy.bounded and peak > policy.ctx.m_max_bytes for policy, peak in zip(policies, peaks))
        found = self._memo[memo_key] = IterationResult(
            time_s, self.flops / (time_s * self.hardware.peak_flops), peaks, oom, False, name)
        return found


def simulate(model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, policy: str, trace, *,
             restart_s: float = 284.0, plan_imbalance: float = 1.0, on_oom: str = "fallback",
             m_max_bytes: int | None = None, progress=None, plan_hardware: Hardware | None = None,
             downgrade: str = "graded", overlap: str = "real", hidden_copies: bool | None = None,
             timeline: bool = True) -> SimResult:
    """Simulate ``trace`` (one entry per iteration: a rate, or one rate per micro-batch) under ``policy`` (one of
    ``POLICIES`` or ``ABLATION``); see the module docstring for what is modelled. ``progress``, optional, is
    called with the number of iterations done after each one. ``plan_hardware`` (default ``hardware``): the
    profile the policies plan with, when that is not the profile that times them (a trainer planning with its
    configured profile on a machine ``hardware`` was fitted to). ``downgrade``: the gate of ``flexible``'s decision
    path, ``"graded"`` (default) or ``"paper"`` (keep or full MoE-module downgrade: what the trainer runs under
    expert parallelism). ``overlap``: the execution model; ``hidden_copies``: flexible's pricing of copies;
    ``timeline``: the pipeline's timeline or the bubble formula (:class:`SimConfig`)."""
    for name, value, kind in (("model", model, ModelConfig), ("parallel", parallel, ParallelConfig),
                              ("hardware", hardware, Hardware)):
        if not isinstance(value, kind):
            raise ValueError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
    if plan_hardware is not None and not isinstance(plan_hardware, Hardware):
        raise ValueError(f"plan_hardware must be a Hardware profile or None, got {type(plan_hardware).__name__}")
    if progress is not None and not callable(progress):
        raise ValueError(f"progress must be a callable or None, got {type(progress).__name__}")
    config = SimConfig(restart_s=restart_s, plan_imbalance=plan_imbalance, on_oom=on_oom, m_max_bytes=m_max_bytes,
                       overlap=overlap, hidden_copies=hidden_copies, timeline=timeline)
    check_policy(policy)
    if config.plan_imbalance > imbalance_limit(model, parallel):
        raise ValueError(f"plan_imbalance must be in [1, {limit_text(imbalance_limit(model, parallel))}] (one of ep="
                         f"{parallel.ep} ranks receives at most min(ep, num_experts / top_k) x the mean tokens), got "
                         f"{plan_imbalance!r}")
    keys = check_trace(trace, parallel, model)
    run = _Run(model, parallel, hardware, config, plan_hardware, check_downgrade(downgrade))
    results = []
    in_force, planned = policy, config.plan_imbalance  # the plans in force are always made at plan_imbalance
    for done, key in enumerate(keys, 1):
        result = run.iteration(in_force, key, planned)
        if result.oom and in_force in FALLBACKS:
            lost = result.time_s + config.restart_s
            seen = max(key) if isinstance(key, tuple) else key
            redo, redo_policy = None, in_force
            if config.on_oom == "replan":  # the same policy, its plans made for the imbalance that crashed it
                redo = run.iteration(in_force, key, max(seen, planned))
            if redo is None or redo.oom:  # a re-made plan that cannot fit is known before a second attempt
                redo_policy = FALLBACKS[in_force]
                redo = run.iteration(redo_policy, key, planned)
            if config.on_oom == "fallback":  # stays in force; a replanned run returns to its normal plans
                in_force = redo_policy
            total = lost + redo.time_s
            result = IterationResult(total, run.flops / (total * hardware.peak_flops), redo.peak_bytes, True, True,
                                     redo_policy, lost)
        results.append(result)
        if progress is not None:
            progress(done)
    tokens = model.seq_length * model.micro_batch_size * parallel.num_microbatches * parallel.dp
    return SimResult(policy, tuple(results), tuple(ctx.m_max_bytes for ctx in run.stages), run.flops, tokens,
                     hardware.peak_flops)
