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

## make test-lowest: on the lowest supported Lightning and torch, the framework-free tests (samplers, dataloader patching, sync, the epoch store) and the Lightning-facing ones (strategy, evaluation, resumes (also on another number of ranks), exit clean-up, failure reports, the sharded scaler)
FRAMEWORK_FREE_TESTS = tests/test_samplers.py tests/test_dataloader.py tests/test_sync.py tests/test_store.py \
	tests/test_distributed_helpers.py
RELIABILITY_TESTS = $(addprefix tests/test_reliability.py::,test_resume_from_an_epoch_end_checkpoint_matches_the_uninterrupted_run \
	test_mid_epoch_resume_continues_where_the_checkpoint_was_taken test_resume_with_loader_workers_trains_the_resumed_epoch \
	test_resumes_at_the_edges_of_an_epoch_continue_as_the_uninterrupted_run \
	test_a_loader_serving_training_and_validation_is_not_left_with_a_resume_skip \
	test_a_training_loader_set_up_in_the_setup_hook_is_dealt_as_usual_and_resumes_without_a_warning \
	test_training_loaders_that_cannot_be_prepared_again_are_left_as_set_up_and_a_warning_says_so \
	test_a_trainer_whose_resumed_fit_had_no_step_left_prepares_the_next_resumed_fit \
	test_a_fit_resumed_in_validation_skips_in_training_not_in_the_validation_it_finishes \
	test_ranks_leave_no_gloo_thread_to_interpreter_finalisation test_spawn_a_failing_rank_ends_the_whole_job \
	test_a_mid_epoch_checkpoint_of_one_rank_resumes_on_two_right_after_the_batches_it_trained \
	test_a_fit_ended_by_max_steps_and_resumed_twice_with_a_reshuffling_sampler_trains_as_the_uninterrupted_run \
	test_a_sampler_growing_with_the_epoch_without_reloading_loaders_gets_a_warning_naming_the_fix \
	test_a_fit_resumed_after_an_epochs_last_batch_and_interrupted_again_trains_as_the_uninterrupted_run \
	test_a_mid_epoch_checkpoint_of_two_ranks_resumes_on_one_training_each_batch_left_once \
	test_a_fit_resumed_by_epochs_after_one_stopped_inside_an_epoch_warns_that_its_rest_is_not_trained)
# Lightning 2.2 (and 2.3) makes a CUDA GradScaler for "16-mixed" on CPU, which disables itself: the sharded strategy replaces it;
# and its BaseFinetuning restores parameter groups on resume, which the sharded optimizer must follow.
SHARDED_LOWEST_TESTS = $(addprefix tests/test_sharded.py::,test_16_mixed_ranks_agree_on_skipping_a_step \
	test_two_backward_passes_per_step_and_a_base_finetuning_resume_train_as_on_one_process)
test-lowest: $(VENV_LOWEST)/.installed
	$(VENV_LOWEST)/bin/python -c "import lightning, torch; print('lightning', lightning.__version__, 'torch', torch.__version__)"
	$(VENV_LOWEST)/bin/python -m pytest $(PYTEST_FLAGS) -m "not slow" $(FRAMEWORK_FREE_TESTS) tests/test_strategy.py tests/test_compat.py tests/test_evaluation.py tests/test_finetuning.py $(RELIABILITY_TESTS) $(SHARDED_LOWEST_TESTS)

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
