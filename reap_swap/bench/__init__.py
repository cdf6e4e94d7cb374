"""`reap-swap bench` and the reports: servers per arm, measurements, markdown and plots, guards."""
