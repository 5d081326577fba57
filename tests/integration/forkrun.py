"""``torchrun`` for the tests, with its workers forked instead of started afresh.

``python tests/integration/forkrun.py TORCHRUN_ARGS -m MODULE ARGS`` parses the arguments with torchrun's own
parser and runs torchrun's elastic agent (``elastic_launch``: rendezvous, restarts, the monitor, the failure
report) on ``MODULE.main(ARGS)`` with ``start_method="fork"`` (``MODULE``: ``reference_trainer.train`` or
``reference_trainer.experiments.measure``; a returned non-zero int is the worker's exit code). Torch and the
module are imported once, here, instead of once per worker and launch (about 3.5 s of CPU each). Everything
from ``main`` on is what ``torchrun -m MODULE`` runs; the tests of the command line itself (``bagualu2 train``),
the two-node rendezvous and the chaos run still go through the ``torchrun`` executable.
"""

from __future__ import annotations

import importlib
import sys
import uuid

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import elastic_launch

import reference_trainer.pipeline  # noqa: F401 (with torch.distributed.pipelining: the workers inherit them)

MODULES = ("reference_trainer.train", "reference_trainer.experiments.measure")
_main = None  # the module's main, set before the workers fork


def worker(*argv: str) -> None:
    code = _main(list(argv))
    if isinstance(code, int) and code:
        raise SystemExit(code)


@record
def main(argv: list[str]) -> None:
    global _main
    args = torchrun.parse_args(argv)
    if args.module is not True or args.training_script not in MODULES:
        raise SystemExit(f"forkrun.py runs -m {' or -m '.join(MODULES)} only")
    _main = importlib.import_module(args.training_script).main
    if args.standalone:  # what torchrun's run() does for --standalone
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = torchrun.config_from_args(args)
    config.start_method = "fork"
    elastic_launch(config=config, entrypoint=worker)(*args.training_script_args)


if __name__ == "__main__":
    main(sys.argv[1:])
