"""``python -m memguard``: the same command line as the ``memguard`` console script."""

import sys

from memguard.cli import main

if __name__ == "__main__":
    sys.exit(main())
