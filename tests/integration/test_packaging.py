"""A torch-free install: ``pip install bagualu2`` without extras gives the algorithms and the torch-free commands;
the commands that need torch say which extra to install, in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.launch]

ROOT = Path(__file__).resolve().parents[2]


def test_a_torch_free_install_runs_the_algorithms_and_names_the_extra(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)  # this environment's pip installs into it (--python)
    python = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    source = tmp_path / "source"  # a copy: building in place would leave build/ in the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "__pycache__",
                                                                ".pytest_cache", ".hypothesis", ".benchmarks"))
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile",
                              "--disable-pip-version-check", str(source)], env=env, capture_output=True, text=True,
                             timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    code = ("import importlib.util, sys\n"
            "assert importlib.util.find_spec('torch') is None and importlib.util.find_spec('tokenizers') is None\n"
            "import bagualu2.costmodel, bagualu2.budget, bagualu2.mitigation, bagualu2.fusion, bagualu2.runtime\n"
            "import bagualu2.sim, bagualu2.cli\n"
            "from bagualu2.mitigation import greedy\n"
            "from bagualu2.costmodel import ParallelConfig, build_graph, presets\n"
            "model, parallel = presets.model('tiny-moe')\n"
            "graph = build_graph(model, parallel, presets.hardware('cpu'))\n"
            "assert greedy.solve(graph, graph.floor_bytes).status.name in ('OPTIMAL', 'FEASIBLE')\n")
    check = subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True, timeout=300,
                           cwd=tmp_path)
    assert check.returncode == 0, check.stderr[-3000:]
    cli = env_dir / "bin" / "bagualu2"
    plan = subprocess.run([str(cli), "plan"], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr[-3000:]
    train = subprocess.run([str(cli), "train", "--dry-run"], env=env, capture_output=True, text=True, timeout=300,
                           cwd=tmp_path)
    assert train.returncode == 2 and train.stderr.strip() == (
        "error: this needs the 'trainer' extra: pip install 'bagualu2[trainer]' (missing: torch, tokenizers; on CPU "
        "install torch==2.13.0 first)"), train.stderr
