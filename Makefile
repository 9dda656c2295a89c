# Everything a fresh machine needs is made here: `make run` and `make test` create .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# Parallel test workers (the suite's multi-process tests already use 2 processes each).
TEST_WORKERS ?= 2

.PHONY: install cpp-tools run test smoke lint format bench mutations faults clean

$(BIN)/.installed: pyproject.toml setup.py accelerate_recipes_launcher.pth
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: the CPU build where no GPU is present (see README, "Install")
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet -e '.[all,dev]'
	touch $@

install: $(BIN)/.installed

# Train SASRec on MovieLens-100K on this machine and print the test metrics.
run: install
	$(BIN)/python recipes/sasrec.py

# g++ and cmake: AOTInductor compiles C++ when a model is exported, and the C++ consumer (export/cpp/) is built by a
# test. Debian's packages,
# installed when missing (root needed; without them that test skips and says why).
cpp-tools:
	@command -v cmake >/dev/null && command -v g++ >/dev/null || \
		{ apt-get update -qq && apt-get install -y -qq cmake g++ >/dev/null; } || \
		echo "cmake/g++ missing and not installable here: the C++ consumer test will skip"

# lint-imports: the architecture's contracts (pyproject.toml, [tool.importlinter]): the core knows no model family
# mkdocs build --strict: the documentation site (docs/), with no broken link or anchor
test: install cpp-tools
	$(BIN)/lint-imports --no-cache
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=15 tests

# The smoke job on another torch (its own venv, .cache/smoke/venv-torch-VERSION): every recipe, a resume, 2 processes,
# every export, --compile. TORCH_VERSION: a release (2.4.1), `oldest` (pyproject's floor) or `newest`.
smoke: cpp-tools
	.ci/smoke $(TORCH_VERSION)

# The documentation site, into build/site: the pages in docs/, the reference generated from the code (docs/gen/cli.py)
.PHONY: docs
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check toolkit recipes tests benchmarks

# Small deliberate bugs, one at a time in a temporary copy, against the tests meant to catch each (not part of test).
mutations: install
	$(BIN)/python tests/mutations.py

# Kills, signals and full disks at random moments, each resumed and compared byte for byte with an uninterrupted run
# (not part of test; about 15 minutes on 2 cores). FAULTS_FLAGS: e.g. --quick, --seed N, --only signal.
faults: install
	$(BIN)/python tests/fault_campaign.py $(FAULTS_FLAGS)

bench: install
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/sasrec_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
