"""``python -m flashcp``: the same as the ``flashcp`` console script."""

import sys

from flashcp.cli import main

sys.exit(main())
