"""selective-offload: put the bytes a decode step does not read in host memory first.

``selective_offload.plan(model, device_memory="24GiB")`` makes a plan (as ``selective-offload
plan`` does); ``selective_offload.enable(plan)`` before ``LLM(...)`` applies it. Importing the
package changes nothing in vLLM. The torch mechanism is :mod:`selective_offload.wrappers`; the
vLLM glue is :mod:`selective_offload.vllm_glue`.
"""

__version__ = "0.1.0"

from .api import disable, enable, landing_report, plan  # noqa: E402

__all__ = ["__version__", "disable", "enable", "landing_report", "plan"]
