"""The vLLM glue: everything in selective_offload that imports vLLM lives here."""
