# The two commands of the README: `make demo` and `make test`. Each sets everything up first.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

VENV214  := .venv214
PY214    := $(VENV214)/bin/python
STAMP214 := $(VENV214)/.installed
# torch 2.14.1 is a CUDA build: its wheel and the CUDA libraries it links against come from the local wheel
# folder, --no-deps (the CPU kernels need them loaded, not a GPU). Pins: torch 2.14.1's own requirements.
CUDA214  := nvidia-cublas==13.1.1.3 nvidia-cuda-nvrtc==13.0.88 nvidia-cudnn-cu13==9.24.0.43 nvidia-cufft==12.0.0.61 \
            nvidia-cufile==1.15.1.6 nvidia-curand==10.4.0.35 nvidia-cusparse==12.6.3.3 nvidia-cusparselt-cu13==0.8.1 \
            nvidia-nccl-cu13==2.30.7 nvidia-nvshmem-cu13==3.4.5 nvidia-nvjitlink==13.0.88
# A representative part of the suite, without the Inductor-heavy files (CI runs on 2 cores).
TESTS214 := tests/test_capture.py tests/test_regions.py tests/test_compile.py tests/test_export.py \
            tests/test_dropin.py tests/test_guards.py tests/test_side_effects.py

.PHONY: demo test test-214 bench setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build comes from a local file; an unpinned torch pulls CUDA.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/stampout demo
	# what compiling costs: Inductor on 8 layers, stampout against torch.compile (a minute or two on 2 cores)
	$(VENV)/bin/stampout demo --layers 8 --backend inductor --against-torch-compile

# Tests in parallel, one worker per core (TEST_JOBS=0: in this process); a file stays on one worker (--dist loadfile),
# so what a file shares and the order of its tests are as in a serial run; files are handed out in collection
# order, which tests/conftest.py makes longest first (xdist would order them by test count).
TEST_JOBS ?= auto
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

$(STAMP214): pyproject.toml
	@test -x $(PY214) || $(PYTHON) -m venv $(VENV214)
	$(PY214) -m pip install --quiet --no-deps torch==2.14.1 $(CUDA214)
	$(PY214) -m pip install --quiet filelock 'typing-extensions>=4.10' 'setuptools>=77.0.3' 'sympy>=1.13.3' \
		'networkx>=2.5.1' jinja2 'fsspec>=0.8.5'
	$(PY214) -m pip install --quiet --no-deps -e .
	$(PY214) -m pip install --quiet rich numpy pytest hypothesis
	@touch $(STAMP214)

test-214: $(STAMP214)
	$(PY214) -m pytest -q -m "not inductor" $(TESTS214)

bench: $(STAMP)
	$(VENV)/bin/stampout bench

clean:
	rm -rf $(VENV) $(VENV214) build src/*.egg-info
