"""A real SLURM cluster of one or more nodes on this machine, for the ``slurm`` and ``multinode`` tests.

`start_cluster` installs Debian's ``slurmctld slurmd slurm-client munge`` with apt-get if missing (needs root, as
the daemons run as root), writes a slurm.conf in a temporary directory on free loopback ports, starts munged,
slurmctld and one slurmd per node, and waits for every node to be idle. The nodes are ``gca-n0``, ``gca-n1``, ...,
all at 127.0.0.1, each slurmd on its own port (``slurmd -N <node>``: Debian's build runs several per host) and in
its own mount and UTS namespace: its hostname is the node name, its ``/dev/shm`` a private tmpfs, and its
``/etc/hosts`` maps every node name to 127.0.0.1, so a job's ``MASTER_ADDR=<first node>`` resolves on every node.
The machine's CPUs are split evenly between the nodes. Nothing listens outside loopback.

Teardown, whatever the outcome: cancel every job, stop the daemons, kill any process still carrying this cluster's
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
from contextlib import contextmanager
from pathlib import Path

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ensure_installed() -> None:
    if all(Path(b).exists() for b in BINARIES):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _run(["apt-get", "update", "-q"], timeout=300, env=env)
    _run(["apt-get", "install", "-y", "-q", *PACKAGES], timeout=900, env=env)


def wait_for(what: str, ready: Callable[[], bool], timeout: float, every: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


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


class Cluster:
    """Client side of the test cluster: every command gets this cluster's ``SLURM_CONF``."""

    def __init__(self, root: Path, nodes: list[str]) -> None:
        self.root = root
        self.nodes = nodes
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

        wait_for(f"job {job_id} to finish", done, timeout, every=1.0)
        return fields

    def log_tail(self, lines: int = 30) -> str:
        """The end of slurmctld's and every slurmd's log, for failure messages."""
        logs = [self.root / "log" / "slurmctld.log", *sorted((self.root / "log").glob("slurmd-*.log"))]
        return "\n".join(
            f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-lines:]) for log in logs if log.is_file()
        )

    def slurmd_pid(self, node: str) -> int:
        return int((self.root / f"slurmd-{node}.pid").read_text().strip())

    def node_processes(self, node: str) -> list[int]:
        """Every process in ``node``'s mount namespace except its slurmd: the node's slurmstepds and their tasks."""
        slurmd = self.slurmd_pid(node)
        namespace = os.readlink(f"/proc/{slurmd}/ns/mnt")
        found = []
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit() or int(pid_dir.name) == slurmd:
                continue
            try:
                if os.readlink(pid_dir / "ns" / "mnt") == namespace:
                    found.append(int(pid_dir.name))
            except OSError:
                continue
        return found

    def job_processes(self) -> list[int]:
        """Processes of jobs (slurmstepd and everything it started) still alive on any node."""
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

    def node_states(self) -> dict[str, str]:
        lines = self.cmd("sinfo", "-h", "-N", "-o", "%N %t").splitlines()
        return dict(line.split() for line in lines)

    def idle(self) -> bool:
        try:
            return self.node_states() == dict.fromkeys(self.nodes, "idle")
        except RuntimeError:  # slurmctld not answering yet
            return False

    def queue(self) -> list[int]:
        return [int(j.split("_")[0]) for j in self.cmd("squeue", "-h", "-o", "%i").split()]

    def start_slurmd(self, node: str) -> None:
        """Start ``node``'s slurmd in its own mount and UTS namespace (private /dev/shm, hostname, /etc/hosts).

        The private /dev/shm also keeps the jobs off the machine's: streaming claims the first free NNNNNN_ prefix
        there, which races with other users' loaders on a shared test machine (and their cleanup fixtures wipe it).
        """
        setup = (
            f"hostname {node} && mount --bind {self.root / 'hosts'} /etc/hosts"
            f" && mount -t tmpfs -o size=4g,mode=1777 tmpfs /dev/shm && exec /usr/sbin/slurmd -N {node}"
        )
        _run(["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", setup], timeout=30, env=self.env)


def _slurm_conf(root: Path, nodes: list[str]) -> str:
    cpus = os.cpu_count() or 1
    if cpus < len(nodes):
        raise RuntimeError(f"{len(nodes)} nodes need at least one CPU each; this machine has {cpus}")
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    node_lines = "\n".join(
        f"NodeName={node} NodeAddr=127.0.0.1 Port={free_port()} CPUs={cpus // len(nodes)}"
        f" RealMemory={memory_mb // len(nodes)} State=UNKNOWN"
        for node in nodes
    )
    return f"""ClusterName=gcatest
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort={free_port()}
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
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
{node_lines}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _start_munged(root: Path) -> None:
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


def _stop(cluster: Cluster) -> None:
    try:
        jobs = cluster.queue()
        if jobs:
            cluster.cmd("scancel", *map(str, jobs))
            wait_for("cancelled jobs to leave the queue", lambda: not cluster.queue(), timeout=60)
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired):
        pass  # the daemons may be the problem; the kills below do not depend on them
    pid_files = [*cluster.root.glob("slurmd-*.pid"), cluster.root / "slurmctld.pid", cluster.root / "munge/munged.pid"]
    pids = [int(f.read_text().strip()) for f in pid_files if f.is_file()]
    pids += [p for p in _processes_of(cluster.conf) if p not in pids]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            wait_for(
                "SLURM daemons and job processes to exit",
                lambda: not any(Path(f"/proc/{p}").exists() for p in pids),
                timeout=15,
            )
            return
        except TimeoutError:
            continue


@contextmanager
def start_cluster(nodes: int, keep_logs: Path) -> Iterator[Cluster]:
    """A running cluster of ``nodes`` nodes; on exit everything is stopped and the daemons' logs copied to
    ``keep_logs`` (for post-mortems) before the cluster's directory is removed."""
    if os.geteuid() != 0:
        raise PermissionError(
            "the SLURM tests start munged, slurmctld and slurmd as root: "
            "run make test-slurm or make test-multinode as root"
        )
    _ensure_installed()
    # Under /tmp (not pytest's tmp_path): munged needs every parent directory of its socket to be world-readable.
    root = Path(tempfile.mkdtemp(prefix="gca-slurm-"))
    root.chmod(0o755)
    cluster = Cluster(root, [f"gca-n{i}" for i in range(nodes)])
    try:
        for sub in ("state", "log", "munge", "munge-key", *(f"spool/{node}" for node in cluster.nodes)):
            (root / sub).mkdir(parents=True)
        (root / "hosts").write_text(f"127.0.0.1 localhost {' '.join(cluster.nodes)}\n")
        _start_munged(root)
        cluster.conf.write_text(_slurm_conf(root, cluster.nodes))
        _run(["/usr/sbin/slurmctld", "-c"], timeout=30, env=cluster.env)
        for node in cluster.nodes:
            cluster.start_slurmd(node)
        wait_for(f"{nodes} node(s) to become idle", cluster.idle, timeout=60)
        yield cluster
    finally:
        _stop(cluster)
        shutil.copytree(root / "log", keep_logs, dirs_exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)
