# The two commands a fresh machine needs (README): `make demo` and `make test`.
VENV  := .venv
STAMP := $(VENV)/.installed
DEMO  := out/smollm2-135m-a100

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

.PHONY: setup demo test test-fast
setup: $(STAMP)

# The main job on the embedded SmolLM2-135M for an A100: search pruning × precision within the
# default quality budget (+5% held-out perplexity), then build, evaluate and package the choice.
demo: $(STAMP)
	rm -rf $(DEMO)
	$(VENV)/bin/optimize --target a100 -o $(DEMO)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

# The signal to run before every commit (~3 minutes): no vLLM, no real model, no healing run.
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "not slow and not real_model and not vllm"
