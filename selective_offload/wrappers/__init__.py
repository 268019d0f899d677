"""The torch mechanism that keeps cold weights in host memory (torch only, no vLLM).

How the pieces relate::

    residency      to_host / OffloadStats / TransferLedger   (shared: where bytes live, what moved)
      |-- host_embedding   HostEmbedding (nn.Module)  ->  HostGather (staging, counters)
      |                                                     -> host_gather() | UVA device view
      '-- on_demand        offload_on_demand(module) -> OnDemandOffload (hooks, per-block groups)

The wrappers never decide placement (the planner does) and never import vLLM (the glue
in ``selective_offload.vllm_glue`` calls them from patched vLLM modules). Each reports an
:class:`~.residency.OffloadStats` so the glue can compare what landed where against the plan.
"""

from .host_embedding import (
    HostEmbedding,
    HostGather,
    TiedWeightError,
    cuda_view_of_pinned,
    host_gather,
    move_module_weight_to_host,
    refuse_if_tied,
)
from .on_demand import NON_BLOCK, OnDemandOffload, find_block_list, offload_on_demand
from .residency import OffloadError, to_host

__all__ = [
    "HostEmbedding",
    "HostGather",
    "NON_BLOCK",
    "OffloadError",
    "OnDemandOffload",
    "TiedWeightError",
    "cuda_view_of_pinned",
    "find_block_list",
    "host_gather",
    "move_module_weight_to_host",
    "offload_on_demand",
    "refuse_if_tied",
    "to_host",
]
