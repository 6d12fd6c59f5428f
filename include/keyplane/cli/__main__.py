"""``python -m keyplane.cli``: the same command line as the ``keyplane`` script."""

import sys

from keyplane.cli import main

sys.exit(main())
