# graphrewrite: `make demo` (install, optimize a shipped fixture, print the report), `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DEMO   ?= fixtures/resnet_cnn.pb
MODE   ?= none

.PHONY: install demo test test-fast fixtures goldens clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

demo: install
	@mkdir -p out
	$(BIN)/graphrewrite inspect $(DEMO)
	$(BIN)/graphrewrite optimize $(DEMO) -o out/demo_opt.pb --mode $(MODE) --report out/demo_report.json
	@$(BIN)/graphrewrite dump $(DEMO) > out/demo_before.txt
	@$(BIN)/graphrewrite dump out/demo_opt.pb > out/demo_after.txt
	@diff -u out/demo_before.txt out/demo_after.txt > out/demo.diff \
	  && echo "dump before == dump after (mode $(MODE) changed nothing)" \
	  || echo "dump diff: out/demo.diff ($$(grep -c '^[+-][^+-]' out/demo.diff) lines changed)"

test: install
	$(BIN)/pytest -q

test-fast: install
	$(BIN)/pytest -q -m "not tf"

fixtures: install
	$(BIN)/python fixtures/build_fixtures.py --check

goldens: install
	$(BIN)/pytest -q tests/test_goldens.py --update-goldens
	@git --no-pager diff --stat -- fixtures/goldens

clean:
	rm -rf out .pytest_cache
