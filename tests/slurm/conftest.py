"""A real one-node SLURM cluster for the ``slurm`` tests, started in a temporary directory.

The ``cluster`` fixture installs Debian's ``slurmctld slurmd slurm-client munge`` with apt-get if missing (needs
root, as the daemons run as root), writes a slurm.conf for this host on free loopback ports, starts munged,
slurmctld and slurmd (in a mount namespace with its own /dev/shm), and waits for the node to be idle. Teardown,
whatever the outcome: cancel every job, stop the daemons, kill any process still carrying this cluster's
``SLURM_CONF`` (job steps orphaned by a failed test), and remove the directory. Every wait has a hard deadline.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/bin/sbatch", "/usr/sbin/munged")
FINISHED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ensure_installed() -> None:
    if all(Path(b).exists() for b in BINARIES):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _run(["apt-get", "update", "-q"], timeout=300, env=env)
    _run(["apt-get", "install", "-y", "-q", *PACKAGES], timeout=900, env=env)


def _wait(what: str, ready: Callable[[], bool], timeout: float, every: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


class Cluster:
    """Client side of the test cluster: every command gets this cluster's ``SLURM_CONF``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), "OMP_NUM_THREADS": "1"}

    def cmd(self, *args: str, timeout: float = 30) -> str:
        return _run(list(args), timeout=timeout, env=self.env)

    def sbatch(self, script: Path, args: list[str], env: dict[str, str], options: list[str] = ()) -> int:
        """Submit from the repository root (the scripts' ``SLURM_SUBMIT_DIR``) with extra environment ``env``."""
        proc = subprocess.run(
            ["sbatch", "--parsable", *options, str(script), *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
            env={**self.env, **env},
        )
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch failed: {proc.stderr.strip()}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int | str) -> dict[str, str]:
        """``scontrol show job`` fields (JobState, Restarts, ExitCode, ...); an array task is ``"<job>_<task>"``."""
        return dict(re.findall(r"(\w+)=(\S*)", self.cmd("scontrol", "show", "job", "-o", str(job_id))))

    def wait_finished(self, job_id: int | str, timeout: float) -> dict[str, str]:
        fields: dict[str, str] = {}

        def done() -> bool:
            fields.update(self.job(job_id))
            return fields["JobState"] in FINISHED

        _wait(f"job {job_id} to finish", done, timeout, every=1.0)
        return fields

    def log_tail(self, lines: int = 30) -> str:
        """The end of slurmctld's and slurmd's logs, for failure messages."""
        return "\n".join(
            "\n".join((self.root / "log" / name).read_text().splitlines()[-lines:])
            for name in ("slurmctld.log", "slurmd.log")
            if (self.root / "log" / name).is_file()
        )

    def job_processes(self) -> list[int]:
        """Processes of jobs (slurmstepd and everything it started) still alive on the node."""
        found = []
        for pid in _processes_of(self.conf):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            if cmdline.startswith(b"slurmstepd") or b"\0SLURM_JOB_ID=" in b"\0" + environ:
                found.append(pid)
        return found

    def idle(self) -> bool:
        try:
            return self.cmd("sinfo", "-h", "-o", "%t").strip() == "idle"
        except RuntimeError:  # slurmctld not answering yet
            return False

    def queue(self) -> list[int]:
        return [int(j.split("_")[0]) for j in self.cmd("squeue", "-h", "-o", "%i").split()]


def _slurm_conf(root: Path, node_line: str) -> str:
    host = socket.gethostname()
    return f"""ClusterName=gcatest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket.2
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
{node_line} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _processes_of(conf: Path) -> list[int]:
    """Processes whose environment names this cluster's slurm.conf: the daemons' children and every job."""
    needle = f"SLURM_CONF={conf}".encode()
    found = []
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
            continue
        try:
            if needle in (pid_dir / "environ").read_bytes().split(b"\0"):
                found.append(int(pid_dir.name))
        except OSError:
            continue
    return found


def _stop_daemons(cluster: Cluster) -> None:
    try:
        jobs = cluster.queue()
        if jobs:
            cluster.cmd("scancel", *map(str, jobs))
            _wait("cancelled jobs to leave the queue", lambda: not cluster.queue(), timeout=60)
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired):
        pass  # the daemons may be the problem; the kills below do not depend on them
    pids = []
    for pid_file in (cluster.root / "slurmd.pid", cluster.root / "slurmctld.pid", cluster.root / "munge/munged.pid"):
        if pid_file.is_file():
            pids.append(int(pid_file.read_text().strip()))
    pids += [p for p in _processes_of(cluster.conf) if p not in pids]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            _wait(
                "SLURM daemons and job processes to exit",
                lambda: not any(Path(f"/proc/{p}").exists() for p in pids),
                timeout=15,
            )
            return
        except TimeoutError:
            continue


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.fail("the slurm tests start munged, slurmctld and slurmd as root: run make test-slurm as root")
    _ensure_installed()
    # Under /tmp (not pytest's tmp_path): munged needs every parent directory of its socket to be world-readable.
    root = Path(tempfile.mkdtemp(prefix="gca-slurm-"))
    root.chmod(0o755)
    cluster = Cluster(root)
    try:
        for sub in ("state", "spool", "log", "munge", "munge-key"):
            (root / sub).mkdir()
        munge = pwd.getpwnam("munge")
        key = root / "munge-key" / "munge.key"
        key.write_bytes(os.urandom(1024))
        for path, mode in ((root / "munge", 0o755), (root / "munge-key", 0o700), (key, 0o400)):
            os.chown(path, munge.pw_uid, munge.pw_gid)
            path.chmod(mode)
        _run(
            [
                "runuser",
                "-u",
                "munge",
                "--",
                "/usr/sbin/munged",
                f"--key-file={key}",
                f"--socket={root}/munge/munge.socket.2",
                f"--pid-file={root}/munge/munged.pid",
                f"--log-file={root}/munge/munged.log",
                f"--seed-file={root}/munge/munged.seed",
            ],
            timeout=30,
        )
        node_line = _run(["/usr/sbin/slurmd", "-C"], timeout=30).splitlines()[0]
        cluster.conf.write_text(_slurm_conf(root, node_line))
        _run(["/usr/sbin/slurmctld", "-c"], timeout=30, env=cluster.env)
        # slurmd, and so every job, gets a private /dev/shm: streaming claims the first free NNNNNN_ prefix there,
        # which races with other users' loaders on a shared test machine (and their cleanup fixtures wipe it).
        _run(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                "mount -t tmpfs -o size=4g,mode=1777 tmpfs /dev/shm && exec /usr/sbin/slurmd",
            ],
            timeout=30,
            env=cluster.env,
        )
        _wait("the node to become idle", cluster.idle, timeout=60)
        yield cluster
    finally:
        _stop_daemons(cluster)
        # The daemons' logs outlive the cluster in pytest's own temporary directory, for post-mortems.
        shutil.copytree(root / "log", tmp_path_factory.mktemp("slurm-daemon-logs"), dirs_exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    return _free_port
