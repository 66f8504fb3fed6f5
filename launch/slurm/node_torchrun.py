"""``torchrun`` for one node of a SLURM job (``launch/slurm/pretrain.sbatch``); takes torchrun's arguments.

It says which node it runs on, first, so that the job's log shows every node's part. When the batch script names
the node at ``MASTER_ADDR`` (``GCA_RDZV_HOST_NODE``), that node hosts the rendezvous store and no other does
(``--rdzv_conf is_host``, decided by ``SLURMD_NODENAME``): torch's own guess calls a node the host whenever the
endpoint's name resolves to one of the node's addresses, which is every node when node names share an address (the
test cluster's nodes are all 127.0.0.1), and no node when ``MASTER_ADDR`` is an alias that the host does not
recognise as its own. It differs from ``torchrun`` in three more ways, all needed for preemption:

- It exits with the exit code of the rank that ended first, when the others ended with the same code or were
  stopped by torchrun itself (SIGTERM: torchrun stops the remaining ranks as soon as one exits non-zero, and
  may catch them while they tear down). torchrun exits 1 for any failed worker, which would hide
  ``train.requeue_exit_code`` (75: "checkpoint saved, requeue me"; a rank exits with it only after the save's
  last barrier, so the checkpoint is committed whatever happens to its siblings afterwards).
- It ignores SIGUSR1, and the ranks inherit that until the trainer installs its handler. SLURM delivers a
  step signal to every process of the step, and torchrun (which handles only TERM/INT/HUP/QUIT) would die of
  SIGUSR1 and orphan its ranks in the middle of their checkpoint. A rank still starting up ignores the
  signal too, which is why the batch script repeats it until the ranks exit.
- On a node that hosts the rendezvous store (or may: when no host was named), it waits `HOST_LINGER_S` after
  its ranks failed before exiting, when the job has several nodes. The store lives in this process, torchrun
  skips its exit barrier when ranks fail (a requeue exit included), and the other nodes' torchrun keep polling
  the store until they see their own ranks exit: with the store gone they fail, SIGTERM their ranks, and exit 1
  instead of 75 (seen when one node's ranks took 3 s longer to exit than the host's).
"""

import os
import signal
import socket
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

HOST_LINGER_S = 15


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    args = parse_args(argv)
    may_host = True
    if host_node := os.environ.get("GCA_RDZV_HOST_NODE"):
        may_host = os.environ.get("SLURMD_NODENAME") == host_node
        args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, f"is_host={str(may_host).lower()}"]))
    print(f"node_torchrun: starting {args.nproc_per_node} rank(s) on {socket.gethostname()}", flush=True)
    try:
        run(args)
    except ChildFailedError as err:
        print(err, file=sys.stderr, flush=True)  # torchrun's per-rank failure table
        if may_host and str(args.nnodes).split(":")[-1] != "1":
            time.sleep(HOST_LINGER_S)
        first_rank, first = err.get_first_failure()
        others = [f.exitcode for rank, f in err.failures.items() if rank != first_rank]
        if first.exitcode > 0 and all(code in (first.exitcode, -signal.SIGTERM) for code in others):
            return first.exitcode
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
