"""The hub reader's old import path: it lives in :mod:`selective_offload.checkpoint.hub`.

Kept so that ``from selective_offload.hub import parse_hub_id`` (and the other public
names) keeps working; new code imports from the package.
"""

from .checkpoint.hub import SINGLE_FILE, cached_snapshot, hub_checkpoint, parse_hub_id, remote_checkpoint

__all__ = ["SINGLE_FILE", "cached_snapshot", "hub_checkpoint", "parse_hub_id", "remote_checkpoint"]
