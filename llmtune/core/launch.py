"""Multi-process and multi-node launch: ``llmtune <stage> RECIPE --nproc-per-node N [--nnodes M ...]``.

llmtune starts no worker processes of its own: a stage command that asks for more than one process re-runs itself
through ``torchrun`` (``python -m torch.distributed.run``), which starts one worker per GPU running
``python -m llmtune.commands.cli <stage> RECIPE ...`` with ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT`` set. A command that already runs under a launcher (torchrun, ``accelerate launch``, the ``deepspeed``
launcher) trains directly.

* one node: ``torchrun --standalone --nproc-per-node N`` (rendezvous on a free local port);
* several nodes: every node runs the same command with its own ``--node-rank``; torchrun's static rendezvous
  meets at ``--master-addr:--master-port`` on node 0 (``torchrun --nnodes M --node-rank R --master-addr A
  --master-port P --nproc-per-node N``);
* a DeepSpeed recipe in one process is also started through torchrun (DeepSpeed needs the launcher's environment);
* a task of an ``srun`` job step with several tasks (:func:`slurm_launch`): with several tasks on a node
  (``srun --ntasks-per-node 8``) every task is one rank and nothing is re-launched, whatever the recipe's
  ``distributed.nproc_per_node``; with one task per node and ``nproc_per_node`` > 1 each task is its node's
  launcher (torchrun), with the node rank, node count and node 0's address taken from SLURM.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any, NoReturn

from llmtune.errors import LlmtuneError
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


class LaunchError(LlmtuneError):
    """A launch that cannot work as started (e.g. an ``srun`` layout whose tasks cannot find their GPU or node 0)."""


_SLURM_BATCH_STEPS = ("4294967294", "4294967295", "batch", "extern")  # the batch script's and extern "steps"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class SlurmStep:
    """This process as one task of an ``srun`` job step (from SLURM's environment).

    Attributes:
        procid: the task's index in the step, 0 .. ntasks-1 (``SLURM_PROCID``).
        ntasks: tasks in the step (``SLURM_STEP_NUM_TASKS``).
        localid: the task's index on its node (``SLURM_LOCALID``).
        nodeid: the node's index in the step (``SLURM_NODEID``).
        tasks_per_node: tasks on each node of the step (``SLURM_STEP_TASKS_PER_NODE``, e.g. ``8(x2)`` -> [8, 8]).
        nodelist: the step's nodes in SLURM's compressed form (``SLURM_STEP_NODELIST``, e.g. ``gpu[01-02]``).
    """

    procid: int
    ntasks: int
    localid: int
    nodeid: int
    tasks_per_node: tuple[int, ...]
    nodelist: str | None

    @property
    def nnodes(self) -> int:
        """Nodes in the step."""
        return len(self.tasks_per_node)

    @property
    def local_tasks(self) -> int:
        """Tasks on this process's node."""
        return self.tasks_per_node[self.nodeid] if self.nodeid < len(self.tasks_per_node) else self.tasks_per_node[0]


def parse_tasks_per_node(text: str) -> tuple[int, ...]:
    """Expand SLURM's tasks-per-node list: ``"8(x2),4"`` -> ``(8, 8, 4)``.

    Raises:
        ValueError: not of that form.
    """
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"not a SLURM tasks-per-node list: {text!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return tuple(out)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[03-04,07],cpu1"`` -> ``"gpu03"`` (node 0 of the step)."""
    head = re.split(r",(?![^\[]*\])", nodelist.strip())[0]  # the first entry (commas inside [...] do not split)
    return re.sub(r"\[([^\],-]+)[^\]]*\]", r"\1", head)  # each [range] -> its first value, zero padding kept


def slurm_step(env: dict[str, str] | None = None) -> SlurmStep | None:
    """This process as a task of an ``srun`` step with more than one task; None otherwise.

    None outside SLURM, in the batch script itself (``sbatch`` sets ``SLURM_PROCID``/``SLURM_NTASKS`` there too, but
    the script is no step: reading it as rank 0 of N would wait forever for the other ranks) and for a step of one
    task.

    Args:
        env: the environment (default ``os.environ``).
    """
    env = os.environ if env is None else env
    if "SLURM_PROCID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        return None
    if env.get("SLURM_STEP_ID", env.get("SLURM_STEPID")) in _SLURM_BATCH_STEPS:
        return None
    ntasks = int(env["SLURM_STEP_NUM_TASKS"])
    if ntasks <= 1:
        return None
    per_node_text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    nnodes = max(int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1"))), 1)
    per_node = parse_tasks_per_node(per_node_text) if per_node_text else (ntasks // nnodes,) * nnodes
    return SlurmStep(procid=int(env["SLURM_PROCID"]), ntasks=ntasks, localid=int(env.get("SLURM_LOCALID", "0")),
                     nodeid=int(env.get("SLURM_NODEID", "0")), tasks_per_node=per_node,
                     nodelist=env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST"))


def _rendezvous(step: SlurmStep, dist: Any, env: dict[str, str]) -> tuple[str, str]:
    """Node 0's address and port: ``MASTER_ADDR``/``MASTER_PORT``, else the recipe's, else (several nodes and a
    loopback address in the recipe) the first host of the step's node list."""
    addr = env.get("MASTER_ADDR") or dist.master_addr
    if step.nnodes > 1 and addr in _LOOPBACK:
        if not step.nodelist:
            raise LaunchError(
                f"srun started {step.ntasks} tasks on {step.nnodes} nodes but node 0's address is unknown "
                f"(distributed.master_addr is {addr}, SLURM_STEP_NODELIST is not set): pass --master-addr NODE0, or "
                "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1) before srun")
        addr = first_host(step.nodelist)
    return addr, env.get("MASTER_PORT") or str(dist.master_port)


def slurm_launch(dist: Any, env: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """What an ``srun`` launch means for this process (see the module docstring).

    * Not a task of a multi-task ``srun`` step (:func:`slurm_step`), or a launcher already set ``RANK``:
      ``({}, [])``: the recipe's ``distributed:`` keys decide.
    * Several tasks on a node (``srun --ntasks-per-node G``), or one task per node while the recipe asks for at
      most one process per node: every task is one rank. Returned: the variables torchrun would set
      (``RANK`` = ``SLURM_PROCID``, ``WORLD_SIZE`` = the step's tasks, ``LOCAL_RANK`` = ``SLURM_LOCALID``,
      ``LOCAL_WORLD_SIZE`` = the node's tasks, ``MASTER_ADDR``, ``MASTER_PORT``); nothing is re-launched, and the
      world size is SLURM's (``train.global_batch_size`` is kept, the accumulation follows).
    * One task per node and ``distributed.nproc_per_node`` > 1: every task is its node's launcher. Returned:
      the overrides ``distributed.nnodes`` (the step's nodes), ``distributed.node_rank`` (``SLURM_NODEID``),
      ``distributed.master_addr`` and ``distributed.master_port``, for torchrun to start the node's ranks.

    Node 0's address: ``MASTER_ADDR``, else ``distributed.master_addr`` when it is not a loopback address, else the
    first host of ``SLURM_STEP_NODELIST``; the port: ``MASTER_PORT``, else ``distributed.master_port``.

    Args:
        dist: the recipe's ``distributed:`` section.
        env: the environment (default ``os.environ``).

    Returns:
        ``(variables to add to the environment, recipe overrides)``; at most one of them is non-empty.

    Raises:
        LaunchError: the tasks of a node see fewer GPUs than there are tasks (``--gpus-per-task``/``--gpu-bind``
            give each task its own GPU, but a rank picks GPU ``LOCAL_RANK`` of those it sees); several nodes and
            no way to name node 0.
    """
    env = os.environ if env is None else env
    step = None if "RANK" in env else slurm_step(env)
    if step is None:
        return {}, []
    addr, port = _rendezvous(step, dist, env)
    if max(step.tasks_per_node) == 1 and (dist.nproc_per_node or 1) > 1:
        return {}, [f"distributed.nnodes={step.nnodes}", f"distributed.node_rank={step.nodeid}",
                    f"distributed.master_addr={addr}", f"distributed.master_port={port}"]
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if "CUDA_VISIBLE_DEVICES" in env and 0 < len(visible) < step.local_tasks:
        raise LaunchError(
            f"srun started {step.local_tasks} tasks on this node but each sees {len(visible)} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}); a rank uses GPU LOCAL_RANK (= SLURM_LOCALID) of "
            "the GPUs it sees. Give every task all of the node's GPUs (#SBATCH --gpus-per-node=G, without "
            "--gpus-per-task or --gpu-bind), or start one task per node (srun --ntasks-per-node 1, as "
            "scripts/slurm_zero3.sbatch does): torchrun then starts the node's ranks")
    return {
        "RANK": str(step.procid),
        "WORLD_SIZE": str(step.ntasks),
        "LOCAL_RANK": str(step.localid),
        "LOCAL_WORLD_SIZE": str(step.local_tasks),
        "MASTER_ADDR": addr,
        "MASTER_PORT": port,
    }, []


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
