"""The shell words of an option list in an environment variable, for the sbatch scripts (``PREP_SBATCH_ARGS``,
``PREFLIGHT_ARGS``): ``python launch/slurm/shell_words.py NAME`` prints each word followed by a NUL byte.

Quotes and backslashes are read as a POSIX shell reads them, so ``--comment="nightly prep"`` stays one word, while
nothing is expanded or run (``$(...)`` stays text): the scripts need no ``eval``. An unbalanced quote is one line
naming the variable, exit 2.
"""

import os
import shlex
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: shell_words.py NAME (an environment variable holding shell words)", file=sys.stderr)
        return 2
    name = argv[0]
    value = os.environ.get(name, "")
    try:
        words = shlex.split(value)
    except ValueError as err:  # "No closing quotation", "No escaped character"
        print(f'error: {name}={value!r}: {err}; quote it as in a shell, e.g. --comment="nightly prep"', file=sys.stderr)
        return 2
    sys.stdout.write("".join(word + "\0" for word in words))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
