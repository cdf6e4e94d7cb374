"""Per-expert residency on CUDA and in accounting mode: the re-homed layers, the HBM pool, swaps."""
