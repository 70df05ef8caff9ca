# normdense: `make demo` and `make test` install everything they need first (scripts/install.sh).
VENV ?= .venv
MIN_VENV ?= .venv-min
NEWEST_VENV ?= .venv-newest
PYTHON ?= python3
PY := $(VENV)/bin/python
export VENV PYTHON MIN_VENV NEWEST_VENV
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` / `make test-fast` (TEST_WORKERS=0: one process, no xdist; auto: one per
# core). loadgroup: tests marked xdist_group (tests/conftest.py groups a module's tests that share a
# module-scoped fixture) run in one worker; the rest are handed out one by one. docs/testing.md.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadgroup

.PHONY: install demo test test-fast test-min test-newest self-check clean-venv help

help:
	@echo "make demo        install if needed, then pretrain a backbone (toy ImageNet), convert it, fine-tune + evaluate Mask R-CNN (BCN+WS) on toy COCO"
	@echo "make test        install if needed, then run the whole test suite (TEST_WORKERS=2 xdist workers)"
	@echo "make demo-seg    install if needed, then train + evaluate DeepLabV3 (BCN+WS) on toy VOC"
	@echo "make install     create $(VENV) with the pinned OpenMMLab stack and normdense (idempotent)"
	@echo "make test-fast   the test suite without tests marked slow"
	@echo "make test-min    the layer tests on the lowest supported torch/mmengine/mmcv, in $(MIN_VENV) (no mmcv ops build)"
	@echo "make test-newest the layer and kernel tests on the newest torch/torchvision/Triton pip serves, in $(NEWEST_VENV)"
	@echo "make self-check  import the stack and print versions"

install:
	@bash scripts/install.sh

self-check: install
	@$(PY) -m normdense.self_check

demo: install
	@bash scripts/demo_det.sh

test: install
	$(PY) -m pytest tests $(XDIST) $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest tests -m "not slow" $(XDIST) $(PYTEST_ARGS)

# The lowest ends of the ranges in normdense/version.py (requirements/min.txt). Tests marked `codebases`
# build mmdet/mmseg models (mmcv ops); test_recompute_saves_only_the_input of IterNorm counts the plain
# path's saved tensors, which torch 2.1's autograd stores one more of (memory, not results).
test-min:
	@bash scripts/install_min.sh
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(MIN_VENV)/bin/python -m pytest tests/layers -m "not codebases" \
	  --deselect tests/layers/test_iternorm.py::test_recompute_saves_only_the_input $(PYTEST_ARGS)

# The newest torch, torchvision (and the Triton torch requires) that pip serves, numpy too, with mmcv 2.1.0's
# ops built for that torch (with -std=c++20 where its headers need it) and the pinned OpenMMLab stack
# (scripts/install_newest.sh). Where mmcv's ops could not be built, the install says why in
# $(NEWEST_VENV)/.normdense-no-mmcv-ops and the tests marked `codebases` are left out.
test-newest:
	@bash scripts/install_newest.sh
	@if [ -f $(NEWEST_VENV)/.normdense-no-mmcv-ops ]; then cat $(NEWEST_VENV)/.normdense-no-mmcv-ops; \
	  echo "   -> the tests marked codebases are left out"; sel="not codebases"; else sel=""; fi; \
	  set -x; $(NEWEST_VENV)/bin/python -m pytest tests/layers tests/kernels $(XDIST) $${sel:+-m "$$sel"} $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)

.PHONY: demo-seg
demo-seg: install
	@$(PY) scripts/demo_seg.py
