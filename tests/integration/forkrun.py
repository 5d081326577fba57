"""``torchrun`` for the tests, with its workers forked instead of started afresh.

``python tests/integration/forkrun.py TORCHRUN_ARGS -m reference_trainer.train TRAINER_ARGS`` parses the arguments
with torchrun's own parser and runs torchrun's elastic agent (``elastic_launch``: rendezvous, restarts, the
monitor, the failure report) on ``reference_trainer.train.main`` with ``start_method="fork"``: the trainer and
torch are imported once, here, instead of once per worker and launch (about 3.5 s of CPU each). Everything the
trainer does from ``main`` on is what ``torchrun -m reference_trainer.train`` runs; the tests of the command line
itself (``bagualu2 train``) still go through the ``torchrun`` executable.
"""

from __future__ import annotations

import sys
import uuid

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import elastic_launch

import reference_trainer.pipeline  # noqa: F401 (with torch.distributed.pipelining)
import reference_trainer.train as train  # before the workers fork: they inherit them


def trainer(*argv: str) -> None:
    train.main(list(argv))


@record
def main(argv: list[str]) -> None:
    args = torchrun.parse_args(argv)
    if args.module is not True or args.training_script != "reference_trainer.train":
        raise SystemExit("forkrun.py runs -m reference_trainer.train only")
    if args.standalone:  # what torchrun's run() does for --standalone
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = torchrun.config_from_args(args)
    config.start_method = "fork"
    elastic_launch(config=config, entrypoint=trainer)(*args.training_script_args)


if __name__ == "__main__":
    main(sys.argv[1:])
