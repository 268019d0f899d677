"""What a plan takes from the probe's profile when no flag gives it, and the note that says so.

A plan's link and VRAM bandwidths come from the profile where it measured them, else from
the reference laptop's (:data:`~selective_offload.plan_format.REFERENCE_LINK_GBPS`,
:data:`~selective_offload.plan_format.REFERENCE_VRAM_GBPS`); either way the plan's notes carry one
line naming the source, so an estimate never passes for a measurement. The values a
profile supplies are :func:`~.profile.plan_defaults`; this module adds the reference
fallback and the wording, for the CLI's ``plan`` and the engine-start plan alike.
"""

from __future__ import annotations

from ..plan_format import REFERENCE_LINK_GBPS, REFERENCE_VRAM_GBPS
from .formats import fmt_rate
from .profile import SUPPLIED, Profile, plan_defaults


def plan_bandwidths(profile: Profile | None) -> tuple[float, float, str]:
    """The link and VRAM bandwidths a plan uses when no flag gives them: the profile's where
    it measured them, else the reference laptop's; and one line saying which."""
    measured = plan_defaults(profile)
    link = measured["link_gbps"] or REFERENCE_LINK_GBPS
    vram = measured["vram_gbps"] or REFERENCE_VRAM_GBPS
    if profile is not None and profile.no_link_reason is None:
        return link, vram, describe(profile)
    return link, vram, reference_note()


def reference_note(*, link: bool = True, vram: bool = True) -> str | None:
    """The line saying which rates are the reference laptop's (no probe of a GPU here): the
    link's, the VRAM's, or both (``None`` when neither is)."""
    named = ([f"link {REFERENCE_LINK_GBPS} GB/s"] if link else []) + ([f"VRAM {REFERENCE_VRAM_GBPS} GB/s"] if vram else [])
    if not named:
        return None
    return (f"{' and '.join(named)} {'are' if len(named) > 1 else 'is'} the reference laptop's (no "
            "`selective-offload probe` profile of a GPU here): measure yours with `selective-offload probe`")


def describe(profile: Profile) -> str:
    """One line saying what a profile supplies and where it came from, for a plan's notes."""
    defaults = plan_defaults(profile)
    parts = ["no link"] if defaults["link_gbps"] is None and profile.no_link_reason else []
    parts += [words.format(as_words(defaults[key])) for key, _, _, words, as_words in SUPPLIED
              if words and defaults[key] is not None]
    if profile.device is None and profile.host_memcpy_gbps is not None:
        parts.append(f"host memcpy {fmt_rate(profile.host_memcpy_gbps)} GB/s")
    what = profile.device or f"{profile.machine}, no GPU"
    if profile.integrated:
        what += ", integrated"
    quick = " (quick probe: rates understated)" if profile.quick else ""
    return f"{', '.join(parts)} measured by `selective-offload probe` on {profile.day}, {what}{quick}"


def machine_notes(host_bytes: int) -> list[str]:
    """What this machine changes about a plan that puts ``host_bytes`` on the host: an
    integrated GPU shares one memory with the host, so those bytes free no device memory here."""
    import torch

    from ..sizes import fmt_bytes

    if not host_bytes or not torch.cuda.is_available():
        return []
    props = torch.cuda.get_device_properties(0)
    if getattr(props, "is_integrated", False):
        return [f"this machine's GPU ({props.name}) is integrated, one memory with the host: the "
                f"{fmt_bytes(host_bytes)} this plan puts on the host would free no device memory here"]
    return []
