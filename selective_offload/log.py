"""The project's one logger, named under vLLM's namespace.

vLLM configures the ``vllm`` logger (its format, its handlers, ``VLLM_LOGGING_LEVEL``) in
every process it starts, workers included; a child of it inherits all of that without this
module importing vLLM, so the core stays importable where vLLM is not installed."""

from __future__ import annotations

import logging

#: Every line the project logs goes through this name (checked by tests/tools/test_house.py).
LOGGER_NAME = "vllm.selective_offload"

logger = logging.getLogger(LOGGER_NAME)
