# graphrewrite: `make demo` (install, optimize a shipped fixture, print the report), `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DEMO   ?= fixtures/cnn_step_tf2.pb
MODE   ?= memory
ZOO    ?= out/zoo

.PHONY: install demo test test-fast fixtures goldens zoo train-zoo bench bench-scaling clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

demo: install
	@mkdir -p out
	$(BIN)/graphrewrite inspect $(DEMO)
	$(BIN)/graphrewrite optimize $(DEMO) -o out/demo_opt$(suffix $(DEMO)) --mode $(MODE) --report out/demo_report.json
	$(BIN)/graphrewrite verify $(DEMO) out/demo_opt$(suffix $(DEMO)) --runs 3

test: install
	$(BIN)/pytest -q

test-fast: install
	$(BIN)/pytest -q -m "not tf"

fixtures: install
	$(BIN)/python fixtures/build_fixtures.py --check

goldens: install
	$(BIN)/pytest -q tests/test_goldens.py --update-goldens
	@git --no-pager diff --stat -- fixtures/goldens

zoo: install
	$(BIN)/python fixtures/zoo.py --out $(ZOO)
	$(BIN)/python fixtures/train_zoo.py --out $(ZOO)

# Only the Keras training graphs (TF1 MetaGraphDefs and TF2 steps); zoo builds them too.
train-zoo: install
	$(BIN)/python fixtures/train_zoo.py --out $(ZOO)

$(ZOO)/manifest.json:
	$(MAKE) zoo

# BENCHMARKS.md, remade whole: the swap table, the lossy levers, the recipe matrix (every cell of
# fixtures/recipes.py, built into out/recipes), budgets against measured peaks, rewrite time by
# graph size (with the speed targets), the planners against the exact one, then every fixture
# and zoo graph original vs rewritten (each step leaves its table in out/bench; the last writes
# the report).
bench: install $(ZOO)/manifest.json
	@mkdir -p out/bench
	$(BIN)/python fixtures/bench.py --zoo $(ZOO) --mode swap --runs 3 \
		--only resnet50,deep_mlp,transformer_encoder,mobilenetv2,densenet121,mlp,resnet_cnn,transformer_dropout \
		--swap-table out/bench/swap.md
	$(BIN)/python fixtures/bench.py --zoo $(ZOO) --runs 3 \
		--only transformer_adam_meta,transformer_adam_tf2,transformer_dropout \
		--lossy-table out/bench/lossy.md
	$(BIN)/python fixtures/bench.py --runs 3 --repeat 3 --recipe-table out/bench/recipes.md
	$(BIN)/python fixtures/budgets.py --zoo $(ZOO) --markdown out/bench/budgets.md --cases \
		transformer_adam_meta:60%,40%L,30%L transformer_adam_tf2:40%L,30%L,25%L \
		deep_mlp_meta:50%,25%L \
		resnet_adam_meta:85%,50%L
	$(BIN)/python fixtures/scaling.py --depths 128,1111,4096,11000 --planners none,estimate \
		--no-as-run --as-run-depths 1111 --out out/scaling --markdown out/bench/scaling.md
	cd tests && (echo 'Produced by `python tests/test_exact.py`.'; echo; ../$(BIN)/python test_exact.py) > ../out/bench/planners.md
	$(BIN)/python fixtures/bench.py --zoo $(ZOO) --markdown BENCHMARKS.md

# How optimize scales with graph size (nodes vs seconds vs RSS), on generated residual MLPs:
# the rewrite alone (--no-as-run: no Grappler runs for the report), as BENCHMARKS.md records it.
bench-scaling: install
	$(BIN)/python fixtures/scaling.py --depths 128,1024,2048,4096,11000 --planners estimate \
		--no-as-run --out out/scaling
	$(BIN)/python fixtures/scaling.py --depths 128,1024 --planners search --out out/scaling

clean:
	rm -rf out .pytest_cache
