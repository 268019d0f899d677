"""What a card of a given size has for the plan: the one rule, here.

``--device-memory 24GiB`` names a card class, not the bytes a worker can allocate. A card
sold as 24 GB reports less than 24 GiB to torch (``total_memory``: the driver keeps some),
and the CUDA context the worker creates takes more before the first weight is loaded. A
plan packed to within megabytes of the nominal size fails at load. So the planner plans
for what such a card keeps free after the CUDA context (:func:`card_memory`):

- the probe's measurement of this machine's card, when there is one for the class named
  (``torch.cuda.mem_get_info``'s free bytes right after the probe created its context): a
  card reporting at most the nominal size and more than the next smaller class's, however
  far below (an ECC data-centre card reports less than the table's consumer figures);
- else, for a size that names a class of :data:`CARDS`, the lowest figure cards of that
  class report to torch, less the class's margin (:func:`margin_bytes`, est: a card of the
  class may report less than any figure published) and :data:`CONTEXT_EST_BYTES` (est), so
  a plan made for a class fits every card of it;
- else the size as given: a figure that names no class is taken as the memory free to the
  worker (a measured figure, or a rehearsal of one).

The plan records which (``PlanInputs.usable_device_bytes`` and ``usable_from``) and its
view says so.

The table's figures are the "total capacity" torch prints in its out-of-memory message on
such cards (``torch.cuda.get_device_properties(...).total_memory``), as users published
them; the lowest figure found for a class is kept. A row whose figure was not found
published is an estimate and says so (``estimate=True``, shown ``est``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sizes import GB, GiB


@dataclass(frozen=True)
class CardClass:
    """Cards sold with ``nominal_gib`` GiB (or GB) of memory, and what they report to torch."""

    nominal_gib: int
    #: ``total_memory`` as torch reports it on such a card (bytes).
    reported_bytes: int
    #: Where the figure comes from: a published ``torch`` message, or how it was estimated.
    source: str
    #: True when no published figure was found and ``reported_bytes`` is an estimate.
    estimate: bool = False


def _gib(x: float) -> int:
    return int(round(x * GiB))


#: What each card class reports to torch (see the module docstring): consumer and
#: workstation (non-ECC) cards' figures. An ECC data-centre card reports less than its
#: class's row (16 GB T4: 14.56 GiB, github.com/Zheng-Chong/CatVTON/issues/133; 24 GB A30:
#: 23.53 GiB, github.com/google/RB-Modulation/issues/5; 48 GB L40: 44.40 GiB,
#: github.com/NVlabs/Eagle/issues/68): the 16 and 48 GB rows' usable figures exceed those
#: cards' totals. Such a card is planned from the probe's measurement on it (always trusted
#: at or below the nominal size), or from ``--device-memory`` given as the card reports it.
#: Sources: the issue threads quoting torch's "GPU 0 has a total capacity of X GiB" (or
#: "X GiB total capacity").
CARDS: tuple[CardClass, ...] = (
    # RTX 3070: "GPU 0 has a total capacty of 7.78 GiB" (github.com/meta-llama/codellama/issues/82)
    CardClass(8, _gib(7.78), "RTX 3070, published torch total capacity 7.78 GiB"),
    # No published figure found here: 12 GB cards scaled as the 8 and 24 GB rows (about 98.5% of nominal).
    CardClass(12, _gib(11.76), "scaled from the 8 and 24 GB classes", estimate=True),
    # RTX A4000: "GPU 0 has a total capacity of 15.61 GiB" (github.com/DengKaiCQ/VGGT-Long/issues/6);
    # an RTX 4080 printed 15.99 GiB (github.com/aigc-apps/sd-webui-EasyPhoto/issues/281): the lower kept.
    CardClass(16, _gib(15.61), "RTX A4000, published torch total capacity 15.61 GiB (RTX 4080: 15.99)"),
    # RTX 4090: "GPU 0 has a total capacity of 23.64 GiB" (github.com/ali-vilab/VGen/issues/104), 23.68 GiB
    # (github.com/zai-org/CogVideo/issues/36); RTX 3090: 23.68 GiB (github.com/wutong16/HyperDreamer/issues/4).
    CardClass(24, _gib(23.64), "RTX 4090, published torch total capacity 23.64 GiB (RTX 3090/4090: up to 23.68)"),
    # RTX 5090: "GPU 0 has a total capacity of 31.36 GiB" (github.com/TrajectoryCrafter/TrajectoryCrafter/issues/20).
    CardClass(32, _gib(31.36), "RTX 5090, published torch total capacity 31.36 GiB"),
    # Quadro RTX 8000: "47.46 GiB total capacity" (github.com/Victarry/stable-dreambooth/issues/8).
    CardClass(48, _gib(47.46), "Quadro RTX 8000, published torch total capacity 47.46 GiB"),
    # No published figure found here: 80 GB cards scaled as the 48 GB row (about 98.9% of nominal).
    CardClass(80, _gib(79.11), "scaled from the 48 GB class", estimate=True),
)

#: Of a class's lowest published figure, the share a plan leaves unplanned for cards of the
#: class that report less (est): 0.5% of the nominal size (0.12 GiB of 24 GiB). The published
#: figures of one class differ between boards and drivers (24 GB: 23.64 to 23.68 GiB, 0.17% of
#: the nominal size, in the three messages above); the margin is three times that spread, so a
#: 24 GB card reporting 23.60 GiB (0.04 GiB below the lowest published) still fits the plan.
MARGIN_EST_FRACTION = 0.005


def margin_bytes(card: CardClass) -> int:
    """The margin (est) a plan for ``card``'s class leaves below its lowest published figure."""
    return int(round(card.nominal_gib * GiB * MARGIN_EST_FRACTION))


def lowest_covered_bytes(card: CardClass) -> int:
    """The lowest ``total_memory`` a card of the class may report and still fit a plan made
    for the class: its lowest published figure less its margin (est)."""
    return card.reported_bytes - margin_bytes(card)


#: Device memory the CUDA context (and the libraries' handles and workspaces outside torch's
#: allocator) takes before the first weight, est: 0.49 GiB, a 24 GB card's process outside
#: torch's allocator in a published out-of-memory message (14.56 GiB in use, 13.86 allocated
#: and 0.21 reserved by PyTorch: github.com/3DTopia/Phidias-Diffusion/issues/8).
CONTEXT_EST_BYTES = _gib(0.49)


def card_class(nbytes: int) -> CardClass | None:
    """The class ``nbytes`` names: exactly a nominal size in GiB or in GB; ``None`` otherwise."""
    for card in CARDS:
        if nbytes in (card.nominal_gib * GiB, card.nominal_gib * GB):
            return card
    return None


def class_of_reported(total_bytes: int) -> CardClass | None:
    """The class a card that reports ``total_bytes`` to torch belongs to: the smallest
    nominal size it does not exceed (``None``: larger than every class of the table). No
    lower bound: an ECC data-centre card reports well below its nominal size (a 16 GB T4
    14.56 GiB, a 48 GB L40 44.40 GiB), and its measurement is what it holds."""
    for card in CARDS:
        if total_bytes <= card.nominal_gib * GiB:
            return card
    return None


def card_memory(device_memory_bytes: int, measured_total: int | None = None,
                measured_free: int | None = None) -> tuple[int, str]:
    """The device memory a plan for ``device_memory_bytes`` fits in, and where it came from
    (the module docstring's rule). ``measured_total`` / ``measured_free``: the probe's
    ``mem_get_info`` of this machine's card, when it has one."""
    named = card_class(device_memory_bytes)
    if measured_free is not None and measured_total is not None and (
            measured_total == device_memory_bytes
            or (named is not None and class_of_reported(measured_total) is named)):
        return min(measured_free, device_memory_bytes), (
            f"measured: {measured_free / GiB:.2f} GiB free after the CUDA context, by the probe")
    if named is None:
        return device_memory_bytes, "as given (no card class of that size: taken as the memory free to the worker)"
    usable = min(lowest_covered_bytes(named) - CONTEXT_EST_BYTES, device_memory_bytes)  # 80GB: never more than given
    est = "est " if named.estimate else ""
    return usable, (f"card class {named.nominal_gib} GB: reports {est}{named.reported_bytes / GiB:.2f} GiB to "
                    f"torch ({named.source}), less a {margin_bytes(named) / GiB:.2f} GiB margin for cards of the "
                    f"class reporting less (est) and a {CONTEXT_EST_BYTES / GiB:.2f} GiB CUDA context (est)")
