"""reap-swap: workload-aware MoE expert residency for vLLM.

The pure core (plan, active_set, forensics, planner, evaluate, model_shape) imports neither
torch nor vllm; the shells (server, routes, worker, residency, observe) do.
"""

__version__ = "0.1.0"
