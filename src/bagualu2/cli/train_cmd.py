"""``bagualu2 train``: launch the reference trainer (``python -m reference_trainer.train``) under torchrun.

Every argument the command does not know is passed to the trainer unchanged (put them after ``--`` to be safe:
``bagualu2 train --nproc-per-node 2 -- --steps 5 --json``). One node runs ``torchrun --standalone``; several
nodes rendezvous on ``--master-addr:--master-port`` (c10d), each launched with its own ``--node-rank``. The exit
code is the trainer's; a failing trainer's one-line error is the only report (torchrun runs through
``bagualu2.cli.launch``, which drops torchrun's traceback). Without torch the command says so in one line (exit 2).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from typing import Annotated, Optional

import typer

from .common import CliError, handle_errors, integer_option, one_thread_env, require_extra
from .signals import how_it_ended

TRAINER = "reference_trainer.train"
MAX_PROCESSES = 1024  # per node
LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
HOST_NAME = re.compile(rf"(?=.{{1,253}}$){LABEL}(?:\.{LABEL})*\.?")


def command(trainer_args: list[str], *, nproc_per_node: int, nnodes: int, node_rank: int, master_addr: str,
            master_port: int, max_restarts: int = 0) -> list[str]:
    """The torchrun arguments (without the program) that run the trainer with ``trainer_args``."""
    require_extra("trainer")
    launcher = [f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}"]
    if max_restarts:
        launcher.append(f"--max-restarts={max_restarts}")
    if nnodes == 1:
        launcher.append("--standalone")
    else:
        launcher += [f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={master_addr}:{master_port}"]
    return [*launcher, "-m", TRAINER, *trainer_args]


def rendezvous_host(value: str) -> str:
    """``--master-addr`` as torchrun's rendezvous endpoint takes it: a host name (RFC 1123 labels; ``_`` allowed),
    an IPv4 address, or an IPv6 address (bracketed, as ``host:port`` needs); else one line naming the option."""
    bare = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    with contextlib.suppress(ValueError):
        address = ipaddress.ip_address(bare)
        return f"[{address}]" if address.version == 6 else str(address)
    if value == bare and HOST_NAME.fullmatch(value) and not value.rstrip(".").rsplit(".", 1)[-1].isdigit():
        return value  # a numeric last label is a malformed address, not a name
    raise CliError(f"must be a host name, an IPv4 address or an IPv6 address, got {value!r}", "--master-addr")


def _world_size(trainer_args: list[str], nnodes: int, *, check: bool = False) -> int:
    """Processes per node the trainer's flags need (:func:`_trainer_world` over ``nnodes``)."""
    world = _trainer_world(trainer_args, check=check)
    if world > MAX_PROCESSES * nnodes:
        raise CliError(f"the trainer's world size {world} (--pp x --dp) needs more than {MAX_PROCESSES} processes "
                       f"per node on {nnodes} node(s)", "--nnodes")
    if world % nnodes:
        raise CliError(f"the trainer's world size {world} (--pp x --dp) is not divisible by --nnodes={nnodes}; "
                       "give --nproc-per-node", "--nnodes")
    return world // nnodes


def _trainer_world(trainer_args: list[str], *, check: bool = False) -> int:
    """The ranks the trainer's flags need (asks the trainer; its one-line error is ours). ``check``: the trainer
    also checks its data and output paths as its launch would, leaving nothing on disk (a dry run)."""
    require_extra("trainer")
    asked = [*trainer_args, "--world-size", *(["--check"] if check else [])]
    proc = subprocess.run([sys.executable, "-m", TRAINER, *asked], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["the trainer rejected its flags"])[-1]
        if "unrecognized arguments" in last:  # neither this command's option nor the trainer's
            last += (" (bagualu2 train --help lists this command's options, python -m reference_trainer.train "
                     "--help the trainer's)")
        typer.echo(last if last.startswith("error:") else f"error: {last}", err=True)
        raise typer.Exit(code=2)
    return int(proc.stdout.strip().splitlines()[-1])


@handle_errors
def train(
    ctx: typer.Context,
    nproc_per_node: Annotated[Optional[int], typer.Option(
        "--nproc-per-node", parser=integer_option(minimum=1, maximum=MAX_PROCESSES), help="Processes (ranks) on "
        "this node, 1 to 1024; default: the world size the trainer's flags need (--pp x --dp of the recipe and "
        "flags) over --nnodes.")] = None,
    nnodes: Annotated[int, typer.Option("--nnodes", parser=integer_option(minimum=1, maximum=4096),
                                        help="Nodes of the job, 1 to 4096.")] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", parser=integer_option(minimum=0),
                                           help="This node's rank (several nodes).")] = 0,
    master_addr: Annotated[Optional[str], typer.Option("--master-addr", help="Rendezvous host that every node "
                                                       "reaches (several nodes: required).")] = None,
    master_port: Annotated[int, typer.Option("--master-port", parser=integer_option(minimum=1, maximum=65535),
                                             help="Rendezvous port, 1 to 65535 (several nodes).")] = 29500,
    max_restarts: Annotated[int, typer.Option("--max-restarts", parser=integer_option(minimum=0, maximum=1000),
                                              help="torchrun's restarts of the job, 0 to 1000, after a failure (an "
                                              "out-of-memory error of a fixed policy, a stalled or killed rank): "
                                              "each resumes from the last complete checkpoint with the trainer's "
                                              "--checkpoint-dir, else from step 0; on several nodes a fixed "
                                              "policy's fallback needs --checkpoint-dir or --metrics-file on a "
                                              "shared file system. A user error (exit code 2), a non-finite stop "
                                              "(65) or a diverged collective order (78) is not restarted.")] = 0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check the trainer's flags, data and output paths "
                                        "and print the torchrun command instead of running it.")]
    = False,
    as_json: Annotated[bool, typer.Option("--json", help="With --dry-run: {\"command\": [...]}; else passed to "
                                                          "the trainer (its one JSON line per run).")] = False,
) -> None:
    """Launch the reference trainer under torchrun; the arguments after -- (and any this command does not know)
    go to the trainer: python -m reference_trainer.train --help lists them."""
    if node_rank >= nnodes:
        raise CliError(f"must be below --nnodes={nnodes}, got {node_rank}", "--node-rank")
    if master_addr is None and nnodes > 1:
        raise CliError(f"--nnodes={nnodes} needs the rendezvous host every node reaches (node 0's address)",
                       "--master-addr")
    master_addr = rendezvous_host("127.0.0.1" if master_addr is None else master_addr)
    trainer_args = list(ctx.args)
    if "--check" in trainer_args:  # the probe's own flag: ranks launched with it would only refuse it
        raise CliError("is the trainer's dry-run probe; give bagualu2 train --dry-run instead", "--check")
    if dry_run and "--world-size" in trainer_args:
        raise CliError("prints the world size and exits, so there is no launch to check: give it without --dry-run",
                       "--world-size")
    # the trainer's own answer, once (not once per rank): its help, or the ranks its flags need
    asked = (["--help"] if "--help" in trainer_args or "-h" in trainer_args else
             trainer_args if "--world-size" in trainer_args and not dry_run else None)
    if asked is not None:
        require_extra("trainer")
        raise typer.Exit(code=subprocess.run([sys.executable, "-m", TRAINER, *asked]).returncode)
    if nproc_per_node is None:
        nproc_per_node = _world_size(trainer_args, nnodes, check=dry_run)
    elif nproc_per_node * nnodes != (world := _trainer_world(trainer_args, check=dry_run)):
        raise CliError(f"the trainer's flags need {world} ranks (--pp x --dp), not {nproc_per_node} per node x "
                       f"{nnodes} node(s)", "--nproc-per-node")
    if as_json and not dry_run and "--json" not in trainer_args:
        trainer_args.append("--json")
    argv = command(trainer_args, nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank,
                   master_addr=master_addr, master_port=master_port, max_restarts=max_restarts)
    if dry_run:  # the equivalent torchrun command line
        shown = ["torchrun", *argv]
        typer.echo(json.dumps({"command": shown}) if as_json else shlex.join(shown))
        return
    # torchrun's main through bagualu2.cli.launch: a failed worker's one-line error is the only report
    raise typer.Exit(code=_run_agent([sys.executable, "-m", "bagualu2.cli.launch", *argv]))


def _run_agent(argv: list[str]) -> int:
    """Run torchrun's agent until it ends; SIGTERM / SIGINT / SIGHUP sent to this command go on to the agent, which
    stops its workers, and the agent gets SIGTERM when this command dies (killed with SIGKILL: ``launch``'s
    parent-death signal), so no worker is left training on its own. Its exit code, 128 + the signal's number when
    a signal ended it; a signal this command did not pass on (``kill -9`` of the agent) gets one line here."""
    # launch.LAUNCHER_PID, spelt out: importing launch here would load it before ``python -m`` runs it (runpy warns)
    agent = subprocess.Popen(argv, env={**one_thread_env(), "BAGUALU2_LAUNCHER_PID": str(os.getpid())})

    forwarded = []

    def forward(signum: int, _frame: object) -> None:
        forwarded.append(signum)
        with contextlib.suppress(ProcessLookupError):
            agent.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        code = agent.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code < 0 and not forwarded:  # the agent itself was killed: its workers stop with it and report nothing
        how = how_it_ended(-code, "from outside this command", "(its output above says where)")
        typer.echo(f"error: torchrun's agent (pid {agent.pid}) {how}; its workers stopped with it", err=True)
    return 128 - code if code < 0 else code
