"""Per-micro-batch activation provisioning of one pipeline rank (all its virtual chunks), paper §V end to end.

For every chunk-forward, in the schedule's order:

1. **budget** — the runtime's iteration driver (``bagualu2.runtime.Iteration`` over the rank's stage engine:
   Algorithm 1, a new one every iteration, phases from the stage's steps) gives the budget and, in warmup under
   graded planning, the most an overrun may keep (absorbed by the next budgets); the gates decide against the
   latter.
2. **agreement** — under expert parallelism the ranks of an EP group must re-run the same collectives in
   backward, so they run the same plans. They agree without a collective before the forward: every rank records
   the same bytes into its budget (step 5) and follows the same imbalance (the most any rank of the group
   received at the previous forward, known from the gates' all-gathered counts), so budgets, planned imbalances
   and pre-gate plans are equal on every rank of the group.
3. **pre-gate plan** — ``bagualu2.runtime.DecisionPath.pre_gate`` (greedy at the planned imbalance, memoised).
4. **gates** — the model's MoE routers report the routed copies each rank receives and the most any rank of the
   EP group receives (the routing counts are all-gathered); ``exec``'s deferred planner asks
   ``bagualu2.runtime.after_gate`` (keep / graded re-plan / full downgrade). Plans and budgets being agreed, every
   EP rank decides for the group's busiest rank: the same decision everywhere, without another collective, and a
   plan that fits the busiest rank fits them all. A graded re-plan is a function of agreed inputs (the plan in
   force, the group's busiest count, the agreed budget), so every rank of the group re-plans alike and re-runs the
   same all-to-alls in backward.
5. **kept bytes** — what the activation tracker measured is compared with the cost model's prediction for the
   plan that ran, at the token counts each MoE layer received (``PlanCost.activation_bytes_received``), and
   recorded into the budget (re-basing). Under EP one all-reduce after the forward gives the most bytes any rank
   of the group kept and whether any rank overflows the cap (the safety net re-runs it on every rank); each rank
   records that maximum — the same number everywhere, never below what the rank kept. The tracker enforces the
   cap ``M_max``.
6. **order** — at a fused point F_x B_y, ``bagualu2.runtime.PointOrders`` orders F_x, B_y, O_{x-1}, R_{y+1} from
   their real plans (a baseline policy: Megatron-Core's combined-1F1B order of the same chains,
   ``bagualu2.fusion.baselines.megatron_overlapped``); the ``DualBatchExecutor`` runs it. The inputs of the order
   are agreed values, so every EP rank runs the same interleaving of its all-to-alls.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from bagualu2.costmodel import Hardware, ModelConfig, ParallelConfig, Plan
from bagualu2.exec import ActivationTracker, DeferredPlanner, PlanExecutor
from bagualu2.fusion.baselines import megatron_overlapped, reruns_all_to_all
from bagualu2.runtime import DecisionPath, Iteration, PointOrders, Stage, ceil_bucket

from .parallel import agree_max
from .routing import routing_stats

WARMUP = "warmup"
# the gates decide for the measured imbalance rounded up to 0.05 and the budget rounded down to 1/32 of the
# chunk's unmitigated bytes: conservative, and memoised (most gates repeat a decision)
GATE_IMBALANCE_STEP = 0.05
GATE_BUDGET_SHIFT = 5


@dataclass
class _Forward:
    name: str
    index: int
    phase: str
    budget_bytes: int
    gate_budget_bytes: int
    plan: Plan
    imbalance: float | None = None  # agreed max over the EP group (after the next forward's agreement)


class Provisioner:
    """Budgets, plans, gates and orders of one rank's chunks (module docstring)."""

    def __init__(self, model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, *, stage: int,
                 cap_bytes: int, ep_group=None, downgrade: str = "graded", dual: bool = False,
                 exclude=(), fixed: tuple[Plan, ...] | None = None, capped: bool = True,
                 prediction_scale: float = 1.0, execution: str = "fused"):
        self.stage, self.parallel, self.ep_group, self.downgrade = stage, parallel, ep_group, downgrade
        self.fixed = fixed                    # a fixed policy's plan per chunk (None: flexible)
        if execution not in ("fused", "megatron"):
            raise ValueError(f"execution must be fused or megatron, got {execution!r}")
        self.execution = execution            # fused points: the fusion DP's order or Megatron-Core's
        self.safety_net = fixed is None       # flexible: an overflow is re-run with full recompute, no restart
        self.prediction_scale = prediction_scale
        # shared by path, gates and orders; its M_max is the cap the budgets are given under
        self.engine = engine = Stage(model, parallel, hardware, stage=stage, m_max_bytes=cap_bytes)
        self.path = DecisionPath.on(engine, downgrade=downgrade)
        self.cap_bytes = cap_bytes
        self._index = {(step.chunk, step.microbatch): (step.index, step.phase) for step in engine.steps
                       if step.forward}
        # fixed policies: the tracker's cap raises (out of memory -> restart); flexible checks after each
        # chunk-forward (the safety net); ideal: no cap
        self.tracker = ActivationTracker(cap_bytes=cap_bytes if capped and fixed is not None else None,
                                         exclude=exclude)
        self.capped = capped
        self.executors = {
            chunk: PlanExecutor(self.path.graph(chunk, 1.0), None, tracker=self.tracker, deferred=(
                _Recorder() if fixed is not None else _TimedPlanner(
                    self, model, parallel, hardware, budget_bytes=0, stage=stage, chunk=chunk,
                    downgrade=downgrade,
                    imbalance_step=GATE_IMBALANCE_STEP, engine=engine,
                    budget_quantum_bytes=max(self.path.graph(chunk, 1.0).unmitigated_bytes >> GATE_BUDGET_SHIFT, 1))))
            for chunk in range(parallel.vp)}
        for executor in self.executors.values():
            executor.agreed = True  # plans and budgets are agreed over the EP group (step 2)
        self.dual = None
        if dual:
            from bagualu2.exec import DualBatchExecutor

            self.dual = DualBatchExecutor(*self.executors.values())
        self.orders = PointOrders(engine)
        # Megatron-Core's order pairs F and B unless a plan re-runs an all-to-all (full recompute, a recomputed
        # dispatch or combine): it refuses the overlap for the whole run, so one answer per stage from every
        # chunk's fixed plan (the same on every EP rank)
        self.megatron_pairs = execution == "megatron" and not any(
            reruns_all_to_all(self.orders.chains(recovery=(self.path.graph(chunk, 1.0), plan)))
            for chunk, plan in enumerate(fixed or ()))
        self._pending: tuple[int, float] | None = None  # (chunk, local imbalance) of the last forward
        started = time.perf_counter()
        self._warm(engine.max_imbalance)
        self.setup_s = time.perf_counter() - started  # before the first step, reported apart
        self._last: _Forward | None = None
        # progress(kind, micro-batch) before each forward ("forward") and after each backward ("backward"): the
        # trainer's watchdog and fault injections
        self.progress: Callable[[str, str], None] | None = None
        self.begin_step()

    def _warm(self, limit: float) -> None:
        """Plan ahead, before training (``setup_s``): the graphs of every imbalance bucket a gate can measure (the
        runtime's and the gates' grids up to ``limit``, ``costmodel.imbalance_limit``: the most one rank can
        receive) and the pre-gate plans of every need level at the ordinary planned imbalances, so the iterations
        do not pay for them."""
        if self.fixed is not None:
            return
        path = self.path
        for chunk in range(self.parallel.vp):
            rates = {1.0}
            rate = 1.0
            while rate < min(path.spike_threshold, limit):
                rate = round(rate + path.step, 10)
                rates.add(ceil_bucket(rate, path.step, limit))
            while rate < limit:
                rate = round(rate + path.spike_step, 10)
                rates.add(ceil_bucket(rate, path.spike_step, limit))
            for rate in sorted(rates):
                path.graph(chunk, rate)
            # the pre-gate plans of every need level at the planned imbalances of ordinary forwards (the planned
            # imbalance follows the group's busiest gates: buckets from balanced load up to the spike threshold)
            needs = path.needs
            planned = 1.0
            while planned <= min(path.spike_threshold, limit) + 1e-9:
                graph = path.graph(chunk, planned)
                level = 0
                while True:
                    budget = graph.unmitigated_bytes - math.ceil(needs.quantum * needs.ratio ** level)
                    if budget < graph.floor_bytes or level > 4096:
                        break
                    path.pre_gate(budget, chunk, planned=planned)
                    level += 1
                planned = round(planned + path.step, 10)
            deferred = self.executors[chunk].deferred
            rate = 1.0
            while rate <= limit:
                deferred.graph(ceil_bucket(rate, GATE_IMBALANCE_STEP, limit))
                rate = round(rate + GATE_IMBALANCE_STEP, 10)

    # ---- iteration ----------------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.iteration = Iteration(self.engine)  # the engine's M_max is the cap
        self._prepared: dict[tuple[int, int], _Forward] = {}
        self._done: dict[tuple[int, int], _Forward] = {}
        self.log: list[dict] = []
        self.points: list[str] = []
        self.reruns = 0
        self.planning_s = self.agree_s = 0.0
        self.tracker.peak_bytes = 0

    def _layout(self) -> list[int]:
        return [self.parallel.pp, self.parallel.vp, self.parallel.ep, self.stage]

    def state_dict(self) -> dict:
        return {"path": self.path.state_dict(), "pending": list(self._pending) if self._pending else None,
                "layout": self._layout()}

    def load_state_dict(self, state: dict) -> None:
        """The remembered gates (the planned imbalance's estimate) of the same stage of the same layout; under
        another layout (a resume with other --pp/--vp/--ep) the estimate starts over, as in a fresh run."""
        if state.get("layout", self._layout()) != self._layout():  # (a checkpoint without one: the same layout)
            return
        self.path.load_state_dict(state["path"])
        pending = state.get("pending")
        self._pending = None if pending is None else (int(pending[0]), float(pending[1]))

    # ---- one forward --------------------------------------------------------------------------------------------
    def prepare(self, chunk: int, mb: int) -> _Forward:
        """Budget and pre-gate plan of the forward of (chunk, mb) (idempotent until it runs)."""
        found = self._prepared.get((chunk, mb))
        if found is not None:
            return found
        started = time.perf_counter()
        index, phase = self._index[(chunk, mb)]
        budget, limit = self.iteration.budget(phase)
        gate = limit if limit is not None and self.downgrade == "graded" else budget
        pending = self._pending
        if self.fixed is not None:  # the plan is fixed: nothing to agree on
            self._pending = None
            found = self._prepared[(chunk, mb)] = _Forward(f"c{chunk}.m{mb}", index, phase, budget, gate,
                                                           self.fixed[chunk])
            self.planning_s += time.perf_counter() - started
            return found
        # no collective: under EP every rank's assigner was fed the group's bytes and the gates' group maxima
        # (``run``), so budgets and the imbalance estimate are the same on every rank of the group
        imbalance = pending[1] if pending else 0.0
        if pending is not None:
            self.path.observe(pending[0], max(imbalance, 1.0))
            if self._last is not None:
                self._last.imbalance = max(imbalance, 1.0)
        self._pending = None
        scale = self.prediction_scale
        plan = self.path.pre_gate(budget if scale == 1.0 else int(budget / scale), chunk)
        found = self._prepared[(chunk, mb)] = _Forward(f"c{chunk}.m{mb}", index, phase, budget,
                                                       gate if scale == 1.0 else int(gate / scale), plan)
        self.planning_s += time.perf_counter() - started
        return found

    def _after_forward(self, record, graph, chunk: int) -> tuple[bool, int, int]:
        """``(overflow, recorded bytes, own prediction)`` of a forward just run. Overflow: are the activations in
        flight above the cap on any rank of the EP group (which re-runs together; only with the safety net)?
        Recorded bytes: what the budget assigner records — the bytes measured, under EP the most any rank of the
        group kept (so every rank records the same number). One all-reduce under EP, none otherwise."""
        started = time.perf_counter()
        kept = record.device_bytes
        own = self._cost(chunk, record.plan).activation_bytes_received(graph, dict(record.received_tokens))
        # the most in flight while the forward ran: in a fused point the other micro-batch's backward may have
        # released its bytes before the forward ended
        most_in_flight = max(self.tracker.high_water_bytes, self.tracker.in_flight_bytes)
        over = float(self.safety_net and self.capped and most_in_flight > self.cap_bytes)
        agreed = time.perf_counter()
        self.planning_s += agreed - started
        if self.ep_group is None or self.fixed is not None:
            return over > 0, kept, own
        over, most = agree_max([over, float(kept)], self.ep_group)  # float64: exact for any byte count here
        self.agree_s += time.perf_counter() - agreed
        return over > 0, int(most), own

    def _cost(self, chunk: int, plan: Plan):
        """``evaluate`` of ``plan`` on the chunk's traced graph (the stage engine's memo)."""
        return self.engine.cost(plan, 1.0, chunk)

    def run(self, chunk: int, mb: int, layers: Callable[[Any], Any], x: Any, moes=()) -> Any:
        """Run ``layers(x)`` as the forward of (chunk, mb) under its plan (called by the chunk's module;
        ``moes``: its MoE modules, whose routing counts a re-run must not count twice)."""
        forward = self.prepare(chunk, mb)
        if self.progress is not None:
            self.progress("forward", forward.name)
        executor = self.executors[chunk]
        stats = [routing_stats(moe) for moe in moes]
        loads = [s.load for s in stats]
        self.tracker.watch()
        with executor.micro_batch(forward.name, plan=forward.plan, budget_bytes=forward.gate_budget_bytes) as record:
            out = layers(x)
        rerun = False
        graph = executor.graph
        over, recorded, predicted = self._after_forward(record, graph, chunk)  # its own time into planning_s, agree_s
        if over:
            # a misprediction: free this micro-batch and run it again with full recompute (no restart)
            executor.release(forward.name)
            for s, load in zip(stats, loads):
                s.load = load
            rerun = True
            self.reruns += 1
            self.tracker.watch()
            with executor.micro_batch(forward.name, plan=self.path.pre_gate(0, chunk), budget_bytes=0) as record:
                out = layers(x)
            _, recorded, predicted = self._after_forward(record, graph, chunk)
        started = time.perf_counter()
        kept = record.device_bytes
        self.iteration.record_forward(forward.index, recorded)
        mean = graph.mean_routed_tokens
        received = dict(record.received_tokens)
        most = record.group_max_tokens  # = received without an EP group
        rates = [received[layer] / mean for layer in sorted(received)] if mean else []
        if mean and most:  # the estimate of the next forward's imbalance: the group's busiest rank
            self._pending = (chunk, max(max(most[layer] / mean for layer in most), 1.0))
        cost, summary = self._cost(chunk, record.plan), _summary(record.plan)
        forward.plan = record.plan
        self._last = forward
        del self._prepared[(chunk, mb)]
        self._done[(chunk, mb)] = forward
        self.log.append({"stage": self.stage + chunk * self.parallel.pp, "chunk": chunk, "microbatch": mb,
                         "phase": forward.phase, "budget_bytes": forward.budget_bytes, "kept_bytes": kept,
                         "predicted_bytes": predicted, "imbalance": rates,
                         "plan": summary,
                         "action": "rerun" if rerun else "changed" if record.downgraded else "keep",
                         "recompute_flops": cost.recompute_flops})
        self.planning_s += time.perf_counter() - started
        return out

    def note_routing(self, counts) -> None:
        """Attach the last forward's tokens per expert (this rank's, per MoE layer) as max/mean per layer."""
        if self.log and counts:
            self.log[-1]["expert_imbalance"] = [round(float(c.max()) / max(float(c.float().mean()), 1e-9), 4)
                                                for c in counts if c is not None]

    def backward_callback(self, chunk: int, mb: int) -> Callable[[], None]:
        def done() -> None:
            forward = self._done.pop((chunk, mb))
            self.executors[chunk].release(forward.name)
            self.iteration.record_backward(forward.index)
            if self.progress is not None:
                self.progress("backward", forward.name)
        return done

    # ---- fused points -------------------------------------------------------------------------------------------
    def flush_offloads(self, keep: str | None = None) -> None:
        """Start the deferred device->host copies of every forward in flight but ``keep``'s."""
        if self.dual is None:
            return
        for (chunk, _), forward in self._done.items():
            if forward.name != keep:
                executor = self.executors[chunk]
                if executor.record(forward.name).pending_offloads:
                    executor.offload_now(forward.name)

    def _batch(self, key: tuple[int, int] | None, *, running: bool = False):
        """``(graph, plan)`` of a forward done (its agreed imbalance's bucket graph) for the chains, or None."""
        forward = self._done.get(key) if key is not None else None
        if forward is None:
            return None
        rate = forward.imbalance if forward.imbalance is not None else self.path.planned(key[0])
        return self.path.graph(key[0], ceil_bucket(rate, self.path.step, self.engine.max_imbalance)), forward.plan

    def point(self, *, forward: tuple[int, int], backward: tuple[int, int], previous, following,
              run_forward: Callable[[], None], run_backward: Callable[[], None]) -> None:
        """Run the fused scheduling point F_x B_y (with O_{x-1}, R_{y+1}) in the runtime's order."""
        if self.dual is None:
            raise RuntimeError("fused points need a provisioner made with dual=True")
        x = self.prepare(*forward)
        started = time.perf_counter()
        prev = self._done.get(previous) if previous is not None and previous != backward else None
        self.flush_offloads(keep=prev.name if prev is not None else None)
        nxt = self._done.get(following) if following not in (None, forward, backward) else None
        y = self._done[backward]
        chains = self.orders.chains(
            forward=(self.path.graph(forward[0], self.path.planned(forward[0])), x.plan),
            backward=self._batch(backward),
            offload=self._batch(previous) if prev is not None else None,
            recovery=self._batch(following) if nxt is not None else None)
        order = (self.orders.order(chains) if self.execution == "fused"
                 else megatron_overlapped(chains, pair=self.megatron_pairs))
        self.planning_s += time.perf_counter() - started
        self.points.append(f"F{x.name} B{y.name}: {order}")
        self.dual.run(order, chains, forward=run_forward, backward=(y.name, run_backward),
                      offload=prev.name if prev is not None and chains.offload is not None else None,
                      recovery=nxt.name if nxt is not None and chains.recovery is not None else None)
        if self.orders.pipeline_degree == 1 or (prev is not None and prev.name in self.executors[previous[0]]):
            self.flush_offloads()  # at x - y = 1 no point's O copies x: its copies start right after its point


class _TimedPlanner(DeferredPlanner):
    """exec's deferred planner, its after-gate decisions timed into the provisioner's planning seconds."""

    def __init__(self, owner: "Provisioner", *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.owner = owner

    def after_gate(self, plan, layer, received_tokens, *, budget_bytes=None):
        started = time.perf_counter()
        try:
            return super().after_gate(plan, layer, received_tokens, budget_bytes=budget_bytes)
        finally:
            self.owner.planning_s += time.perf_counter() - started


class _Recorder:
    """The deferred planner of a fixed policy: the gates only report what they routed; the plan never changes."""

    mode = "paper"
    fixed = True  # never changes a plan: exec skips the EP agreement of the gate

    def after_gate(self, plan, layer, received_tokens, *, budget_bytes=None):
        return None

    def downgrade(self, plan, layer):
        return plan


def _summary(plan: Plan) -> str:
    """``none`` or the number of mitigated savings per strategy, e.g. ``recompute=12 offload=3``."""
    if not plan.entries:
        return "none"
    counts: dict[str, int] = {}
    for _, strategy in plan.entries:
        name = getattr(strategy, "value", str(strategy)).lower()
        counts[name] = counts.get(name, 0) + 1
    return " ".join(f"{name}={count}" for name, count in sorted(counts.items()))
