# attnkern: `make demo` and `make test` are the quick start; both set up .venv.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.deps-installed
BUILT   := $(VENV)/.attnkern-built
SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh') setup.py pyproject.toml

.PHONY: setup build demo test test-fast test-torch211 gpu-wheels gpu-check bench bench-quick docs lint info clean \
	experiments

# Everything the build, the tests and the experiments need besides torch and numpy.
DEV_DEPS := ninja pybind11 setuptools wheel pytest pytest-benchmark hypothesis mpmath ruff "entmax==1.3" \
	    matplotlib joblib tqdm scipy "dask[distributed]" captum gensim "transformers==5.24.0" tokenizers

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet "torch==2.14.1" numpy $(DEV_DEPS)
	touch $(STAMP)

$(BUILT): $(STAMP) $(SOURCES)
	MAX_JOBS=$${MAX_JOBS:-2} $(VPY) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $(BUILT)

setup: $(STAMP)
build: $(BUILT)

demo: $(BUILT)
	$(VPY) -m attnkern.demo

test: $(BUILT)
	$(VPY) -m pytest -q -x -p no:cacheprovider tests

test-fast: $(BUILT)
	$(VPY) -m pytest -q -m "not slow" tests

# The CPU build and tests against torch 2.11.0, the version on the lent GPU
# machines: a second venv, and a copy of the tree (HEAD plus uncommitted changes
# to tracked files) in build/torch211 built with the CUDA sources, so that .venv
# and attnkern/_C*.so stay as they are. Not part of CI: the venv takes about
# 5 GB. numpy < 2.3: torch 2.11's triton (3.6) interpreter converts one-element
# arrays with int(), which later numpy refuses.
VENV211 := .venv-torch211
COPY211 := build/torch211
test-torch211:
	test -x $(VENV211)/bin/python || $(PY) -m venv $(VENV211)
	$(VENV211)/bin/python -m pip install --quiet "torch==2.11.0" "numpy<2.3" $(DEV_DEPS)
	rm -rf $(COPY211) && mkdir -p $(COPY211)
	rev=$$(git stash create); git archive $${rev:-HEAD} | tar -x -C $(COPY211)
	cd $(COPY211) && MAX_JOBS=$${MAX_JOBS:-2} $(CURDIR)/$(VENV211)/bin/python setup.py build_ext --inplace
	cd $(COPY211) && $(CURDIR)/$(VENV211)/bin/python -m pytest -q -p no:cacheprovider tests

# The GPU check (benchmarks/gpu_check.py) for a lent GPU machine, which has no
# network and no git: `make gpu-wheels` here, just before the device call, puts
# the peers' wheels and the commit into .gpu-wheels/, which that call carries;
# there, `make gpu-check` (or the script itself) builds, tests and times.
GPU_WHEELS := .gpu-wheels
gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: -d $(GPU_WHEELS) "adasplash==0.2.2" "entmax==1.3"
	dirty=$$(test -z "$$(git status --porcelain --untracked-files=no)" && echo false || echo true); \
	    printf '{"commit": "%s", "dirty": %s}\n' "$$(git rev-parse HEAD)" "$$dirty" > $(GPU_WHEELS)/COMMIT

gpu-check:
	$(PY) benchmarks/gpu_check.py --out $${OUT:-out/gpu-check}

# make bench: the pytest-benchmark suites, the interleaved ratios against
# PyTorch and the key bands' ratios (about 45 minutes on 2 cores), written as
# result files into results/bench/<this CPU>/ (suites.json, ratios.json,
# bands.json, structured.json, with their .md and .png),
# then the generated tables (make docs). bench-quick: the ratios at N = 2048 only.
BENCH_DIR = results/bench/$$($(VPY) benchmarks/machine.py slug)
bench: $(BUILT)
	$(VPY) -m pytest -q benchmarks -o python_files='bench_*.py' --benchmark-only --benchmark-json=.benchmarks/latest.json \
	    --benchmark-columns=median,iqr,rounds --benchmark-sort=name
	$(VPY) benchmarks/report.py .benchmarks/latest.json --out $(BENCH_DIR)/suites
	$(VPY) benchmarks/ratios.py --out $(BENCH_DIR)/ratios
	$(VPY) benchmarks/bands.py --out $(BENCH_DIR)/bands
	$(VPY) benchmarks/structured.py --processes 3 --out $(BENCH_DIR)/structured
	$(VPY) benchmarks/docs.py

bench-quick: $(BUILT)
	$(VPY) benchmarks/ratios.py --quick --out $(BENCH_DIR)/ratios-quick
	$(VPY) benchmarks/docs.py

# docs/benchmarks.md's tables and the README's figure, from the committed results.
docs: $(BUILT)
	$(VPY) benchmarks/docs.py

# Every attention experiment at --quick (minutes each on 2 cores) into out/experiments/.
EXPERIMENTS ?= copy relevance ktiw ibm1 multihead
experiments: $(BUILT)
	$(VPY) -m attnkern.experiments data fetch vader
	for e in $(EXPERIMENTS); do \
	    $(VPY) -m attnkern.experiments $$e --quick --jobs 2 --out out/experiments || exit 1; done

lint: $(STAMP)
	$(VENV)/bin/ruff check attnkern tests benchmarks examples setup.py

info: $(BUILT)
	$(VPY) -m attnkern.info

clean:
	rm -rf build attnkern/_C*.so *.egg-info $(BUILT)
