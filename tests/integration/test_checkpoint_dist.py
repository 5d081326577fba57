"""Checkpoints of a PP=2 x DP=2 job on CPU/gloo under torchrun: every rank saves stage tensors (shared by the two
DP replicas of its stage), rank-specific tensors and job-wide replicated tensors, with a different key set on
each rank; each rank loads back bitwise ITS OWN values (DCP keeps one copy of a shared key), a corrupted newest
checkpoint makes every rank fall back to the previous one, and a shared key with rank-specific values is refused.

One launch runs the whole scenario (``SCRIPT``); the tests check what each rank reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.launch]

ROOT = Path(__file__).resolve().parents[2]
NPROC = 4
TIMEOUT_S = 120

SCRIPT = textwrap.dedent("""
    import json, random, sys
    from pathlib import Path
    import numpy as np, torch, torch.distributed as dist
    from reference_trainer import checkpoint as ck

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    stage = rank // 2  # PP=2 x DP=2: ranks 2s and 2s+1 replicate stage s
    root = Path(sys.argv[1])

    def make(step):
        g = torch.Generator().manual_seed(1000 * step + stage)  # the same on both replicas of a stage
        layers = {str(i): {"weight": torch.randn(8, 4, generator=g), "bias": torch.randn(4, generator=g).bfloat16()}
                  for i in range(2 * stage, 2 * stage + 2)}
        optim = {name: {"exp_avg": torch.randn(8, 4, generator=g), "step": torch.tensor(step, dtype=torch.int64)}
                 for name in layers}
        own = torch.Generator().manual_seed(1000 * step + 10 + rank)  # different on every rank
        torch.manual_seed(step * 7 + rank), random.seed(rank), np.random.seed(rank + step)
        return {f"stage{stage}": {"layers": layers, "optim": {"state": optim}},
                f"rank{rank}": {"rng": ck.rng_state(), "noise": torch.randn(16, generator=own),
                                 "data": ck.pack_json({"position": 100 * rank + step}, size=64),
                                 "ids": torch.randint(0, 255, (9,), generator=own).to(torch.uint8)},
                "job": {"step": torch.tensor(step), "embed": torch.arange(12.0).reshape(3, 4) * step}}

    def zeros(x):
        return {k: zeros(v) for k, v in x.items()} if isinstance(x, dict) else torch.zeros_like(x)

    def flat(x, p=""):
        out = {}
        for k, v in x.items():
            out.update(flat(v, p + k + ".") if isinstance(v, dict) else {p + k: v})
        return out

    def bitwise(a, b):
        fa, fb = flat(a), flat(b)
        return fa.keys() == fb.keys() and all(fa[k].dtype == fb[k].dtype and
            torch.equal(fa[k].reshape(-1).view(torch.uint8), fb[k].reshape(-1).view(torch.uint8)) for k in fa)

    report = {"rank": rank}
    p5 = ck.save(root, 5, make(5))
    p10 = ck.save(root, 10, make(10))
    latest = ck.find_latest(root)
    report["latest"] = [str(latest[0]), latest[1]]
    target = zeros(make(10))
    report["loaded_step"] = ck.load(latest[0], target)
    report["own_values_10"] = bitwise(target, make(10))
    report["data"] = ck.unpack_json(target[f"rank{rank}"]["data"])
    ck.set_rng_state(target[f"rank{rank}"]["rng"])  # saved right after make(10) seeded the three RNGs
    draws = [torch.rand(3).tolist(), random.random(), float(np.random.rand())]
    torch.manual_seed(70 + rank), random.seed(rank), np.random.seed(rank + 10)
    report["rng_restored"] = draws == [torch.rand(3).tolist(), random.random(), float(np.random.rand())]
    report["files"] = sorted(p.name for p in p10.iterdir())
    dist.barrier()
    if rank == 0:  # flip one byte of rank 3's shard of the newest checkpoint
        shard = p10 / "__3_0.distcp"
        data = bytearray(shard.read_bytes()); data[len(data) // 2] ^= 0x40; shard.write_bytes(bytes(data))
    dist.barrier()
    fallback = ck.find_latest(root)
    report["fallback"] = [str(fallback[0]), fallback[1]]
    target = zeros(make(5))
    report["fallback_step"] = ck.load(fallback[0], target)
    report["own_values_5"] = bitwise(target, make(5))
    try:  # the same key with a different value on every rank: DCP would keep one, so save refuses
        ck.save(root / "clash", 1, {"rng": torch.full((2,), float(rank))})
        report["clash"] = "saved"
    except ck.CheckpointError as exc:
        report["clash"] = str(exc)
    (root / "afile").write_text("x")
    try:
        ck.save(root / "afile", 1, make(1))
        report["afile"] = "saved"
    except ck.CheckpointError as exc:
        report["afile"] = str(exc)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.write("REPORT " + json.dumps(report) + "\\n")
    sys.stdout.flush()
    import os
    os._exit(0)  # the report is out: skip interpreter teardown, whose gloo thread destructors can abort under load
""")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt_dist")
    script = tmp / "scenario.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={NPROC}", str(script), str(tmp / "ckpts")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = sorted((json.loads(line[len("REPORT "):]) for line in proc.stdout.splitlines()
                      if line.startswith("REPORT ")), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == list(range(NPROC)), proc.stdout
    return tmp / "ckpts", reports, proc.stderr


def test_every_rank_loads_its_own_values(run):
    root, reports, _ = run
    for r in reports:
        assert r["latest"] == [str(root / "step-00000010"), 10] and r["loaded_step"] == 10
        assert r["own_values_10"] is True
        assert r["data"] == {"position": 100 * r["rank"] + 10}
        assert r["rng_restored"] is True
        assert r["files"] == [".metadata"] + [f"__{i}_0.distcp" for i in range(NPROC)] + ["manifest.json"]
    manifest = json.loads((root / "step-00000005" / "manifest.json").read_text())
    assert manifest["world_size"] == NPROC and manifest["step"] == 5
    # How DCP laid it out: one namespace, each key stored once; a rank's own keys in its own file, shared keys
    # (stage replicas, job-wide) spread over the ranks holding them (dedup_save_plans balances the bytes).
    import torch.distributed.checkpoint as dcp
    storage = dcp.FileSystemReader(root / "step-00000005").read_metadata().storage_data
    files: dict[str, str] = {}
    for index, info in storage.items():
        assert files.setdefault(index.fqn, info.relative_path) == info.relative_path  # stored once
    for rank in range(NPROC):
        own = {fqn for fqn in files if fqn.startswith(f"rank{rank}.")}
        assert len(own) == 6 and {files[fqn] for fqn in own} == {f"__{rank}_0.distcp"}
    for stage in range(NPROC // 2):
        shared = {files[fqn] for fqn in files if fqn.startswith(f"stage{stage}.")}
        assert shared <= {f"__{2 * stage}_0.distcp", f"__{2 * stage + 1}_0.distcp"}
    assert {"job.step", "job.embed"} <= files.keys()


def test_corrupted_newest_checkpoint_falls_back_on_every_rank(run):
    root, reports, stderr = run
    for r in reports:
        assert r["fallback"] == [str(root / "step-00000005"), 5] and r["fallback_step"] == 5
        assert r["own_values_5"] is True
    warnings = [line for line in stderr.splitlines() if line.startswith("warning: checkpoint")]
    assert warnings == [f"warning: checkpoint {root / 'step-00000010'} refused: file __3_0.distcp: sha256 mismatch; "
                        f"using {root / 'step-00000005'}"]  # once: rank 0 verifies and broadcasts


def test_shared_key_with_rank_specific_values_is_refused_on_every_rank(run):
    root, reports, _ = run
    clash = {r["clash"] for r in reports}
    assert len(clash) == 1 and "key 'rng' differs between ranks 0 and 1" in clash.pop()
    assert not (root / "clash").exists()
    afile = {r["afile"] for r in reports}
    assert afile == {f"checkpoint directory {root / 'afile'}: exists and is not a directory"}
