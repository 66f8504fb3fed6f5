"""The three steps of a sliced prep (``data_prep.merge``); ``launch/slurm/prep.sbatch`` runs them on SLURM.

    python launch/slurm/prep_slices.py tokenizer [--num-slices N] --config configs/data/x.yaml [key=value ...]
    python launch/slurm/prep_slices.py slice --index I --num-slices N --config configs/data/x.yaml [key=value ...]
    python launch/slurm/prep_slices.py merge --num-slices N --config configs/data/x.yaml [key=value ...]

The command line is ``data_prep.cli.slices_main``'s.
"""

from data_prep.cli import slices_main
from data_prep.entry import run

if __name__ == "__main__":
    run(slices_main)
