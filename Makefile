# Two commands: `make run` (the whole workbook, headless) and `make test`.
# Each creates .venv on first use and installs what it needs.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The torch to install when the venv has none. torch==2.13.0 is a CPU build on the project's
# machines; on a GPU node install a CUDA torch first (see environment.yml) or set TORCH=torch.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.ssmkit-installed
# `make run` writes runs/$(RUN)/ (executed notebooks, figures, metrics, summary.md)
# expanded once (:=): a recipe that names it twice names one folder
ifndef RUN
RUN    := $(shell date +%Y%m%d-%H%M%S)
endif
PARAMS ?= params/cpu.yaml
# `make run RUN=name OVERWRITE=1` replaces an earlier run of that name (only the files a run writes)
OVERWRITE ?=
# `make test` runs the suite on this many worker processes (pytest-xdist): one per core
JOBS   ?= 2

.PHONY: run papers workshop workshop-bundle test lint lab strip demo bench gpu-check env clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev,workbook,eval,finetune]"
	touch $@

run: $(STAMP)            ## run every notebooks/NN_*.ipynb headless on CPU defaults into runs/<timestamp>/
	HF_HUB_OFFLINE=1 $(PY) -m ssmkit.cli workbook run -f $(PARAMS) --out runs/$(RUN) $(if $(OVERWRITE),--overwrite)

papers: $(STAMP)         ## run every papers/NN_*.ipynb (the companion notes) headless on CPU defaults into runs/papers-<timestamp>/
	HF_HUB_OFFLINE=1 $(PY) -m ssmkit.cli workbook run papers/[0-9][0-9]_*.ipynb --out runs/papers-$(RUN) $(if $(OVERWRITE),--overwrite); \
	status=$$?; $(PY) -m ssmkit.papers --report runs/papers-$(RUN); exit $$status

workshop: $(STAMP)       ## notebooks and paper notes on params/workshop.yaml (each <= 2 GB peak RSS: Binder-sized) into runs/workshop-<timestamp>/
	HF_HUB_OFFLINE=1 $(PY) -m ssmkit.cli workbook run notebooks/[0-9][0-9]_*.ipynb papers/[0-9][0-9]_*.ipynb -f params/workshop.yaml --out runs/workshop-$(RUN) $(if $(OVERWRITE),--overwrite)

workshop-bundle: $(STAMP) ## dist/workshop-bundle/: a wheelhouse (downloaded: needs the network once), the source and install.sh for a room without one
	$(PY) scripts/workshop_bundle.py --out dist/workshop-bundle

test: lint               ## lint, then the whole test suite (CPU, offline), notebooks included; slowest 15 last
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n $(JOBS) --dist worksteal

lint: $(STAMP)           ## ruff (rules in pyproject.toml): the format, pyflakes, line length 100, import order, pyupgrade
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

lab: $(STAMP)            ## JupyterLab on the checkout: notebooks/, papers/ (kernel: this venv's Python)
	$(VENV)/bin/jupyter lab . $(if $(filter 0,$(shell id -u)),--allow-root)

strip: $(STAMP)          ## clear outputs and execution counts of notebooks/ and papers/ before committing
	$(PY) -m ssmkit.cli workbook strip

demo: $(STAMP)           ## train the tiny preset on CPU for a few hundred steps, then sample (~1 min)
	HF_HUB_OFFLINE=1 $(PY) -m ssmkit.demo

bench: $(STAMP)          ## ssmkit vs transformers / mambapy / Llama train steps at 256 and 2048, as ratios (~6 min)
	HF_HUB_OFFLINE=1 $(PY) benchmarks/train_step_cpu.py --seq-len 256,2048 --compile-scan --floor --torch-scan

gpu-check: $(STAMP)      ## on a GPU node: per-op parity, kernels, 130M train steps, generation, notebook 01 (< 8 min, JSON last)
	HF_HUB_OFFLINE=1 $(PY) scripts/gpu_check.py

env: $(STAMP)            ## which torch, device, kernels and backends this machine has
	$(PY) -c "import ssmkit; print(ssmkit.env_report())"

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info runs
