# Set-up and checks. Each target creates what it needs (a venv under .venv*) by itself.
PYTHON ?= python3
# .venv (tests, types, docs) has no scikit-learn, scipy or matplotlib: where they are installed, torchmetrics imports
# scipy and matplotlib with Lightning, about 2 s more in every process, and the tests start some 300 of them. The demo
# and the benchmarks (and the tests that run them) use .venv-tools, which has them.
VENV ?= .venv
VENV_TOOLS ?= .venv-tools
VENV_LOWEST ?= .venv-lowest
# A CPU wheel of this torch ships with our machines (pip's find-links); elsewhere pip takes it from the index.
TORCH ?= torch==2.13.0
# The lowest supported Lightning and torch (setup.cfg's lower bounds), tested together by `make test-lowest`. No
# CPU wheel of this torch ships with our machines: pip takes it from the index (a CUDA build: the venv takes about 5.5 GB).
LIGHTNING_LOWEST ?= lightning==2.2.0
TORCH_LOWEST ?= torch==2.6.0
PIP_FLAGS ?= --quiet --disable-pip-version-check
PYTEST_FLAGS ?= -q -p no:cacheprovider

.PHONY: demo test test-lowest typecheck lint docs bench clean

# --clear: a venv made before the extras were split must lose scikit-learn and matplotlib, not keep them.
$(VENV)/.installed: setup.cfg setup.py lightning_ddp_ext/_compact.c
	$(PYTHON) -m venv --clear $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) "$(TORCH)"
	$(VENV)/bin/pip install $(PIP_FLAGS) -e ".[test,docs,typecheck,lint]"
	touch $@

$(VENV_TOOLS)/.installed: setup.cfg setup.py lightning_ddp_ext/_compact.c
	$(PYTHON) -m venv --clear $(VENV_TOOLS)
	$(VENV_TOOLS)/bin/pip install $(PIP_FLAGS) "$(TORCH)"
	$(VENV_TOOLS)/bin/pip install $(PIP_FLAGS) -e ".[demo,bench,sharded]"
	touch $@

$(VENV_LOWEST)/.installed: setup.cfg setup.py lightning_ddp_ext/_compact.c
	$(PYTHON) -m venv $(VENV_LOWEST)
	# Lightning < 2.4 imports pkg_resources, which setuptools 81 removed.
	$(VENV_LOWEST)/bin/pip install $(PIP_FLAGS) "$(TORCH_LOWEST)" "$(LIGHTNING_LOWEST)" "setuptools>=77,<81"
	$(VENV_LOWEST)/bin/pip install $(PIP_FLAGS) -e ".[test]"
	touch $@

## make demo: train a P x K embedding network on 2 CPU processes with strategy="ddp_custom_sampler"
demo: $(VENV_TOOLS)/.installed
	$(VENV_TOOLS)/bin/python examples/demo_pk_digits.py

## make test: the whole test suite (per-test timeout in setup.cfg); the demo and the docs' figure run in .venv-tools
test: $(VENV)/.installed $(VENV_TOOLS)/.installed
	LIGHTNING_DDP_EXT_TOOLS_PYTHON="$(abspath $(VENV_TOOLS))/bin/python" $(VENV)/bin/python -m pytest $(PYTEST_FLAGS) tests

## make test-lowest: every test but those of the demo, the docs, the benchmark scripts and the GPU, on the lowest supported Lightning and torch: the framework-free ones (samplers, dataloader patching, sync, the epoch store) and the Lightning-facing ones (strategy, evaluation, fine-tuning, resumes, exit clean-up, failure reports, bad input, the sharded variant, the README's snippets)
FRAMEWORK_FREE_TESTS = tests/test_samplers.py tests/test_dataloader.py tests/test_sync.py tests/test_store.py \
	tests/test_distributed_helpers.py tests/test_exit.py tests/test_loader_shares.py
# Lightning 2.2 (and 2.3) makes a CUDA GradScaler for "16-mixed" on CPU, which disables itself: the sharded strategy
# replaces it; and its BaseFinetuning restores parameter groups on resume, which the sharded optimizer must follow.
LIGHTNING_FACING_TESTS = tests/test_strategy.py tests/test_compat.py tests/test_evaluation.py tests/test_finetuning.py \
	tests/test_reliability.py tests/test_sharded.py tests/test_bad_input.py tests/test_readme.py
test-lowest: $(VENV_LOWEST)/.installed
	$(VENV_LOWEST)/bin/python -c "import lightning, torch; print('lightning', lightning.__version__, 'torch', torch.__version__)"
	$(VENV_LOWEST)/bin/python -m pytest $(PYTEST_FLAGS) $(FRAMEWORK_FREE_TESTS) $(LIGHTNING_FACING_TESTS)

## make typecheck: mypy over the package (strict defs, settings in setup.cfg; mypy pinned in the typecheck extra)
typecheck: $(VENV)/.installed
	$(VENV)/bin/mypy lightning_ddp_ext

## make lint: flake8 over the package, tests, benchmarks, examples and the docs' scripts (settings in setup.cfg; flake8 pinned in the lint extra)
lint: $(VENV)/.installed
	$(VENV)/bin/flake8 lightning_ddp_ext tests benchmarks examples docs setup.py

## make docs: the Sphinx site in docs/_build/html, warnings as errors (works offline: see docs/conf.py)
docs: $(VENV)/.installed
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

bench: $(VENV_TOOLS)/.installed
	$(VENV_TOOLS)/bin/python benchmarks/sampler_overhead.py --quick

clean:
	rm -rf $(VENV) $(VENV_TOOLS) $(VENV_LOWEST) build *.egg-info docs/_build
