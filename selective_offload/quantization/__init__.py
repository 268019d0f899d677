"""What a quantized checkpoint stores for each parameter, from its ``quantization_config``.

Planning from a ``config.json`` alone lists the parameters of the unquantized model (built
on the meta device). A quantized checkpoint does not hold those tensors: it holds packed
weights plus scales, zero points and index tensors, whose names and byte sizes depend on
the method. This package turns the config's ``quantization_config`` into a
:class:`QuantScheme` (:func:`scheme_from_config`) and each parameter into the tensors a
checkpoint of that method stores for it (:func:`quantized_tensors`). Neither torch nor
vLLM is imported: it is arithmetic on shapes.

How the modules relate, one method a room::

    dispatch      scheme_from_config -> PARSERS[method](ConfigReader) -> QuantScheme
                  quantized_tensors  -> exclusion rules -> LAYOUT_FUNCS[layout](Builder, ...)
    fp8 | mxfp4 | modelopt | awq | gptq | bitsandbytes | compressed_tensors | packed
                  each: its config parser and its layout(s), nothing of the others
    base          QuantScheme, Builder (tensor names and bytes), the scale shapes
    exclusion     exclusion lists, LM head / embedding segments, group targets
    reader        typed, one-line-error reads from the config

Which parameters are quantized
    Only ``"linear"`` weights (2-D ``[out, in]``) and ``"experts"`` weights (3-D fused MoE
    ``[num_experts, out, in]``, or ``[num_experts, in, out]`` with ``transposed=True`` as
    gpt-oss stores them). ``"other"`` parameters (embeddings, norms, biases, convolutions),
    the LM head and embeddings, and anything the config excludes (:mod:`.exclusion`) come
    back as one unchanged tensor. MXFP4 (gpt-oss) quantizes expert weights only.

Byte sizes are exact for the layouts each method's module describes; approximated for all
methods: fused experts are listed as one stacked tensor per kind (leading dimension
``num_experts``) where most checkpoints (all but gpt-oss MXFP4) store one tensor per expert
and projection. Per-expert scalars become one ``[num_experts]`` tensor; a fused
``gate_up_proj`` counts one set of scalars per expert where the checkpoint has two, and
block/group scales along a fused output dimension round up once instead of twice.
KV-cache scales (``k_scale``, ``v_scale``, a few bytes per layer) are not listed for any
method. Each method module names its own approximations.
"""

from .base import KINDS, QuantScheme
from .dispatch import quantized_tensors, scheme_from_config
from .exclusion import is_excluded

__all__ = ["KINDS", "QuantScheme", "is_excluded", "quantized_tensors", "scheme_from_config"]
