"""``torchrun`` for the tests, with its workers forked instead of started afresh.

``python tests/integration/forkrun.py TORCHRUN_ARGS -m MODULE ARGS`` parses the arguments with torchrun's own
parser and runs torchrun's elastic agent (``elastic_launch``: rendezvous, restarts, the monitor, the failure
report) on ``MODULE.main(ARGS)`` with ``start_method="fork"`` (``MODULE``: ``reference_trainer.train`` or
``reference_trainer.experiments.measure``; a returned non-zero int is the worker's exit code), or
``python tests/integration/forkrun.py TORCHRUN_ARGS tests/integration/torchtitan_harness.py ARGS`` on the harness's
``main(ARGS)`` after its ``prepare()`` (torchtitan's trainer). Torch and the module are imported once, here,
instead of once per worker and launch (about 3.5 s of CPU each; torchtitan's 5 s). Everything
from ``main`` on is what ``torchrun -m MODULE`` runs; the tests of the command line itself (``bagualu2 train``),
the two-node rendezvous and the chaos run still go through the ``torchrun`` executable.

FORKRUN, :func:`forked` go one step further for the tests: it runs ``python ARGS`` (this file, or ``-m MODULE`` for a
one-process run) in a child forked from a fork server that imported torch and the trainer once per test session,
so a launch costs its own work, not an interpreter start and a torch import.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import importlib.util
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import traceback
import uuid
import warnings
from pathlib import Path

import torch

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import elastic_launch

import reference_trainer.pipeline  # noqa: F401 (with torch.distributed.pipelining: the workers inherit them)

MODULES = ("reference_trainer.train", "reference_trainer.experiments.measure")
HERE = Path(__file__).resolve().parent
SCRIPTS = ("torchtitan_harness.py",)  # in this folder: ``prepare()``, then ``main(argv)`` in each worker
_main = None  # the module's main, set before the workers fork


def worker(*argv: str) -> None:
    code = _main(list(argv))
    if isinstance(code, int) and code:
        raise SystemExit(code)


def _entry(script: str, *, module: bool):
    """The workers' ``main``: of a module of ``MODULES``, or of a script of ``SCRIPTS`` after its ``prepare()``
    (run here, in the agent, so that the workers inherit what it imported and set up)."""
    path = Path(script).resolve()
    if (script not in MODULES) if module else (path.parent != HERE or path.name not in SCRIPTS):
        raise SystemExit(f"forkrun.py runs -m {' or -m '.join(MODULES)} or a script of {', '.join(SCRIPTS)}")
    if module:
        return importlib.import_module(script).main
    spec = importlib.util.spec_from_file_location(path.stem, path)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = loaded
    spec.loader.exec_module(loaded)
    loaded.prepare()
    return loaded.main


@record
def main(argv: list[str]) -> None:
    global _main
    args = torchrun.parse_args(argv)
    _main = _entry(args.training_script, module=args.module is True)
    if args.standalone:  # what torchrun's run() does for --standalone
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = torchrun.config_from_args(args)
    config.start_method = "fork"
    elastic_launch(config=config, entrypoint=worker)(*args.training_script_args)


STACKS_S = 5  # at a timeout: how long the hung processes get to write their stacks before SIGKILL
FORKRUN = str(Path(__file__).resolve())  # forked(FORKRUN, TORCHRUN_ARGS, "-m", MODULE, ARGS)
PRELOAD = ["torch", "torch.distributed.run", "reference_trainer.pipeline", *MODULES]


def _child(argv: list[str], cwd: str, env: dict, out_path: str, err_path: str) -> None:
    """In the forked child: become ``python ARGV`` in ``cwd`` with exactly ``env``, stdout and stderr to files."""
    os.setsid()  # its own process group: a timeout kills the agent and its workers together
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS"):  # read by OpenMP when torch loaded, in the server: apply it here
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    faulthandler.enable(all_threads=True)  # the agent and its forked workers: SIGABRT at a timeout dumps stacks
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)  # preloaded, as meant
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 (what the interpreter prints and returns)
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read()
    except FileNotFoundError:
        return ""


def forked(*argv: str, cwd: str | Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], cwd=, env=, capture_output=True, text=True, timeout=)`` for a run
    of this file or ``-m`` a trainer module, forked from the session's fork server (see the module docstring)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        child = context.Process(target=_child, args=(list(argv), str(cwd), dict(env), out_path, err_path))
        child.start()
        child.join(timeout)
        if child.exitcode is None:  # hung: every process of the group dumps its threads' stacks, then dies
            os.killpg(child.pid, signal.SIGABRT)
            child.join(STACKS_S)
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.join()
            output, errors = _read(out_path), _read(err_path)  # absent if it hung before it started
            sys.stderr.write(f"timed out after {timeout} s; the run's stderr (the stacks at the end):\n"
                             f"{errors[-20000:]}\n")
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, output=output, stderr=errors)
        with open(out_path) as out, open(err_path) as err:
            return subprocess.CompletedProcess([sys.executable, *argv], child.exitcode, out.read(), err.read())


if __name__ == "__main__":
    main(sys.argv[1:])
