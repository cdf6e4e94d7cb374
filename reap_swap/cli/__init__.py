"""Subcommands of the ``reap-swap`` console script, one module each (see reap_swap/cli/main.py)."""
