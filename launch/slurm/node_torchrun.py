"""``torchrun`` for one node of a SLURM job (``launch/slurm/pretrain.sbatch``); takes torchrun's arguments.

It differs from ``torchrun`` in two ways, both needed for preemption:

- It exits with the exit code of the rank that ended first, when the others ended with the same code or were
  stopped by torchrun itself (SIGTERM: torchrun stops the remaining ranks as soon as one exits non-zero, and
  may catch them while they tear down). torchrun exits 1 for any failed worker, which would hide
  ``train.requeue_exit_code`` (75: "checkpoint saved, requeue me"; a rank exits with it only after the save's
  last barrier, so the checkpoint is committed whatever happens to its siblings afterwards).
- It ignores SIGUSR1, and the ranks inherit that until the trainer installs its handler. SLURM delivers a
  step signal to every process of the step, and torchrun (which handles only TERM/INT/HUP/QUIT) would die of
  SIGUSR1 and orphan its ranks in the middle of their checkpoint. A rank still starting up ignores the
  signal too, which is why the batch script repeats it until the ranks exit.
"""

import signal
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        run(parse_args(argv))
    except ChildFailedError as err:
        print(err, file=sys.stderr, flush=True)  # torchrun's per-rank failure table
        first_rank, first = err.get_first_failure()
        others = [f.exitcode for rank, f in err.failures.items() if rank != first_rank]
        if first.exitcode > 0 and all(code in (first.exitcode, -signal.SIGTERM) for code in others):
            return first.exitcode
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
