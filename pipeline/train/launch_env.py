"""The launcher's variables, checked before any rendezvous (`check`): a contradiction is one line, not a silent wait.

A rank learns its place from the variables its launcher sets. torchrun sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` and, per node, ``GROUP_RANK``/
``GROUP_WORLD_SIZE`` (with ``TORCHELASTIC_RUN_ID``); the deepspeed launcher sets the same but ``LOCAL_SIZE`` for
``LOCAL_WORLD_SIZE``, and ``CROSS_RANK``/``CROSS_SIZE`` per node; srun sets ``SLURM_PROCID`` and
``SLURM_STEP_NUM_TASKS`` in each task it starts. The SLURM script (launch/slurm/pretrain.sbatch) starts one torchrun
per node with ``--nnodes`` = its node count = srun's task count, so torchrun's node count must equal srun's.

A variable left over in a shell is the usual cause: ``WORLD_SIZE=2`` in a plain ``python`` run used to wait in the
rendezvous for a rank that never comes, with no word, until it was killed. Only contradictions are refused; a run
with none of these variables is one process, as before.
"""

from __future__ import annotations

from collections.abc import Mapping

BOTH_LAUNCHERS = "torchrun and the deepspeed launcher"
SETTERS = {
    "WORLD_SIZE": BOTH_LAUNCHERS,
    "RANK": BOTH_LAUNCHERS,
    "LOCAL_RANK": BOTH_LAUNCHERS,
    "MASTER_PORT": BOTH_LAUNCHERS,
    "LOCAL_WORLD_SIZE": "torchrun",
    "GROUP_RANK": "torchrun",
    "GROUP_WORLD_SIZE": "torchrun",
    "LOCAL_SIZE": "the deepspeed launcher",
    "CROSS_RANK": "the deepspeed launcher",
    "CROSS_SIZE": "the deepspeed launcher",
    "SLURM_PROCID": "srun",
    "SLURM_STEP_NUM_TASKS": "srun",
    "SLURM_RESTART_COUNT": "SLURM when it requeues a job",
}
"""Every integer variable that is checked, and who sets it (named in the error)."""
COUNTS = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "GROUP_WORLD_SIZE", "CROSS_SIZE", "SLURM_STEP_NUM_TASKS")
"""Counts of processes or nodes: at least 1."""
INDICES = (
    ("RANK", "WORLD_SIZE"),
    ("LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("LOCAL_RANK", "LOCAL_SIZE"),
    ("GROUP_RANK", "GROUP_WORLD_SIZE"),
    ("CROSS_RANK", "CROSS_SIZE"),
    ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"),
)
"""(index, count) pairs of one launcher: the index runs from 0 to count - 1."""


class LaunchEnvError(ValueError):
    """The launcher's variables contradict each other; the message is one line naming them and their values."""


def _integers(env: Mapping[str, str]) -> dict[str, int]:
    """The integer variables that are set, parsed; a value that is not a whole number in range is refused."""
    values = {}
    for name, setter in SETTERS.items():
        if name not in env:
            continue
        lowest = 1 if name in COUNTS or name == "MASTER_PORT" else 0
        try:
            value = int(env[name])
        except ValueError:
            value = lowest - 1
        if value < lowest or (name == "MASTER_PORT" and value > 65535):
            wanted = "a port, 1-65535" if name == "MASTER_PORT" else f"an integer >= {lowest}"
            raise LaunchEnvError(f"{name}={env[name]!r} must be {wanted}; {setter} sets it, unset it elsewhere")
        values[name] = value
    return values


def _check_partners(env: Mapping[str, str], ints: Mapping[str, int]) -> None:
    """Several ranks need RANK and the rendezvous address; the address is both parts or neither."""
    world = ints.get("WORLD_SIZE", 1)
    if world > 1 and "RANK" not in env:
        raise LaunchEnvError(
            f"WORLD_SIZE={world} but RANK is not set: {BOTH_LAUNCHERS} set both; a plain `python` run must not "
            "inherit WORLD_SIZE (unset it)"
        )
    for name, partner in (("MASTER_ADDR", "MASTER_PORT"), ("MASTER_PORT", "MASTER_ADDR")):
        if name in env and partner not in env:
            raise LaunchEnvError(
                f"{name}={env[name]} but {partner} is not set: the ranks meet at MASTER_ADDR:MASTER_PORT, which "
                f"{BOTH_LAUNCHERS} set together; set {partner}, or unset {name} for one process"
            )
    if world > 1 and "MASTER_ADDR" not in env:
        raise LaunchEnvError(
            f"WORLD_SIZE={world} and RANK={env['RANK']} but MASTER_ADDR and MASTER_PORT are not set: the ranks would "
            f"have nowhere to meet ({BOTH_LAUNCHERS} set all four); unset WORLD_SIZE and RANK for one process"
        )


def _check_indices(ints: Mapping[str, int]) -> None:
    """Each launcher's index below its count, and a node's ranks no more than the job's."""
    for index, count in INDICES:
        if index not in ints or (count not in ints and index != "RANK"):
            continue
        size = ints.get(count, 1)
        if ints[index] >= size:
            given = f"{count}={size}" if count in ints else f"{count} is not set (one process)"
            raise LaunchEnvError(
                f"{index}={ints[index]} but {given}: {index} runs from 0 to {count} - 1; {SETTERS[index]} sets both, "
                "unset them elsewhere"
            )
    for local in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if local in ints and ints[local] > ints.get("WORLD_SIZE", 1):
            raise LaunchEnvError(
                f"{local}={ints[local]} ranks on this node but WORLD_SIZE={ints.get('WORLD_SIZE', 1)} in all; "
                f"{SETTERS[local]} sets both, unset them elsewhere"
            )


def _check_srun(ints: Mapping[str, int]) -> None:
    """srun's task count against the launcher it started: one torchrun (or deepspeed launcher) per task, each a
    node of the job; without one, one rank per task."""
    tasks = ints.get("SLURM_STEP_NUM_TASKS", 1)
    if tasks == 1:
        return
    if "WORLD_SIZE" not in ints:
        raise LaunchEnvError(
            f"srun started SLURM_STEP_NUM_TASKS={tasks} copies of this command but WORLD_SIZE is not set, so each "
            "would train alone: launch/slurm/pretrain.sbatch runs one torchrun per node (srun --ntasks-per-node=1), "
            "which sets WORLD_SIZE and RANK"
        )
    for nodes in ("GROUP_WORLD_SIZE", "CROSS_SIZE"):
        if nodes in ints and ints[nodes] != tasks:
            raise LaunchEnvError(
                f"{SETTERS[nodes]} counts {nodes}={ints[nodes]} node(s) but srun started SLURM_STEP_NUM_TASKS={tasks} "
                f"tasks: each task is one node of the job, so its --nnodes must be srun's task count (a standalone "
                f"launch under srun makes {tasks} separate runs)"
            )
    if "GROUP_WORLD_SIZE" not in ints and "CROSS_SIZE" not in ints and ints["WORLD_SIZE"] != tasks:
        raise LaunchEnvError(
            f"WORLD_SIZE={ints['WORLD_SIZE']} but srun started SLURM_STEP_NUM_TASKS={tasks} processes of one rank "
            "each (no torchrun or deepspeed launcher in between): WORLD_SIZE must be the task count"
        )


def check(env: Mapping[str, str]) -> None:
    """Refuse launcher variables in ``env`` that contradict each other.

    Raises:
        LaunchEnvError: one line naming the variables, their values and which launcher sets them.
    """
    ints = _integers(env)
    _check_partners(env, ints)
    _check_indices(ints)
    _check_srun(ints)
