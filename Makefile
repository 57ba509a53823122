# attnkern: `make demo` and `make test` are the quick start; both set up .venv.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.deps-installed
BUILT   := $(VENV)/.attnkern-built
SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh') setup.py pyproject.toml

.PHONY: setup build demo test test-fast bench lint info clean experiments

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet "torch==2.14.1" numpy ninja pybind11 setuptools wheel \
	    pytest pytest-benchmark hypothesis mpmath ruff "entmax==1.3" matplotlib \
	    joblib tqdm scipy "dask[distributed]" captum
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

bench: $(BUILT)
	$(VPY) -m pytest -q benchmarks -o python_files='bench_*.py' --benchmark-only --benchmark-json=.benchmarks/latest.json \
	    --benchmark-columns=median,iqr,rounds --benchmark-sort=name
	$(VPY) benchmarks/report.py .benchmarks/latest.json
	$(VPY) benchmarks/ratios.py --out results/bench/ratios

# Every attention experiment at --quick (minutes each on 2 cores) into results/experiments/.
EXPERIMENTS ?= copy relevance ktiw ibm1 multihead
experiments: $(BUILT)
	$(VPY) -m attnkern.experiments data fetch vader
	for e in $(EXPERIMENTS); do \
	    $(VPY) -m attnkern.experiments $$e --quick --jobs 2 --out results/experiments || exit 1; done

lint: $(STAMP)
	$(VENV)/bin/ruff check attnkern tests benchmarks setup.py

info: $(BUILT)
	$(VPY) -m attnkern.info

clean:
	rm -rf build attnkern/_C*.so *.egg-info $(BUILT)
