"""One layer's routed experts as the host holds them, in vLLM's create_weights layouts.

The layouts are the ones vLLM's MoE methods allocate before any post-processing (0.33's
``unquantized_fused_moe_method``, ``quantization/mxfp4.py`` and ``quantization/fp8.py``),
because those are the host tensors selective-offload keeps: the same bytes serve the
device (read through UVA) and this kernel, with no second copy in another layout.

int4 (W4A16) is the exception: GPTQ's and AWQ's create_weights pack along the input
dimension first, which a row walk cannot stream, so the glue holds their bytes row-major,
as compressed-tensors' ``weight_packed`` already is: the same number of bytes, once, in the
layout below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FORMATS = ("bf16", "mxfp4", "fp8-block", "int4", "f32")
#: int4's scales, as the checkpoint stores them (the model's dtype in vLLM's create_weights).
INT4_SCALE_DTYPES = (torch.bfloat16, torch.float16)
BIAS_DTYPES = (torch.bfloat16, torch.float32)
#: The gated activations the kernels compute (:class:`Activation`).
KINDS = ("silu", "swigluoai", "gelu_tanh")


@dataclass(frozen=True)
class Activation:
    """``silu``: act = silu(g) * u with g the first I rows of w13 and u the next I
    (alpha and limit unused). ``gelu_tanh`` (Gemma 3 and 4): act = gelu(g) * u in the same
    layout, GELU with the tanh approximation (torch's ``approximate="tanh"``, vLLM's
    ``gelu_pytorch_tanh``). ``swigluoai`` (gpt-oss): g and u interleaved in w13's rows
    (g even, u odd), g = min(g, limit), u = clamp(u, -limit, limit),
    act = (u + 1) * g * sigmoid(alpha * g); ``limit=None`` clamps nothing. Which layers of
    which models compute which: :mod:`.capability`."""

    kind: str
    alpha: float = 1.702
    limit: float | None = 7.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Activation kind {self.kind!r}: use one of {', '.join(KINDS)}")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class ExpertWeights:
    """w13 [E, 2I, ...] (gate and up) and w2 [E, H, ...] (down), with their scales and
    optional biases (w13_bias [E, 2I], w2_bias [E, H], bf16 or f32). ``block`` is the
    fp8-block scale block (rows, columns), vLLM's ``weight_block_size``; for int4 it is
    not given but read from the scales: (w13's group, w2's group), columns per scale, and
    ``w13_zeros`` / ``w2_zeros`` its groups' zero points (None: 8, symmetric groups)."""

    fmt: str
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    block: tuple[int, int] = (128, 128)
    w13_zeros: torch.Tensor | None = None
    w2_zeros: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"ExpertWeights fmt {self.fmt!r}: use one of {', '.join(FORMATS)}")
        for name in ("w13", "w2"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise ValueError(f"{self.fmt} {name}: expected a 3-D tensor [E, rows, columns], got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if self.fmt != "int4" and (self.w13_zeros is not None or self.w2_zeros is not None):
            raise ValueError(f"{self.fmt}: zero points are int4's only; pass None")
        getattr(self, "_check_" + self.fmt.replace("-", "_"))()
        E, I, H = self.num_experts, self.intermediate, self.hidden
        for name, shape in (("w13_bias", (E, 2 * I)), ("w2_bias", (E, H))):
            t = getattr(self, name)
            if t is not None:
                self._expect(name, t, t.dtype if t.dtype in BIAS_DTYPES else torch.float32, shape,
                             "(bf16 or float32)")

    # -- layouts -------------------------------------------------------------------------------

    def _expect(self, name, t, dtype, shape, note=""):
        if t is None:
            raise ValueError(f"{self.fmt} {name}: missing; expected {dtype} {list(shape)} {note}".rstrip())
        if t.dtype != dtype or tuple(t.shape) != tuple(shape):
            raise ValueError(f"{self.fmt} {name}: got {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)} "
                             f"{note}".rstrip())

    def _check_bf16(self, dtype: torch.dtype = torch.bfloat16):
        E, I2, H = self.w13.shape
        if I2 % 2:
            raise ValueError(f"{self.fmt} w13: {I2} rows is not 2 * intermediate (gate and up)")
        self._expect("w13", self.w13, dtype, (E, I2, H), "[E, 2I, H]")
        self._expect("w2", self.w2, dtype, (E, H, I2 // 2), "[E, H, I]")
        for name in ("w13_scale", "w2_scale"):
            if getattr(self, name) is not None:
                raise ValueError(f"{self.fmt} {name}: {dtype} weights have no scales; pass None")

    def _check_f32(self):
        """Unquantized experts held in float32 (an engine run with ``dtype=float32``)."""
        self._check_bf16(torch.float32)

    def _check_mxfp4(self):
        E, I2, Hh = self.w13.shape
        H, I = 2 * Hh, self.w2.shape[2] * 2
        if H % 32 or I % 32 or I2 != 2 * I:
            raise ValueError(f"mxfp4: w13 {list(self.w13.shape)} and w2 {list(self.w2.shape)} are not "
                             f"[E, 2I, H/2] and [E, H, I/2] with H and I multiples of 32")
        self._expect("w13", self.w13, torch.uint8, (E, 2 * I, H // 2), "[E, 2I, H/2], two e2m1 per byte")
        self._expect("w2", self.w2, torch.uint8, (E, H, I // 2), "[E, H, I/2], two e2m1 per byte")
        self._expect("w13_scale", self.w13_scale, torch.uint8, (E, 2 * I, H // 32), "[E, 2I, H/32] e8m0")
        self._expect("w2_scale", self.w2_scale, torch.uint8, (E, H, I // 32), "[E, H, I/32] e8m0")

    def _check_int4(self):
        """Row-major nibbles, element 2i in byte i's low half, value (nibble - z) * scale of
        its group: w13 uint8 [E, 2I, H/2], w2 uint8 [E, H, I/2], scales bf16 or f16
        [E, 2I, H/g13] and [E, H, I/g2], groups of a multiple of 32 columns; z 8, or each
        group's zero point in w13_zeros / w2_zeros [E, rows/2, groups]."""
        E, I2, Hh = self.w13.shape
        H, I = 2 * Hh, self.w2.shape[2] * 2
        if I2 != 2 * I or tuple(self.w2.shape[:2]) != (E, H):
            raise ValueError(f"int4: w13 {list(self.w13.shape)} and w2 {list(self.w2.shape)} are not [E, 2I, H/2] and "
                             f"[E, H, I/2]")
        self._expect("w13", self.w13, torch.uint8, (E, 2 * I, H // 2), "[E, 2I, H/2], two nibbles per byte")
        self._expect("w2", self.w2, torch.uint8, (E, H, I // 2), "[E, H, I/2], two nibbles per byte")
        groups = []
        for name, rows, cols in (("w13_scale", 2 * I, H), ("w2_scale", H, I)):
            t = getattr(self, name)
            dtype = t.dtype if t is not None and t.dtype in INT4_SCALE_DTYPES else torch.bfloat16
            n = t.shape[-1] if t is not None and t.dim() == 3 and t.shape[-1] > 0 else 0
            if not n or cols % n or (cols // n) % 32:
                raise ValueError(f"int4 {name}: {list(t.shape) if t is not None else 'missing'} does not split "
                                 f"{cols} columns into groups of a multiple of 32; expected [E, {rows}, {cols}/group]")
            self._expect(name, t, dtype, (E, rows, n), "(bf16 or f16)")
            groups.append(cols // n)
        if self.w13_scale.dtype != self.w2_scale.dtype:
            raise ValueError(f"int4: w13_scale is {self.w13_scale.dtype} and w2_scale {self.w2_scale.dtype}; "
                             "expected one dtype")
        self.block = (groups[0], groups[1])
        if (self.w13_zeros is None) != (self.w2_zeros is None):
            raise ValueError("int4: zero points for one of w13 and w2 only; give both or neither (8)")
        for name, rows, cols, g in (("w13_zeros", 2 * I, H, groups[0]), ("w2_zeros", H, I, groups[1])):
            if getattr(self, name) is not None:
                if rows % 2:
                    raise ValueError(f"int4 {name}: {rows} rows do not pair into bytes")
                self._expect(name, getattr(self, name), torch.uint8, (E, rows // 2, cols // g),
                             "[E, rows/2, groups], rows 2m and 2m+1 in a byte's low and high nibble")

    def _check_fp8_block(self):
        E, I2, H = self.w13.shape
        bn, bk = self.block
        if I2 % 2 or bn <= 0 or bk <= 0 or bk % 32:
            raise ValueError(f"fp8-block: w13 {list(self.w13.shape)} with block {self.block} is not [E, 2I, H] with "
                             f"block columns a multiple of 32")
        I = I2 // 2
        self._expect("w13", self.w13, torch.float8_e4m3fn, (E, 2 * I, H), "[E, 2I, H]")
        self._expect("w2", self.w2, torch.float8_e4m3fn, (E, H, I), "[E, H, I]")
        self._expect("w13_scale", self.w13_scale, torch.float32, (E, 2 * _ceil(I, bn), _ceil(H, bk)),
                     f"[E, 2*ceil(I/{bn}), ceil(H/{bk})] (weight_scale_inv)")
        self._expect("w2_scale", self.w2_scale, torch.float32, (E, _ceil(H, bn), _ceil(I, bk)),
                     f"[E, ceil(H/{bn}), ceil(I/{bk})] (weight_scale_inv)")

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])

    @property
    def hidden(self) -> int:
        return int(self.w2.shape[1])

    @property
    def intermediate(self) -> int:
        return int(self.w13.shape[1]) // 2

    def tensors(self) -> dict[str, torch.Tensor]:
        names = ("w13", "w2", "w13_scale", "w2_scale", "w13_bias", "w2_bias", "w13_zeros", "w2_zeros")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert: its weights, scales and biases (what one pick reads)."""
        return self.nbytes // self.num_experts


def random_experts(fmt: str, experts: int, hidden: int, intermediate: int, seed: int = 0) -> ExpertWeights:
    """Random weights of ``fmt`` in its layout, of one layer's shape (for timing the kernel:
    the probe's rate, the benchmark). Values are small and finite; codes are uniform."""
    g = torch.Generator().manual_seed(seed)
    E, H, I = experts, hidden, intermediate

    def normal(*shape, dtype):
        return (torch.randn(*shape, generator=g) * 0.05).to(dtype)

    def codes(*shape):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)

    if fmt in ("bf16", "f32"):
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
        return ExpertWeights(fmt, normal(E, 2 * I, H, dtype=dtype), normal(E, H, I, dtype=dtype))
    if fmt == "mxfp4":
        def scales(*shape):
            return torch.randint(120, 128, shape, generator=g, dtype=torch.uint8)
        return ExpertWeights(fmt, codes(E, 2 * I, H // 2), codes(E, H, I // 2), w13_scale=scales(E, 2 * I, H // 32),
                             w2_scale=scales(E, H, I // 32))
    if fmt == "fp8-block":
        bn, bk = 128, 128
        return ExpertWeights(fmt, normal(E, 2 * I, H, dtype=torch.float8_e4m3fn), normal(E, H, I, dtype=torch.float8_e4m3fn),
                             w13_scale=torch.rand(E, 2 * _ceil(I, bn), _ceil(H, bk), generator=g),
                             w2_scale=torch.rand(E, _ceil(H, bn), _ceil(I, bk), generator=g))
    if fmt == "int4":
        group = 128 if hidden % 128 == 0 and intermediate % 128 == 0 else 32
        return ExpertWeights(fmt, codes(E, 2 * I, H // 2), codes(E, H, I // 2),
                             w13_scale=(torch.rand(E, 2 * I, H // group, generator=g) * 0.02).bfloat16(),
                             w2_scale=(torch.rand(E, H, I // group, generator=g) * 0.02).bfloat16())
    raise ValueError(f"random_experts: format {fmt!r} has no layout; use one of {', '.join(FORMATS)}")
