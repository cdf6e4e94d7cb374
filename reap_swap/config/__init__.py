"""The settings: one validated model of every --reap-* flag and REAP_* variable, its CLI and help."""
