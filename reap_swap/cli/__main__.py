"""`python -m reap_swap.cli`: the console script (cli/main.py)."""

import sys

from reap_swap.cli.main import main

sys.exit(main())
