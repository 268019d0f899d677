"""selective-offload: put the bytes a decode step does not read in host memory first.

Importing this package changes nothing in vLLM. See :mod:`selective_offload.planner` for
the placement decision and :mod:`selective_offload.wrappers` for the torch mechanism.
"""

__version__ = "0.1.0"
