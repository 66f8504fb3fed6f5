"""The environment's variables, checked before any work (`check`): a malformed value or a contradiction between the
launcher's variables is one line naming them, not a traceback or a silent wait.

Every variable the tools read is listed here: `NUMBERS` with how each must read (an integer in range, a finite
positive number of seconds), `TEXTS` with what each is read for; tests/pipeline/test_env_values.py finds every read
in the code and fails on one listed in neither. The numbers are read only through `number` and `integer`, so no
value reaches ``int()`` or a ``timedelta`` unchecked.

A rank learns its place from the variables its launcher sets. torchrun sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` and, per node, ``GROUP_RANK``/
``GROUP_WORLD_SIZE`` (with ``TORCHELASTIC_RUN_ID``); the deepspeed launcher sets the same but ``LOCAL_SIZE`` for
``LOCAL_WORLD_SIZE``, and ``CROSS_RANK``/``CROSS_SIZE`` per node; srun sets ``SLURM_PROCID`` and
``SLURM_STEP_NUM_TASKS`` in each task it starts. The SLURM script (launch/slurm/pretrain.sbatch) starts one torchrun
per node with ``--nnodes`` = its node count = srun's task count, so torchrun's node count must equal srun's.

A variable left over in a shell is the usual cause: ``WORLD_SIZE=2`` in a plain ``python`` run used to wait in the
rendezvous for a rank that never comes, with no word, until it was killed. Only malformed values and contradictions
are refused; a run with none of these variables is one process, as before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from data_prep.redaction import REVEAL_ENV

BOTH_LAUNCHERS = "torchrun and the deepspeed launcher"
STARTUP_ENV = "PIPE_STARTUP_TIMEOUT_S"
STEP_ENV = "PIPE_STEP_TIMEOUT_S"
TIMEOUT_ENV = "PIPE_COLLECTIVE_TIMEOUT_S"
"""The hang budgets (``pipeline.train.dist``); the last is the default of the other two."""
MAX_BUDGET_S = 1e9
"""About 30 years: any larger number of seconds overflows a ``timedelta``."""


@dataclass(frozen=True)
class Number:
    """How a numeric variable must read: a whole number from `lowest` to `highest`, or (`seconds`) a finite number
    of seconds above 0, at most `MAX_BUDGET_S`."""

    lowest: int = 0
    highest: int | None = None
    seconds: bool = False
    setter: str | None = None
    """Who sets it, named in the error (None: the user)."""

    def parse(self, raw: str) -> float | None:
        """The value of ``raw``, or None when it is not one this variable takes."""
        try:
            value = float(raw) if self.seconds else int(raw)
        except ValueError:
            return None
        if self.seconds:
            return value if math.isfinite(value) and 0 < value <= MAX_BUDGET_S else None
        return value if self.lowest <= value <= (self.highest or value) else None

    def refusal(self, name: str, raw: str) -> str:
        if self.seconds:
            return f"{name}={raw!r} must be a positive number of seconds (at most {MAX_BUDGET_S:g})"
        wanted = f"a port, {self.lowest}-{self.highest}" if name == "MASTER_PORT" else f"an integer >= {self.lowest}"
        by = f"; {self.setter} sets it, unset it elsewhere" if self.setter else ""
        return f"{name}={raw!r} must be {wanted}{by}"


NUMBERS = {
    "WORLD_SIZE": Number(1, setter=BOTH_LAUNCHERS),
    "RANK": Number(0, setter=BOTH_LAUNCHERS),
    "LOCAL_RANK": Number(0, setter=BOTH_LAUNCHERS),
    "MASTER_PORT": Number(1, 65535, setter=BOTH_LAUNCHERS),
    "LOCAL_WORLD_SIZE": Number(1, setter="torchrun"),
    "GROUP_RANK": Number(0, setter="torchrun"),
    "GROUP_WORLD_SIZE": Number(1, setter="torchrun"),
    "TORCHELASTIC_RESTART_COUNT": Number(0, setter="torchrun"),
    "LOCAL_SIZE": Number(1, setter="the deepspeed launcher"),
    "CROSS_RANK": Number(0, setter="the deepspeed launcher"),
    "CROSS_SIZE": Number(1, setter="the deepspeed launcher"),
    "SLURM_PROCID": Number(0, setter="srun"),
    "SLURM_STEP_NUM_TASKS": Number(1, setter="srun"),
    "SLURM_RESTART_COUNT": Number(0, setter="SLURM when it requeues a job"),
    STARTUP_ENV: Number(seconds=True),
    STEP_ENV: Number(seconds=True),
    TIMEOUT_ENV: Number(seconds=True),
}
"""Every numeric variable the tools read, and how it must read; `check` refuses any other value before any work."""
SETTERS = {name: number.setter for name, number in NUMBERS.items() if number.setter is not None}
"""The launcher's integer variables, and who sets each (named in the errors)."""
TEXTS = {
    "MASTER_ADDR": "the rendezvous host, checked against MASTER_PORT here and resolved by torch",
    "TORCHELASTIC_USE_AGENT_STORE": "torchrun's 'True' when its agent hosts the job's store; any other value: none",
    "CUDA_VISIBLE_DEVICES": "read by CUDA; quoted in preflight's messages",
    "OMP_NUM_THREADS": "read by OpenMP, which also takes lists ('4,2'); here only whether it is set",
    "PIPE_FAULT": "the tests' fault injection, parsed with errors naming it (pipeline.train.faults)",
    "SLURM_CLUSTER_NAME": "recorded in the run lock as text",
    "SLURM_JOB_ID": "recorded in the run lock as text",
    "SLURMD_NODENAME": "compared with GCA_RDZV_HOST_NODE (launch/slurm/node_torchrun.py)",
    "GCA_RDZV_HOST_NODE": "the node that hosts the rendezvous store (launch/slurm/pretrain.sbatch)",
    REVEAL_ENV: "'1' shows environment values in messages; checked with the config (data_prep.redaction)",
    "TRITON_INTERPRET": "'1' runs Triton kernels on the CPU interpreter (tests); read by Triton too",
    "PYTHONPATH": "extended for the GPU check's re-executed interpreter",
    "TORCH_EXTENSIONS_DIR": "where torch builds DeepSpeed's ops; a value set is kept, else the venv's (deepspeed_cpu)",
    "PATH": "the venv's bin put first when it holds ninja, for DeepSpeed's op build (pipeline.train.deepspeed_cpu)",
    "GCA_GPU_CHECK_SITE": "set by the GPU check for the interpreter it re-executes (pipeline/gpucheck/cli.py)",
    "TRITON_*_PATH": "a Triton tool's path (TRITON_PTXAS_PATH, ...), passed to Triton by the GPU check's compile",
    "WANDB_MODE": "checked with the config's logging.wandb_mode (pipeline.train.wandb_online)",
    "WANDB_API_KEY": "whether wandb has a credential (pipeline.train.wandb_online)",
    "WANDB_IDENTITY_TOKEN_FILE": "whether wandb has a credential (pipeline.train.wandb_online)",
    "WANDB_BASE_URL": "the wandb server named in messages (pipeline.train.wandb_online)",
    "NETRC": "where wandb looks for a credential (pipeline.train.wandb_online)",
    "PREP_SBATCH_ARGS": "shell words for sbatch, split with errors naming it (launch/slurm/shell_words.py)",
    "PREFLIGHT_ARGS": "shell words for preflight, split with errors naming it (launch/slurm/shell_words.py)",
}
"""The variables the tools read as text, and what for: nothing numeric to check (see `NUMBERS` for the rest)."""
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
    """A variable of the environment is malformed, or the launcher's variables contradict each other; the message is
    one line naming them and their values."""


def number(env: Mapping[str, str], name: str) -> float | None:
    """``env[name]`` read as `NUMBERS` says, None when unset.

    Raises:
        LaunchEnvError: the value is not one the variable takes (one line naming it and its value).
    """
    raw = env.get(name)
    if raw is None:
        return None
    value = NUMBERS[name].parse(raw)
    if value is None:
        raise LaunchEnvError(NUMBERS[name].refusal(name, raw))
    return value


def integer(env: Mapping[str, str], name: str, default: int) -> int:
    """The integer variable ``name`` of `NUMBERS` (``default`` when unset), refused as `number` refuses it."""
    value = number(env, name)
    return default if value is None else int(value)


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
    """Refuse, in ``env``, a numeric variable that is malformed (`NUMBERS`) and launcher variables that contradict
    each other.

    Raises:
        LaunchEnvError: one line naming the variables, their values and which launcher sets them.
    """
    values = {name: number(env, name) for name in NUMBERS}
    ints = {name: int(value) for name, value in values.items() if value is not None and name in SETTERS}
    _check_partners(env, ints)
    _check_indices(ints)
    _check_srun(ints)
