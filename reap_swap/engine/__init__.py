"""The engine side (in vLLM's workers): the worker extension, counting, residency and the device cache."""
