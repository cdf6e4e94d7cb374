"""The device expert cache on CUDA: per-layer state, its policy step, slot copies, seeded swaps."""
