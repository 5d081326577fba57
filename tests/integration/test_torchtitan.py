"""The bagualu2 converter inside torchtitan's own trainer (two processes under torchrun, gloo, CPU): the DeepSeek-V3
debug model cut to 4 layers, pipeline degree 2 with 1F1B, 4 micro-batches a step (``torchtitan_harness.py``).

One run without the converter, one with it (``flexible``, exact plans, a cap under which both stages must
mitigate), same seed:

* every gradient of every step is the plain run's, bitwise (a digest per rank and step);
* every micro-batch of both stages keeps exactly what ``evaluate`` predicts for the plan it ran, within its
  budget, and what a stage holds in flight never exceeds the cap;
* each stage reports exactly the schedule's 4 micro-batches a step, numbered 0-3: torch's shape-inference forward
  before the first step is not counted;
* the gate re-planned at least once, and both stages ran mitigated plans;
* torchtitan's own metric loggers (TensorBoard here) receive each stage's kept MiB per micro-batch every step.

And the same pair for torchtitan's Qwen3 MoE debug model (2 layers, 16 experts) in one process without a pipeline,
under torchtitan's CPU autocast.

And under expert parallelism (4 processes: pipeline degree 2 x expert parallelism 2 borrowed from FSDP's shard
degree 2, the grouped-GEMM experts), with a spike from step 2 (every pick goes to expert-parallel rank 0's experts):
``static-under`` fits without the spike and runs out of memory on it, under the same cap ``flexible`` fits, keeps
what ``evaluate`` predicts at the rows the gate counted (to 1 KiB), re-plans at the gate, and its gradients are the
unplanned run's, bitwise.

Skipped without torchtitan (``pip install -e ".[torchtitan]"``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bagualu2.integrations.torchtitan_stage import read_report
from forkrun import FORKRUN, forked

# find_spec, not an import: torchtitan 0.2.2 imports triton at import time, which a CPU machine lacks (the harness
# stands in for it in its own processes)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="needs torchtitan")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).with_name("torchtitan_harness.py")
STEPS = 3
MICROBATCHES = 4
CAP_MIB = 10  # stage 0 holds 2 micro-batches of ~10.7 MiB, stage 1 one of ~11.5 MiB: both must mitigate
TIMEOUT_S = 300
WORDS = ("the a of and to in is was for on with as by at from that this it be are model expert router token "
         "layer pipeline stage micro batch gradient loss train step data parallel tensor memory").split()


def make_assets(root: Path) -> tuple[Path, Path]:
    """A byte-level BPE tokenizer and a local text dataset (torchtitan's ``c4_test`` reads a folder of JSON lines)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120))) + "." for _ in range(400)]
    data = root / "c4_test"
    data.mkdir(parents=True)
    (data / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=512, special_tokens=[bos, eos], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assets = root / "tokenizer"
    assets.mkdir()
    tokenizer.save(str(assets / "tokenizer.json"))
    (assets / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": eos, "add_bos_token": True, "add_eos_token": True}))
    return assets, data


PIPELINE = ("--model.name", "deepseek_v3", "--model.flavor", "debugmodel_4l", "--training.local_batch_size",
            str(MICROBATCHES), "--training.seq_len", "64", "--training.steps", str(STEPS),
            "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
            "--parallelism.pipeline_parallel_microbatch_size", "1", "--parallelism.data_parallel_shard_degree", "1")
QWEN3 = ("--model.name", "qwen3", "--model.flavor", "debugmodel_moe_2l", "--training.local_batch_size", "2",
         "--training.seq_len", "64", "--training.steps", "2",  # one process, no pipeline; torchtitan's CPU autocast
         "--parallelism.data_parallel_shard_degree", "1")
QWEN3_CAP_MIB = 56  # a micro-batch keeps 61.5 MiB unmitigated


def launch(out: Path, assets: Path, data: Path, nproc: int, layout: tuple[str, ...], *extra: str,
           env: dict | None = None, ok: bool | None = True) -> str:
    """torchtitan's trainer under torchrun; its output. ``ok``: it must succeed (False: it must fail; None: either)."""
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BAGUALU2_PROBE_DIR": str(out), "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", **(env or {}),
           "PYTHONPATH": os.pathsep.join([str(HARNESS.parent), os.environ.get("PYTHONPATH", "")])}
    # torchrun's elastic agent with forked workers, itself forked from the tests' fork server (forkrun.py): torch
    # and torchtitan import once per launch, not once per worker
    proc = forked(FORKRUN, "--standalone", f"--nproc_per_node={nproc}", str(HARNESS), "--job.dump_folder",
                  str(out / "dump"), "--job.custom_config_module", "bagualu2.integrations.torchtitan",
                  "--model.hf_assets_path", str(assets), "--training.dataset", "c4_test", "--training.dataset_path",
                  str(data), *layout, "--activation_checkpoint.mode", "none", "--optimizer.implementation",
                  "foreach", "--metrics.log_freq", "1", "--debug.seed", "0", "--debug.deterministic", *extra,
                  cwd=ROOT, env=env, timeout=TIMEOUT_S)
    assert ok is None or (proc.returncode == 0) == ok, (proc.stdout + proc.stderr)[-6000:]
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchtitan")
    return root, *make_assets(root / "assets")


def _pair(root: Path, assets: Path, data: Path, name: str, nproc: int, layout: tuple[str, ...], cap_mib: int,
          *planned: str):
    """A plain run and a planned one (flexible, exact plans, ``cap_mib``, ``planned`` flags): the gradient digests
    of both and the planned run's reports, per rank. The plain run has the same ``[bagualu2]`` cap, unread: the
    converter is not listed (torchtitan's log says so)."""
    launch(root / f"{name}-plain", assets, data, nproc, layout, "--model.converters", "probe",
           "--bagualu2.memory_cap_mib", str(cap_mib))
    launch(root / f"{name}-planned", assets, data, nproc, layout, "--model.converters", "bagualu2,probe",
         "--bagualu2.memory_cap_mib", str(cap_mib), "--bagualu2.no-quantize", "--bagualu2.report_path",
         str(root / f"{name}-planned" / "report.{rank}.jsonl"), *planned)
    grads = {kind: [json.loads((root / f"{name}-{kind}" / f"grads.{rank}.json").read_text()) for rank in range(nproc)]
             for kind in ("plain", "planned")}
    reports = [read_report(root / f"{name}-planned" / f"report.{rank}.jsonl") for rank in range(nproc)]
    return grads, reports, (root / f"{name}-planned" / "log.txt").read_text()


@pytest.fixture(scope="module")
def runs(assets):
    return _pair(*assets, "dsv3", 2, PIPELINE, CAP_MIB, "--metrics.enable_tensorboard",
                 "--metrics.save_for_all_ranks")


@pytest.mark.launch
def test_gradients_are_the_plain_runs_bitwise(runs):
    grads, _, _ = runs
    assert [len(steps) for steps in grads["plain"]] == [STEPS, STEPS]
    assert grads["planned"] == grads["plain"]


@pytest.mark.launch
def test_every_microbatch_keeps_the_prediction_within_its_budget(runs):
    _, reports, _ = runs
    cap = CAP_MIB << 20
    for rank, report in enumerate(reports):
        assert report["stage"] == rank and len(report["steps"]) == STEPS
        for step, rows in enumerate(report["steps"], start=1):
            assert [row["microbatch"] for row in rows] == list(range(MICROBATCHES))  # no shape-inference forward
            assert {row["step"] for row in rows} == {step}
            for row in rows:
                assert row["kept_bytes"] == row["predicted_bytes"] <= row["budget_bytes"] <= cap
                assert row["plan"] != "none"  # both stages had to mitigate
            in_flight = 2 - rank  # 1F1B: stage 0 holds two micro-batches at a time, stage 1 one
            for first in range(MICROBATCHES - in_flight + 1):
                assert sum(row["kept_bytes"] for row in rows[first:first + in_flight]) <= cap


@pytest.mark.launch
def test_the_gate_replans_and_torchtitan_logs_the_kept_bytes(runs):
    _, reports, log = runs
    assert any(row["downgraded_layers"] for report in reports for rows in report["steps"] for row in rows)
    for stage in (0, 1):
        for step in range(1, STEPS + 1):
            assert f"bagualu2 step {step} stage {stage}: kept MiB per micro-batch [" in log


@pytest.mark.launch
def test_torchtitans_metric_loggers_receive_the_kept_bytes(runs, assets):
    """Each stage's kept and budget MiB per micro-batch, every step, in torchtitan's TensorBoard events."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    _, reports, _ = runs
    root = assets[0]
    for rank, report in enumerate(reports):
        (events,) = (root / "dsv3-planned" / "dump").glob(f"tb/*/rank_{rank}/events*")
        accumulator = event_accumulator.EventAccumulator(str(events))
        accumulator.Reload()
        for microbatch in range(MICROBATCHES):
            scalars = accumulator.Scalars(f"bagualu2/stage{rank}/kept_mib/mb{microbatch}")
            assert [e.step for e in scalars] == list(range(1, STEPS + 1))
            kept = [row["kept_bytes"] / 2**20 for rows in report["steps"] for row in rows
                    if row["microbatch"] == microbatch]
            assert [e.value for e in scalars] == pytest.approx(kept, rel=1e-6)


@pytest.mark.launch
def test_qwen3_moe_without_a_pipeline_under_autocast(assets):
    """Qwen3 MoE (torchtitan 0.2.2 has no pipeline split for it) in one process: every forward a micro-batch of its
    own, torchtitan's CPU autocast on (re-runs in backward compute under it): bitwise gradients, exact bytes."""
    grads, reports, log = _pair(*assets, "qwen3", 1, QWEN3, QWEN3_CAP_MIB)
    assert grads["planned"] == grads["plain"] and len(grads["plain"][0]) == 2
    (report,) = reports
    rows = [row for step in report["steps"] for row in step]
    assert len(rows) == 2 and all(row["microbatch"] == 0 for row in rows)
    for row in rows:
        assert row["kept_bytes"] == row["predicted_bytes"] <= row["budget_bytes"] == QWEN3_CAP_MIB << 20
        assert "RECOMPUTE" in row["plan"] and set(row["received"]) == {"0", "1"}
    assert "bagualu2 step 2 stage 0: kept MiB per micro-batch [" in log
    unread = ("bagualu2: the [bagualu2] section sets memory_cap_mib, but model.converters (probe) does not list "
              "bagualu2, so nothing is provisioned; add --model.converters bagualu2")
    assert unread in (assets[0] / "qwen3-plain" / "log.txt").read_text() and unread not in log


FSDP = ("--model.name", "deepseek_v3", "--model.flavor", "debugmodel_4l", "--training.local_batch_size", "2",
        "--training.seq_len", "64", "--training.steps", "2", "--parallelism.data_parallel_shard_degree", "2")
FSDP_CAP_MIB = 18  # a micro-batch keeps ~19.5 MiB unmitigated


@pytest.mark.launch
def test_fsdp_in_bf16_without_a_pipeline(assets):
    """FSDP2 over two ranks, bf16 parameters: the norms save fp32 copies of their inputs (no op saves the inputs),
    so they cannot re-run and never stand by for the gate; the plans re-run the MoE modules. Bitwise gradients,
    exact bytes."""
    grads, reports, _ = _pair(*assets, "fsdp", 2, FSDP, FSDP_CAP_MIB)
    assert grads["planned"] == grads["plain"] and len(grads["plain"][0]) == 2
    rows = [row for report in reports for step in report["steps"] for row in step]
    assert len(rows) == 4 and all("RECOMPUTE" in row["plan"] for row in rows)
    assert all(row["kept_bytes"] == row["predicted_bytes"] <= row["budget_bytes"] for row in rows)


# ---- expert parallelism: a spike overflows a plan fixed for balanced routing, flexible re-plans at the gate -------
EP_STEPS = 4
EP_CAP_MIB = 16  # stage 0 holds two micro-batches of ~7.8 MiB unmitigated, ~8.2 MiB when a spike doubles its rows
EXPERT_PARALLEL = ("--model.name", "deepseek_v3", "--model.flavor", "debugmodel_4l", "--training.local_batch_size",
                   str(MICROBATCHES), "--training.seq_len", "64", "--training.steps", str(EP_STEPS),
                   "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
                   "--parallelism.pipeline_parallel_microbatch_size", "1", "--parallelism.data_parallel_shard_degree",
                   "2", "--parallelism.expert_parallel_degree", "2")
SPIKE = {"BAGUALU2_PROBE_GROUPED_MM": "1", "BAGUALU2_PROBE_BIAS": "10"}  # from step 2 every pick goes to EP rank 0
CALM = {"BAGUALU2_PROBE_GROUPED_MM": "1"}
# Kept equals the prediction in every local run; one CI run (2 cores, a second test process beside it) saw one
# rank of stage 1 off by 32 to 832 bytes (below 0.01 %), most likely a weight cast's freed address reused by the
# dispatch's indices in the trace (the trace now keeps such casts alive); the check still allows 1 KiB.
EP_SLACK_BYTES = 1024
EP_PLANNED = ("--bagualu2.memory_cap_mib", str(EP_CAP_MIB), "--bagualu2.no-quantize")


@pytest.fixture(scope="module")
def expert_parallel(assets):
    """PP 2 x EP 2 (borrowed from FSDP's data-parallel shard degree 2), 4 processes, the grouped-GEMM experts: an
    unplanned run and flexible under a spike, static-under without and with it."""
    root, tokenizer, data = assets
    launch(root / "ep-plain", tokenizer, data, 4, EXPERT_PARALLEL, "--model.converters", "probe", env=SPIKE)
    launch(root / "ep-flexible", tokenizer, data, 4, EXPERT_PARALLEL, "--model.converters", "bagualu2,probe",
         *EP_PLANNED, "--bagualu2.report_path", str(root / "ep-flexible" / "report.{rank}.jsonl"), env=SPIKE)
    under = ("--model.converters", "bagualu2,probe", "--bagualu2.policy", "static-under", *EP_PLANNED)
    launch(root / "ep-under-calm", tokenizer, data, 4, EXPERT_PARALLEL, *under, env=CALM)
    spiked = launch(root / "ep-under-spike", tokenizer, data, 4, EXPERT_PARALLEL, *under, env=SPIKE, ok=False)
    grads = {kind: [json.loads((root / f"ep-{kind}" / f"grads.{rank}.json").read_text()) for rank in range(4)]
             for kind in ("plain", "flexible")}
    reports = [read_report(root / "ep-flexible" / f"report.{rank}.jsonl") for rank in range(4)]
    return grads, reports, spiked


@pytest.mark.launch
def test_expert_parallel_flexible_fits_a_spike_that_static_under_does_not(expert_parallel):
    grads, reports, spiked = expert_parallel
    assert "ActivationOutOfMemoryError" in spiked  # the plan fixed for balanced routing overflows the cap
    assert [len(steps) for steps in grads["plain"]] == [EP_STEPS] * 4
    assert grads["flexible"] == grads["plain"]  # re-planned, recomputed experts included: bit for bit
    cap = EP_CAP_MIB << 20
    for rank, report in enumerate(reports):
        stage, in_flight = rank // 2, 2 - rank // 2  # ranks 0, 1: stage 0 (two in flight); 2, 3: stage 1
        assert report["stage"] == stage and len(report["steps"]) == EP_STEPS
        for rows in report["steps"]:
            assert [row["microbatch"] for row in rows] == list(range(MICROBATCHES))
            for row in rows:  # the gate counts the dispatched rows: kept = evaluate's prediction (to EP_SLACK_BYTES)
                assert abs(row["kept_bytes"] - row["predicted_bytes"]) <= EP_SLACK_BYTES and row["kept_bytes"] <= cap
            for first in range(MICROBATCHES - in_flight + 1):
                assert sum(row["kept_bytes"] for row in rows[first:first + in_flight]) <= cap
    spiked_rows = [row for rank in (0, 2) for rows in reports[rank]["steps"][1:] for row in rows]
    assert min(row["imbalance"] for row in spiked_rows) > 1.5  # EP rank 0 receives every pick after step 1
    assert any(row["downgraded_layers"] for rank in (0, 1) for rows in reports[rank]["steps"][1:] for row in rows)


FP32_STEPS = 2
FP32_CAP_MIB = 12  # stage 1 keeps ~12.50 MiB at balanced rows under its pre-gate plan: a spike must be re-planned
FP32 = (*EXPERT_PARALLEL, "--training.steps", str(FP32_STEPS), "--training.mixed_precision_param", "float32")


@pytest.mark.launch
def test_expert_parallel_in_fp32_with_a_pipeline(assets, tmp_path):
    """PP 2 x EP 2 with fp32 parameters: the grouped GEMMs keep only their own bf16 casts of the rows, which no op
    makes and nothing can recompute. The gate may still offload them (they are stored after it), and the full
    downgrade every expert-parallel rank runs when any rank's gate changed its plan offloads them: bit for bit,
    kept bytes as predicted and within the cap (the gate once kept a plan that fit only balanced rows)."""
    _, tokenizer, data = assets
    launch(tmp_path / "plain", tokenizer, data, 4, FP32, "--model.converters", "probe", env=SPIKE)
    launch(tmp_path / "planned", tokenizer, data, 4, FP32, "--model.converters", "bagualu2,probe",
           "--bagualu2.memory_cap_mib", str(FP32_CAP_MIB), "--bagualu2.no-quantize", "--bagualu2.report_path",
           str(tmp_path / "planned" / "report.{rank}.jsonl"), env=SPIKE)
    for rank in range(4):
        plain, planned = ((tmp_path / kind / f"grads.{rank}.json").read_text() for kind in ("plain", "planned"))
        assert json.loads(planned) == json.loads(plain) and len(json.loads(plain)) == FP32_STEPS
    cap = FP32_CAP_MIB << 20
    rows = [row for rank in range(4) for steps in read_report(tmp_path / "planned" / f"report.{rank}.jsonl")["steps"]
            for row in steps]
    assert len(rows) == 4 * FP32_STEPS * MICROBATCHES
    for row in rows:
        assert abs(row["kept_bytes"] - row["predicted_bytes"]) <= EP_SLACK_BYTES and row["kept_bytes"] <= cap
    assert any(row["stage"] == 1 and row["downgraded_layers"] and ".dispatch." in row["plan"]
               and "OFFLOAD" in row["plan"] for row in rows)  # the rows' casts offloaded after the gate

    # the least a stage can keep grows with the rows a rank receives (the module around the experts keeps what it
    # saves): a cap the start-up check accepts runs through the spike, even one just above what it refuses
    refused = launch(tmp_path / "refused", tokenizer, data, 4, FP32, "--model.converters", "bagualu2",
                     "--bagualu2.memory_cap_mib", "1", "--bagualu2.no-quantize", env=SPIKE, ok=False)
    needs = [int(k) * int(n) for k, n in re.findall(r"needs: (\d+) micro-batch\(es\) in flight x (\d+) bytes", refused)]
    assert needs, refused[-3000:]
    least_mib = f"{(max(needs) + 64) / (1 << 20):.7f}"
    launch(tmp_path / "least", tokenizer, data, 4, FP32, "--model.converters", "bagualu2,probe",
           "--bagualu2.memory_cap_mib", least_mib, "--bagualu2.no-quantize", "--bagualu2.report_path",
           str(tmp_path / "least" / "report.{rank}.jsonl"), env=SPIKE)
    for rank in range(4):
        assert ((tmp_path / "least" / f"grads.{rank}.json").read_text()
                == (tmp_path / "plain" / f"grads.{rank}.json").read_text())


MISUSE = """
import copy, sys
sys.path.insert(0, "tests/integration")
import torchtitan_harness as harness
harness.setup()
import torch
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_args
import bagualu2.integrations.torchtitan as titan

def model_and_converter(*flags):
    job = ConfigManager().parse_args(["--job.custom_config_module", "bagualu2.integrations.torchtitan",
                                      "--activation_checkpoint.mode", "none", "--training.seq_len", "64", *flags])
    args = copy.deepcopy(deepseekv3_args["debugmodel_4l"]); args.update_from_config(job)
    torch.manual_seed(0); model = DeepSeekV3Model(args)
    with torch.no_grad(): model.init_weights(buffer_device=torch.device("cpu"))
    converter = titan.Bagualu2Converter(job, ParallelDims(1, 1, 1, 1, 1, 1, 1, 1))
    converter.convert(model)
    return model, converter, torch.randint(0, args.vocab_size, (2, 64))

model, converter, tokens = model_and_converter("--bagualu2.memory_cap_mib", "20", "--bagualu2.no-quantize")
try:
    converter.convert(model)
except ValueError as exc:
    print("twice:", exc)
try:
    (model(tokens).float().pow(2).mean() + model(tokens).float().pow(2).mean()).backward()
except ValueError as exc:
    print("two forwards:", exc)
try:
    model_and_converter("--compile.enable", "--compile.components", "model")
except ValueError as exc:
    print("compile:", exc)
model, converter, tokens = model_and_converter("--bagualu2.policy", "off")
model(tokens).float().pow(2).mean().backward()
converter.post_optimizer_hook([model])
print("off measures:", sorted(converter.step_metrics()))
"""


@pytest.mark.launch
def test_misuse_of_the_converter_is_one_line_and_off_measures():
    """In a process of its own (the harness's CPU stand-ins for torchtitan's GPU kernels): a model converted twice,
    two forwards before a backward without a pipeline, a compiled model, and ``policy = "off"``, which measures
    without a cap."""
    proc = subprocess.run([sys.executable, "-c", MISUSE], cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    assert "converted by bagualu2 already" in lines["twice"]
    assert lines["compile"].startswith("compile.enable with compile.components including model is not supported")
    assert "each forward's backward must run before the next forward" in lines["two forwards"]
    assert "bagualu2/stage0/kept_mib/mb0" in lines["off measures"]


@pytest.mark.launch
def test_a_resumed_run_counts_on_and_a_stage_without_layers_runs_unplanned(assets, tmp_path):
    """Four pipeline stages of the 4-layer model: torchtitan's split leaves the last only the norm and the output,
    which runs unplanned. Two steps with checkpoints, then a launch resumed to three: the converter's steps (its log,
    its report, which keeps the first launch's lines) go on from the checkpoint's."""
    _, assets_path, data = assets
    layout = ("--model.name", "deepseek_v3", "--model.flavor", "debugmodel_4l", "--training.local_batch_size", "5",
              "--training.seq_len", "64", "--parallelism.pipeline_parallel_degree", "4",
              "--parallelism.pipeline_parallel_schedule", "1F1B", "--parallelism.pipeline_parallel_microbatch_size",
              "1", "--parallelism.data_parallel_shard_degree", "1")
    common = ("--model.converters", "bagualu2", "--bagualu2.memory_cap_mib", "9", "--bagualu2.no-quantize",
              "--bagualu2.report_path", str(tmp_path / "report.{rank}.jsonl"), "--checkpoint.enable",
              "--checkpoint.no-last_save_model_only", "--checkpoint.interval", "1", "--checkpoint.folder",
              str(tmp_path / "checkpoints"))
    first = launch(tmp_path / "first", assets_path, data, 4, layout, "--training.steps", "2", *common)
    assert "pipeline stage 3 holds no transformer layer: it runs unplanned" in first
    resumed = launch(tmp_path / "resumed", assets_path, data, 4, layout, "--training.steps", "3", *common)
    assert "Training starts at step 3" in resumed and "bagualu2 step 3 stage 0:" in resumed
    assert "bagualu2 step 1 stage 0:" not in resumed
    assert read_report(tmp_path / "report.0.jsonl")["step_numbers"] == [1, 2, 3]


FAMILIES = """
import copy, sys
sys.path.insert(0, "tests/integration")
import torchtitan_harness as harness
harness.setup()
import torch
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_args
from torchtitan.models.gpt_oss import GptOssModel, gptoss_configs
from torchtitan.models.llama4 import Transformer as Llama4, llama4_args
import bagualu2.integrations.torchtitan as titan

def job(*flags):
    return ConfigManager().parse_args(["--job.custom_config_module", "bagualu2.integrations.torchtitan",
                                       "--activation_checkpoint.mode", "none", "--training.seq_len", "64", *flags])

def build(cls, args, config):
    args = copy.deepcopy(args); args.update_from_config(config)
    torch.manual_seed(0); model = cls(args)
    with torch.no_grad(): model.init_weights(buffer_device=torch.device("cpu"))
    return model, args

# llama4 (its MoE every other layer, shared experts): bytes and gradients against the plain model
args = copy.deepcopy(llama4_args["debugmodel"]); args.n_layers = 4; args.moe_args.use_grouped_mm = False
config = job("--bagualu2.memory_cap_mib", "8", "--bagualu2.no-quantize")
plain, _ = build(Llama4, args, config)
model, built = build(Llama4, args, config)
converter = titan.Bagualu2Converter(config, ParallelDims(1, 1, 1, 1, 1, 1, 1, 1)); converter.convert(model)
tokens = torch.randint(0, built.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
for net in (plain, model):
    net(tokens).float().pow(2).mean().backward()
converter.post_optimizer_hook([model])
same = all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters()))
(row,) = converter.provisioners[0].last_rows
labels = set(titan.op_map(model).values())
print("llama4:", same, row["kept_bytes"] == row["predicted_bytes"] <= row["budget_bytes"], row["plan"] != "none",
      {"moe", "router", "dispatch", "shared_fc1", "mlp_fc1"} <= labels)

# gpt-oss: its experts hold mlp1_weight / mlp2_weight; every layer is a MoE layer
with torch.device("meta"):
    gpt = copy.deepcopy(gptoss_configs["debugmodel"]); gpt.n_layers = 2
    model = GptOssModel(gpt)
labels = titan.op_map(model)
titan.Bagualu2Converter(job(), ParallelDims(1, 1, 1, 1, 1, 1, 1, 1)).convert(model)
print("gpt_oss:", sorted(path for path, label in labels.items() if label in ("router", "dispatch")))

# the model's keyword arguments (flex attention's masks) reach the trace
class Keyword(DeepSeekV3Model):
    def forward(self, tokens, *, scale):
        return super().forward(tokens) * scale

args = copy.deepcopy(deepseekv3_args["debugmodel_4l"])
config = job("--bagualu2.memory_cap_mib", "20", "--bagualu2.no-quantize")
model, built = build(Keyword, args, config)
converter = titan.Bagualu2Converter(config, ParallelDims(1, 1, 1, 1, 1, 1, 1, 1)); converter.convert(model)
model(tokens % built.vocab_size, scale=2.0).float().pow(2).mean().backward()
converter.post_optimizer_hook([model])
(row,) = converter.provisioners[0].last_rows
print("keywords:", row["kept_bytes"] == row["predicted_bytes"])
"""


@pytest.mark.launch
def test_llama4_and_gpt_oss_and_a_models_keyword_arguments():
    """torchtitan's other MoE families: Llama 4 (MoE every other layer, shared experts) exact in bytes and bitwise in
    gradients; gpt-oss's experts (``mlp1_weight`` / ``mlp2_weight``) found in every layer; and a forward's keyword
    arguments (flex attention's masks) passed to the trace (it ran the model without them)."""
    proc = subprocess.run([sys.executable, "-c", FAMILIES], cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    assert lines["llama4"] == "True True True True"
    assert lines["gpt_oss"] == "['layers.0.moe.experts', 'layers.0.moe.router', 'layers.1.moe.experts', " \
                               "'layers.1.moe.router']"
    assert lines["keywords"] == "True"
