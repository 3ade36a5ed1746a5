# The two commands of the README. Both do all set-up themselves (scripts/setup.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0

.PHONY: setup demo test test-slow test-unprivileged test-vllm test-vm test-chaos test-report bench sdists mined-tasks clean

setup:
	@bash scripts/setup.sh

# The main job on the embedded default: tasks -> expert demos -> SFT -> async RL on Ray -> held-out eval.
DEMO_DIR ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)
demo: setup
	$(VENV)/bin/codefleet train --out $(DEMO_DIR)

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -m "not slow and not vllm and not vm" -q

test-slow: setup
	$(PY) -m pytest -m slow -q

# The sandbox, environment and agent-toolchain suites again as an unprivileged host user (scripts/test_unprivileged.sh
# makes the user, a copy of the checkout it owns and a venv it may read): isolation must hold whoever runs codefleet.
test-unprivileged: setup
	@bash scripts/test_unprivileged.sh

# vLLM as the engine backend (inference/vllm_engine.py), in its own environment: .venv-vllm (scripts/setup_vllm.sh).
test-vllm:
	@bash scripts/setup_vllm.sh
	.venv-vllm/bin/python -m pytest -m vllm -q tests/test_inference_vllm.py tests/test_gpu_check.py tests/test_scale_out.py

# The vm backend (sandbox/vm.py): QEMU, the guest kernel and the disks (scripts/setup_vm.sh), then the sandbox
# suite against microVMs. Under TCG (no usable KVM) it takes ~10 min on 2 cores.
test-vm:
	@bash scripts/setup_vm.sh
	$(PY) -m pytest -m vm -q

# A training run on a local three-node Ray cluster while rollout workers, sandbox hosts, an engine, a trainer worker,
# a sandbox's processes and a worker node are killed and a sandbox's disk is filled (codefleet chaos,
# docs/reliability.md); ~4 min on 2 cores.
test-chaos: setup
	$(PY) -m pytest -m chaos -q

# report.html and its transcript pages in a real headless Chromium (Debian's, driven by Playwright; both installed by
# scripts/setup_browser.sh): sort, filter, open a transcript, screenshots checked not blank. Fails, never skips, here.
test-report: setup
	@bash scripts/setup_browser.sh
	CODEFLEET_REQUIRE_BROWSER=1 $(PY) -m pytest -m browser -q

# Tasks mined from real libraries (docs/tasks.md, "Mined tasks"): their pinned source distributions are fetched
# from the index once into .cache/sdists as data, hash-checked (never `pip download`, which runs a package's build
# backend), and the slow mining test reads them too.
SDISTS ?= .cache/sdists
MINED_DIR ?= tasks/mined
sdists: setup
	$(VENV)/bin/codefleet tasks fetch -r scripts/mined-libraries.txt --dest $(SDISTS)

mined-tasks: sdists
	$(VENV)/bin/codefleet tasks mine $(SDISTS)/*.tar.gz --out $(MINED_DIR) --seed 0 --max-tasks 8

bench: setup
	$(VENV)/bin/codefleet bench sandbox --json

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info src/*.egg-info
