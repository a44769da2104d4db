"""Multi-process and multi-node launch: ``llmtune <stage> RECIPE --nproc-per-node N [--nnodes M ...]``.

llmtune starts no worker processes of its own: a stage command that asks for more than one process re-runs itself
through ``torchrun`` (``python -m torch.distributed.run``), which starts one worker per GPU running
``python -m llmtune.commands.cli <stage> RECIPE ...`` with ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT`` set. A command that already runs under a launcher (torchrun, ``accelerate launch``, the ``deepspeed``
launcher, or ``srun`` with one task per GPU, see :func:`slurm_rank_env`) trains directly.

* one node: ``torchrun --standalone --nproc-per-node N`` (rendezvous on a free local port);
* several nodes: every node runs the same command with its own ``--node-rank``; torchrun's static rendezvous
  meets at ``--master-addr:--master-port`` on node 0 (``torchrun --nnodes M --node-rank R --master-addr A
  --master-port P --nproc-per-node N``);
* a DeepSpeed recipe in one process is also started through torchrun (DeepSpeed needs the launcher's environment).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import threading
from typing import Any, NoReturn

from llmtune.utils import get_logger

log = get_logger("launch")

# CLI flag -> recipe key of `distributed:` (the flags are recipe overrides with a familiar spelling)
LAUNCH_FLAGS = {
    "--nproc-per-node": "nproc_per_node",
    "--nnodes": "nnodes",
    "--node-rank": "node_rank",
    "--master-addr": "master_addr",
    "--master-port": "master_port",
}
# Keys the workers' recipe keeps: the shape of the job. Node rank and rendezvous address differ per node or per
# attempt; they only concern torchrun and are not passed on (so every node resolves the same recipe).
_JOB_SHAPE = ("nproc_per_node", "nnodes")
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--nproc-per-node --nnodes --node-rank --master-addr --master-port`` (same as ``distributed.*`` keys)."""
    group = parser.add_argument_group(
        "multi-process / multi-node (same as the distributed.* recipe keys; re-launches through torchrun)")
    group.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                       help="processes (GPUs) per node; > 1 re-launches through torchrun")
    group.add_argument("--nnodes", type=int, default=None, metavar="M", help="number of nodes (default 1)")
    group.add_argument("--node-rank", type=int, default=None, metavar="R", help="rank of this node, 0..M-1")
    group.add_argument("--master-addr", default=None, metavar="A", help="address of node 0 (default 127.0.0.1)")
    group.add_argument("--master-port", type=int, default=None, metavar="P", help="free port on node 0 (default 29500)")


def add_local_rank_arg(parser: argparse.ArgumentParser) -> None:
    """Accept (and ignore) ``--local_rank=I``, which the deepspeed launcher puts before the worker's arguments;
    the rank comes from ``LOCAL_RANK`` in the environment."""
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def launch_overrides(args: argparse.Namespace) -> list[str]:
    """The launch flags that were given, as ``distributed.<key>=<value>`` recipe overrides (applied last)."""
    return [f"distributed.{key}={getattr(args, key)}" for key in LAUNCH_FLAGS.values()
            if getattr(args, key, None) is not None]


def under_launcher(env: dict[str, str] | None = None) -> bool:
    """Whether a launcher (torchrun, accelerate, deepspeed, mapped srun) started this process."""
    env = os.environ if env is None else env
    return all(key in env for key in _LAUNCHER_ENV)


def slurm_rank_env(dist: Any, env: dict[str, str] | None = None) -> dict[str, str]:
    """Launcher variables for ``srun`` started with one task per GPU (no torchrun in between).

    Under ``srun --ntasks-per-node=G llmtune sft RECIPE --master-addr HEAD`` every task is one rank:
    ``RANK = SLURM_PROCID``, ``WORLD_SIZE = SLURM_NTASKS``, ``LOCAL_RANK = SLURM_LOCALID``, and the rendezvous is
    ``MASTER_ADDR``/``MASTER_PORT`` from the environment, else ``distributed.master_addr``/``master_port``. Nothing is
    returned when a launcher already set ``RANK``, outside SLURM, for a single task, or when ``nproc_per_node`` > 1
    (then each SLURM task is one node's launcher and torchrun starts the ranks).

    Args:
        dist: the recipe's ``distributed:`` section.
        env: the environment (default ``os.environ``).

    Returns:
        Variables to add to the environment (empty when not applicable).
    """
    env = os.environ if env is None else env
    if "RANK" in env or "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) <= 1:
        return {}
    if (dist.nproc_per_node or 1) > 1:
        return {}
    ntasks = int(env["SLURM_NTASKS"])
    nodes = max(int(env.get("SLURM_NNODES", "1")), 1)
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": str(ntasks),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(ntasks // nodes),
        "MASTER_ADDR": env.get("MASTER_ADDR", dist.master_addr),
        "MASTER_PORT": env.get("MASTER_PORT", str(dist.master_port)),
    }


def needs_launch(recipe: Any) -> bool:
    """Whether this command must re-run itself through torchrun: not under a launcher yet, and more than one
    process is asked for, or DeepSpeed is used (it needs the launcher's environment even in one process)."""
    dist = recipe.distributed
    if under_launcher():
        asked, got = (dist.nproc_per_node or 1) * dist.nnodes, int(os.environ["WORLD_SIZE"])
        if dist.nproc_per_node is not None and asked != got and int(os.environ["RANK"]) == 0:
            log.warning("the recipe asks for %d process(es) (distributed.nproc_per_node x nnodes) but the launcher "
                        "started %d; training with %d (accumulation follows from train.global_batch_size)",
                        asked, got, got)
        return False
    return (dist.nproc_per_node or 1) * dist.nnodes > 1 or dist.deepspeed is not None or dist.zero_stage is not None


def torchrun_command(command: str, recipe_path: str, overrides: list[str], dist: Any) -> list[str]:
    """The torchrun command line that runs ``llmtune <command> RECIPE overrides`` on this node.

    Args:
        command: stage name (``sft``, ``rm``, ``dpo``, ``ppo``).
        recipe_path: the recipe file as given.
        overrides: the user's ``section.key=value`` overrides (launch flags not included).
        dist: the resolved ``distributed:`` section (launch flags applied).

    Returns:
        ``[python, -m, torch.distributed.run, <rendezvous>, --nproc-per-node, N, -m, llmtune.commands.cli, command, recipe,
        *overrides, distributed.nproc_per_node=N, distributed.nnodes=M]``.
    """
    nproc = dist.nproc_per_node or 1
    if dist.nnodes > 1:
        rendezvous = ["--nnodes", str(dist.nnodes), "--node-rank", str(dist.node_rank),
                      "--master-addr", dist.master_addr, "--master-port", str(dist.master_port)]
    else:
        rendezvous = ["--standalone"]
    shape = [f"distributed.{key}={value}" for key, value in (("nproc_per_node", nproc), ("nnodes", dist.nnodes))]
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node", str(nproc),
            "-m", "llmtune.commands.cli", command, recipe_path, *overrides, *shape]


def finish(code: int = 0) -> NoReturn:
    """End a launched process: wait until every rank is done (rank 0 has written the run directory), then leave at
    once with ``code``.

    A rank whose communication threads are still alive when the interpreter tears down (gloo/DeepSpeed shm on CPU,
    NCCL watchdogs on GPU) can abort in their C++ destructors ("terminate called without an active exception",
    SIGABRT), even after ``destroy_process_group``; torchrun then reports the finished job as failed. After the
    barrier nothing is left to do, so we flush stdio and ``os._exit`` instead of running those destructors.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_process(code: int) -> NoReturn:
    """Leave with ``code``; a launched rank leaves through ``os._exit`` (see :func:`finish`), e.g. after an error
    that every rank raised, so that torchrun reports the error and not an abort in a destructor."""
    if under_launcher():
        report = os.environ.get(EXIT_CODE_FILE)
        if report and os.environ.get("RANK") == "0" and code:  # for relaunch(): torchrun itself only says 1
            with open(report, "w") as fh:
                fh.write(str(code))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


EXIT_CODE_FILE = "LLMTUNE_EXIT_CODE_FILE"  # where rank 0 of a relaunched job leaves its exit code


def relaunch(command: str, recipe_path: str, overrides: list[str], recipe: Any) -> int:
    """Run the stage through torchrun on this node and wait; returns rank 0's exit code when it failed with one of
    ``llmtune.errors`` (e.g. 75 after a preemption checkpoint, 5 for a full disk), else torchrun's (non-zero if any
    rank failed; torchrun then stops the other ranks).

    SIGTERM/SIGUSR1 sent to this process are passed on to torchrun as SIGTERM (it forwards them to the workers)."""
    dist = recipe.distributed  # validated: node_rank < nnodes, global batch divisible by the processes
    cmd = torchrun_command(command, recipe_path, overrides, dist)
    nproc = dist.nproc_per_node or 1
    log.info("launching %d process(es) on this node (node %d of %d, world size %d): %s", nproc, dist.node_rank,
             dist.nnodes, nproc * dist.nnodes, shlex.join(cmd))
    import tempfile

    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    fd, report = tempfile.mkstemp(prefix="llmtune-exit-", suffix=".txt")
    os.close(fd)
    env[EXIT_CODE_FILE] = report
    proc = subprocess.Popen(cmd, env=env)
    got: list[int] = []

    def forward(signum, frame):  # SIGTERM/SIGUSR1 to this process: torchrun passes SIGTERM on to its workers,
        got.append(signum)       # which finish their step, save and exit 75 (llmtune.core.preempt)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        code = proc.wait()
    except KeyboardInterrupt:  # torchrun got the same SIGINT: let it stop its workers (never kill it from here)
        proc.wait()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        with open(report) as fh:
            reported = fh.read().strip()
        os.unlink(report)
    if code != 0 and reported.isdigit():
        return int(reported)
    return 75 if got and code != 0 else code  # llmtune.errors.EXIT_PREEMPTED
