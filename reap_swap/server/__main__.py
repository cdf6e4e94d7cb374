"""`python -m reap_swap.server`: the launcher (server/launcher.py)."""

import sys

from reap_swap.server.launcher import main

sys.exit(main())
