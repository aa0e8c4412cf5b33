# The two commands of the README: `make serve` and `make test`. Each installs what is missing first.
VENV       ?= .venv
PY         := $(VENV)/bin/python
MODEL_DIR  ?= hf_models/tiny-llama
HTTP_PORT  ?= 8000
GRPC_PORT  ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000
OPENAI_GRPC_PORT ?= 9001
PROMPT     ?= The Python language reference says that a function

.PHONY: setup model serve test clean

setup:
	@MODEL_DIR="$(MODEL_DIR)" bash scripts/setup.sh

model: setup
	@test -f "$(MODEL_DIR)/model.safetensors" || $(PY) -m trellm_backend.tools.default_model "$(MODEL_DIR)"

serve: model
	$(PY) -m trellm_backend.tools.launch --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) \
		--metrics-port $(METRICS_PORT) --openai-port $(OPENAI_PORT) --openai-grpc-port $(OPENAI_GRPC_PORT) \
		--openai-tool-call-parser hermes \
		--demo-prompt "$(PROMPT)"

test: model
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) hf_models .pytest_cache .hypothesis
