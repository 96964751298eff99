"""The experts' weights as data: their tensors (strides as given: transposed storage is a view)
and their `WeightFormat`, validated once. FP8: e4m3, float32 scales that multiply to dequantize:

    BLOCK    w13_scale [E, 2 * ceil(I / bn), ceil(H / bc)] (gate grid, then up grid),
             w2_scale [E, ceil(H / bn), ceil(I / bc)], partial edge blocks; x per token per bc group
    CHANNEL  w13_scale [E, 2I], w2_scale [E, H] (a scale per output row); x per token
    TENSOR   stored per row like CHANNEL, gate and up each exact (`per_tensor_rows`); x per token,
             or static: one `input_scale`, the largest of the checkpoint's per-expert ones
MXFP4 (OCP MX, gpt-oss's experts): e2m1 values packed two per byte along the contraction (the low
nibble the even index), w13 uint8 [E, 2I, H / 2], w2 uint8 [E, H, I / 2]; one E8M0 scale byte per
32 contraction values (2^(s - 127); 255 is NaN), w13_scale uint8 [E, 2I, H / 32], w2_scale uint8
[E, H, I / 32]; activations stay in bf16 / fp16 / fp32 (W4A16)."""
from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
MXFP4_GROUP = 32  # contraction values per E8M0 scale
MXFP4_DTYPE = torch.uint8  # two e2m1 codes a byte; scales one E8M0 byte each
# e2m1 codes 0-7 (sign in bit 3): 0, 0.5, 1, 1.5, 2, 3, 4, 6
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class Fp8Scaling(enum.Enum):
    BLOCK = "block"  # DeepSeek-V3, transformers FineGrainedFP8: a scale per weight block
    CHANNEL = "channel"  # compressed-tensors "channel": a scale per output row
    TENSOR = "tensor"  # ModelOpt, compressed-tensors "tensor": a scale per expert and projection


@dataclass(frozen=True)
class WeightFormat:
    fp8: Fp8Scaling | None = None  # None: bf16 / fp16 / fp32 weights, no scales
    block: tuple[int, int] | None = None  # BLOCK's (block_n, block_c): rows x contraction
    static_input: bool = False  # TENSOR: activations quantized with one static input scale
    fp4: bool = False  # OCP MXFP4 weights (module docstring), the one FP4 format; activations as x

    def __post_init__(self):
        if self.fp4 and (self.fp8 is not None or self.static_input):
            raise ValueError(f"WeightFormat.fp4 (MXFP4) excludes the FP8 fields; got {self}")
        if (self.block is not None) != (self.fp8 is Fp8Scaling.BLOCK):
            raise ValueError("WeightFormat.block is the BLOCK format's (block_n, block_c) and "
                             f"only its; got {self}")
        if self.block is not None:
            block_n, block_c = self.block
            if block_n < 1 or block_c < 16 or block_c & (block_c - 1):
                raise ValueError(f"WeightFormat.block=({block_n}, {block_c}): block_n must be >= 1 "
                                 "and block_c a power of two >= 16 (every public checkpoint uses "
                                 "128 x 128)")
        if self.static_input and self.fp8 is not Fp8Scaling.TENSOR:
            raise ValueError("WeightFormat.static_input is for per-tensor FP8 "
                             "(fp8=Fp8Scaling.TENSOR) only")

    @classmethod
    def fp8_block(cls, block_n: int = 128, block_c: int = 128) -> WeightFormat:
        return cls(Fp8Scaling.BLOCK, (block_n, block_c))

    @classmethod
    def fp8_channel(cls) -> WeightFormat:
        return cls(Fp8Scaling.CHANNEL)

    @classmethod
    def fp8_tensor(cls, static_input: bool = False) -> WeightFormat:
        return cls(Fp8Scaling.TENSOR, static_input=static_input)

    @classmethod
    def mxfp4(cls) -> WeightFormat:
        return cls(fp4=True)

    @property
    def quantized(self) -> bool:
        return self.fp8 is not None or self.fp4

    @property
    def packing(self) -> int:
        """Weight values per stored element along the contraction."""
        return 2 if self.fp4 else 1

    def __str__(self) -> str:
        if self.fp4:
            return "mxfp4 e2m1, e8m0 scales per 32, unquantized activations"
        if self.fp8 is None:
            return "unquantized"
        if self.block is not None:
            return (f"fp8 e4m3, {self.block[0]}x{self.block[1]} block scales, "
                    "dynamic per-token-group activations")
        inputs = "static" if self.static_input else "dynamic per-token"
        return f"fp8 e4m3, per-{self.fp8.value} scales, {inputs} activations"

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self.fp4:
            return MXFP4_DTYPE
        return dtype if self.fp8 is None else FP8_DTYPE

    @property
    def input_scale_shape(self) -> tuple[int, ...] | None:
        return (1,) if self.static_input else None

    def scale_shape(self, experts: int, rows: int, cols: int,
                    halves: int = 1) -> tuple[int, ...] | None:
        """The scale of an (E, rows, cols) weight of `halves` stacked row blocks (None: native);
        `cols` counts values, not packed bytes."""
        if self.fp4:
            return (experts, rows, cols // MXFP4_GROUP)
        if self.fp8 is None:
            return None
        if self.block is None:
            return (experts, rows)
        block_n, block_c = self.block
        return (experts, halves * -(-(rows // halves) // block_n), -(-cols // block_c))

    def linear_scale_shapes(self, rows: int, cols: int) -> list[tuple[int, ...]]:
        """The shapes a checkpoint stores one linear's (rows, cols) weight scale in."""
        if self.block is not None:
            return [self.scale_shape(1, rows, cols)[1:]]
        per_row = {Fp8Scaling.CHANNEL: [(rows, 1), (rows,)], Fp8Scaling.TENSOR: [(), (1,)]}
        return per_row.get(self.fp8, [])

    def checkpoint_scale(self, stored: torch.Tensor | Sequence[torch.Tensor], rows: int, cols: int,
                         gated: bool = False) -> torch.Tensor:
        """A checkpoint's scale(s) of an [E, rows, cols] weight, whole or per projection (gate, up
        if `gated`; CHANNEL [E, N(, 1)], TENSOR [E(, 1, 1)]) -> ExpertWeights' float32 layout."""
        parts = list(stored) if isinstance(stored, (list, tuple)) else [stored]
        halves = 2 if gated else 1
        if self.fp8 is None:
            raise ValueError("scales were given for unquantized weights; "
                             "pass format=WeightFormat.fp8_... with them")
        floats = all(isinstance(p, torch.Tensor) and p.dim() and p.is_floating_point()
                     for p in parts)
        if len(parts) not in (1, halves) or not floats:
            raise ValueError(f"{self} scales must be float tensors [E, ...], one over all {rows} "
                             f"rows or one per projection, got {[_describe(p) for p in parts]}")
        E = parts[0].shape[0]
        if self.block is not None:
            I, block_n = rows // 2, self.block[0]
            if len(parts) < halves and I % block_n:
                raise ValueError(f"one scale grid over the concatenated [gate; up] rows, but I={I} "
                                 f"is not a multiple of block_n={block_n}, so block row "
                                 f"{I // block_n} holds gate and up rows together and cannot be "
                                 "split into a gate grid and an up grid; expected "
                                 "I % block_n == 0, or a grid per projection")
            scale = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        elif self.fp8 is Fp8Scaling.CHANNEL:
            scale = torch.cat([p.reshape(E, -1) for p in parts], dim=1)
        else:  # TENSOR: [E, 1] one scale, [E, 2] gate and up each their own; stored per row
            per_tensor = torch.cat([p.reshape(E, -1) for p in parts], dim=1)
            if per_tensor.shape[1] not in (1, halves):
                raise ValueError(f"per-tensor scales of {tuple(per_tensor.shape)} for {halves} "
                                 "projection(s)")
            one = per_tensor.shape[1] == 1
            scale = per_tensor_rows(per_tensor[:, 0] if one else per_tensor, rows)
        expected = self.scale_shape(E, rows, cols, halves)
        if tuple(scale.shape) != expected:
            raise ValueError(f"scales {[tuple(p.shape) for p in parts]} give {tuple(scale.shape)}; "
                             f"{self} weights [E, {rows}, {cols}] need {expected}")
        return scale.float()

    def checkpoint_input_scale(self, stored: torch.Tensor | Sequence[torch.Tensor] | None):
        """The largest of the first GEMM's input scales (all see the layer's x); None: dynamic."""
        if not self.static_input:
            return None
        parts = list(stored) if isinstance(stored, (list, tuple)) else [stored]
        if not parts or not all(isinstance(p, torch.Tensor) and p.numel() for p in parts):
            raise ValueError(f"{self} weights need their input scales, "
                             f"got {[_describe(p) for p in parts]}")
        return torch.stack([p.float().max() for p in parts]).max().reshape(1)

    def grid_lead(self, start: int) -> int:
        """Zero columns of I before a slice at `start` that put it on the block grid; 0 without."""
        if self.fp4:
            return start % MXFP4_GROUP
        return start % math.lcm(*self.block) if self.block is not None else 0


NATIVE = WeightFormat()


@dataclass(frozen=True, eq=False)
class ExpertWeights:
    w13: torch.Tensor  # [E, 2I, H] gated ([gate; up]), [E, I, H] non-gated
    w2: torch.Tensor  # [E, H, I]
    gated: bool = True  # w13 holds gate and up rows (every activation but relu^2)
    # None means NATIVE: torch.compile traces code that builds ExpertWeights (transformers'
    # experts forward does) and cannot wrap an instance held as a dataclass default
    format: WeightFormat | None = None
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None  # FP8 static activations: a float32 scalar
    # added before the activation (gate, then up) and before the routing weight (gpt-oss), any
    # float dtype, every format
    w13_bias: torch.Tensor | None = None  # [E, 2I] gated ([gate; up]), [E, I] non-gated
    w2_bias: torch.Tensor | None = None  # [E, H]

    def __post_init__(self):
        if self.format is None:
            object.__setattr__(self, "format", NATIVE)
        for name, w in (("w13", self.w13), ("w2", self.w2)):
            if not isinstance(w, torch.Tensor) or w.dim() != 3:
                raise ValueError(f"{name} must be a 3-D tensor (E, N, C), got {_describe(w)}")
        if self.w13.device != self.w2.device:
            raise ValueError(f"w13 is on {self.w13.device} but w2 on {self.w2.device}; "
                             "move both to one device")
        E, rows, _ = self.w13.shape
        if E <= 0:
            raise ValueError(f"w13 has E={E} experts; the layer needs at least one")
        if self.gated and rows % 2:
            raise ValueError(f"w13 has {rows} rows; a gated activation needs [gate; up] = 2I rows")
        I = rows // 2 if self.gated else rows
        stored = (E, self.hidden_size, I // self.format.packing)
        if tuple(self.w2.shape) != stored:
            raise ValueError(f"w2 must have shape (E, H, I{' / 2' if self.format.fp4 else ''}) = "
                             f"{stored} to match w13 {tuple(self.w13.shape)}, "
                             f"got {tuple(self.w2.shape)}")
        if self.format.fp4:
            self._check_fp4()
        elif self.format.fp8 is None:
            self._check_native()
        else:
            self._check_fp8()
        self._check_biases()

    def _check_native(self):
        if self.w13.dtype not in FLOAT_DTYPES or self.w2.dtype != self.w13.dtype:
            raise ValueError(f"unquantized expert weights must share one of {FLOAT_DTYPES}, got "
                             f"w13 {self.w13.dtype} and w2 {self.w2.dtype} (FP8 weights need "
                             "format=WeightFormat.fp8_...)")
        if any(t is not None for t in (self.w13_scale, self.w2_scale, self.input_scale)):
            raise ValueError("scales were given for unquantized weights; "
                             "pass format=WeightFormat.fp8_... with them")

    def _check_fp4(self):
        E, H, I, halves = self.num_experts, self.hidden_size, self.intermediate_size, self.halves
        for name, size in (("H", H), ("I", I)):
            if size % MXFP4_GROUP:
                raise ValueError(f"MXFP4 experts scale every {MXFP4_GROUP} contraction values: "
                                 f"{name}={size} must be a multiple of {MXFP4_GROUP}")
        what = (f"MXFP4 experts (E={E}, H={H}, I={I}; two e2m1 values a byte, one E8M0 scale "
                f"per {MXFP4_GROUP})")
        for name, shape in (("w13", (E, halves * I, H // 2)), ("w2", (E, H, I // 2)),
                            ("w13_scale", self.format.scale_shape(E, halves * I, H)),
                            ("w2_scale", self.format.scale_shape(E, H, I))):
            self._check_stored(name, MXFP4_DTYPE, shape, what)
        if self.input_scale is not None:
            raise ValueError("input_scale was given, but MXFP4 experts take unquantized "
                             "activations")

    def _check_fp8(self):
        for name, w in (("w13", self.w13), ("w2", self.w2)):
            if w.dtype != FP8_DTYPE:
                raise ValueError(f"{name} is {w.dtype}; {self.format} weights are {FP8_DTYPE} "
                                 "(mixed formats between w13 and w2 are not supported)")
        E, H, I, halves = self.num_experts, self.hidden_size, self.intermediate_size, self.halves
        what = f"{self.format} experts (E={E}, H={H}, I={I})"
        for name, shape in (("w13_scale", self.format.scale_shape(E, halves * I, H, halves)),
                            ("w2_scale", self.format.scale_shape(E, H, I))):
            self._check_stored(name, torch.float32, shape, what)
        if self.format.static_input:
            if (not isinstance(self.input_scale, torch.Tensor) or self.input_scale.numel() != 1
                    or self.input_scale.dtype != torch.float32
                    or self.input_scale.device != self.device):
                raise ValueError("input_scale must be a one-element float32 tensor on "
                                 f"{self.device} for static activations, "
                                 f"got {_describe(self.input_scale)}")
        elif self.input_scale is not None:
            raise ValueError("input_scale was given but the format quantizes activations "
                             "dynamically; use WeightFormat.fp8_tensor(static_input=True)")

    def _check_biases(self):
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        for name, shape in (("w13_bias", (E, self.halves * I)), ("w2_bias", (E, H))):
            bias = getattr(self, name)
            if bias is None:
                continue
            if not isinstance(bias, torch.Tensor) or bias.dtype not in FLOAT_DTYPES:
                raise ValueError(f"{name} must be a float tensor ({FLOAT_DTYPES}) of shape "
                                 f"{shape}, got {_describe(bias)}")
            self._check_stored(name, bias.dtype, shape, f"experts (E={E}, H={H}, I={I})")

    @property
    def biased(self) -> bool:
        return self.w13_bias is not None or self.w2_bias is not None

    def _check_stored(self, name: str, dtype: torch.dtype, shape: tuple[int, ...],
                      what: str) -> None:
        """Field `name` is a `dtype` tensor of `shape` on the weights' device."""
        t = getattr(self, name)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{name} must be a {str(dtype).removeprefix('torch.')} tensor of "
                             f"shape {shape} for {what}, got {_describe(t)}")
        if t.device != self.device:
            raise ValueError(f"{name} is on {t.device}, the weights on {self.device}")

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2] * self.format.packing

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2] * self.format.packing

    @property
    def halves(self) -> int:
        return 2 if self.gated else 1

    @property
    def dtype(self) -> torch.dtype:
        return self.w13.dtype

    @property
    def device(self) -> torch.device:
        return self.w13.device

    @property
    def signature(self) -> tuple:
        """What checks and launch arguments depend on: one signature, the same plans."""
        return (self.gated, self.format,
                *(tensor_signature(t) for t in (self.w13, self.w2, self.w13_scale, self.w2_scale,
                                                self.input_scale, self.w13_bias, self.w2_bias)))

    @property
    def w13_scale_up_offset(self) -> int:
        """Rows of w13_scale before the up half's: the gate's block rows (BLOCK) or its I rows."""
        if not self.gated:
            return 0
        return self.w13_scale.shape[1] // 2

    @classmethod
    def empty(cls, num_experts: int, hidden_size: int, intermediate_size: int, gated: bool,
              fmt: WeightFormat, dtype: torch.dtype, device=None,
              biased: bool = False) -> ExpertWeights:
        """Uninitialised weights (scales of 1; biases, if `biased`, zero in `dtype`)."""
        halves = 2 if gated else 1
        E, H, I, packing = num_experts, hidden_size, intermediate_size, fmt.packing
        storage = dict(dtype=fmt.storage_dtype(dtype), device=device)
        scales = (fmt.scale_shape(E, halves * I, H, halves), fmt.scale_shape(E, H, I),
                  fmt.input_scale_shape)
        # scales of 1: float32 ones, or the E8M0 byte 127
        one = (dict(fill_value=127, dtype=MXFP4_DTYPE) if fmt.fp4
               else dict(fill_value=1.0, dtype=torch.float32))
        biases = (dict(w13_bias=torch.zeros(E, halves * I, dtype=dtype, device=device),
                       w2_bias=torch.zeros(E, H, dtype=dtype, device=device)) if biased else {})
        return cls(torch.empty(E, halves * I, H // packing, **storage),
                   torch.empty(E, H, I // packing, **storage), gated, fmt,
                   *(torch.full(shape, device=device, **one) if shape else None
                     for shape in scales), **biases)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) in float32, the values the format stores."""
        if self.format.fp4:
            return (dequantize_mxfp4(self.w13, self.w13_scale),
                    dequantize_mxfp4(self.w2, self.w2_scale))
        if self.format.fp8 is None:
            return self.w13.float(), self.w2.float()
        return (_dequantize(self.w13, self.w13_scale, self.format, self.halves),
                _dequantize(self.w2, self.w2_scale, self.format, 1))

    def to_format(self, fmt: WeightFormat) -> ExpertWeights:
        """Quantized to `fmt` by torch ops. FP8: scale = max |w| (block/row/tensor) / 448, RNE.
        MXFP4: `quantize_mxfp4`."""
        if self.format.quantized or not fmt.quantized:
            raise ValueError("to_format quantizes unquantized weights to an FP8 or MXFP4 format; "
                             f"got {self.format} -> {fmt}")
        if fmt.fp4:
            # an expert at a time, as for FP8
            (w13, s13), (w2, s2) = (map(torch.cat, zip(*(quantize_mxfp4(w) for w in t.split(1)),
                                                      strict=True))
                                    for t in (self.w13, self.w2))
            return ExpertWeights(w13, w2, self.gated, fmt, s13, s2, **self._biases())
        if fmt.static_input:
            raise ValueError("a static input scale comes from calibration, not from the weights: "
                             "quantize with WeightFormat.fp8_tensor() and pass input_scale to "
                             "ExpertWeights yourself")
        # an expert at a time: DeepSeek-V3's experts are 45 GB in float32
        w13, s13 = zip(*(_quantize(w.float(), fmt, self.halves) for w in self.w13.split(1)),
                       strict=True)
        w2, s2 = zip(*(_quantize(w.float(), fmt, 1) for w in self.w2.split(1)), strict=True)
        return ExpertWeights(torch.cat(w13), torch.cat(w2), self.gated, fmt, torch.cat(s13),
                             torch.cat(s2), **self._biases())

    def _biases(self) -> dict:
        return dict(w13_bias=self.w13_bias, w2_bias=self.w2_bias)

    def expert(self, index: int) -> ExpertWeights:
        return self.select_experts(slice(index, index + 1))

    def select_experts(self, index: slice | torch.Tensor) -> ExpertWeights:
        """The experts `index` picks, scales too: a slice gives views, an int tensor copies."""
        E = self.num_experts
        if isinstance(index, torch.Tensor):
            if index.dim() != 1 or index.dtype.is_floating_point or index.dtype == torch.bool:
                raise ValueError("select_experts takes a slice or a 1-D integer tensor, "
                                 f"got {_describe(index)}")
            if index.numel() and not (0 <= int(index.min()) and int(index.max()) < E):
                raise ValueError(f"select_experts: expert indices must lie in [0, {E}), "
                                 f"got {int(index.min())}..{int(index.max())}")
        elif not isinstance(index, slice):
            raise ValueError("select_experts takes a slice or a 1-D integer tensor, "
                             f"got {type(index).__name__}")
        tensors = {n: getattr(self, n) for n in ("w13", "w2", "w13_scale", "w2_scale",
                                                  "w13_bias", "w2_bias")}
        return replace(self, **{n: t[index] for n, t in tensors.items() if t is not None})

    def narrow_intermediate(self, start: int, length: int, lead: int = 0) -> ExpertWeights:
        """Columns [start, start + length) of I, gate and up apart, after `lead` zeroed columns;
        start - lead on the block grid (`format.grid_lead`), so each block keeps its scale."""
        I, fmt = self.intermediate_size, self.format
        first, stop = start - lead, start + length
        if lead < 0 or length < 1 or first < 0 or stop > I:
            raise ValueError(f"narrow_intermediate(start={start}, length={length}, lead={lead}) "
                             f"must lie in I={I}: lead >= 0, length >= 1, start - lead >= 0 and "
                             "start + length <= I")
        if fmt.fp4 and (lead or first % MXFP4_GROUP or stop % MXFP4_GROUP):
            raise ValueError(f"narrow_intermediate(start={start}, length={length}, lead={lead}): "
                             f"MXFP4 slices cut whole {MXFP4_GROUP}-column groups (start and "
                             f"start + length multiples of {MXFP4_GROUP}, no lead)")
        if fmt.grid_lead(first):
            raise ValueError(f"narrow_intermediate: the slice starts at column {first}, inside a "
                             f"{fmt.block} block of {fmt} weights; start on the block grid or pass "
                             f"lead=format.grid_lead(start) (here {fmt.grid_lead(start)}) zero "
                             "columns")
        fields = {}
        for name, (dim, parts, step) in self._intermediate_axes().items():
            lo, hi = first // step, -(-stop // step)
            chunks = getattr(self, name).chunk(parts, dim)
            fields[name] = torch.cat([c.narrow(dim, lo, hi - lo) for c in chunks], dim)  # a copy
            # e4m3 zeroed as bytes: zero bytes are +0.0
            if lead and name in ("w13", "w2", "w13_bias"):
                cut = fields[name]
                cut = cut.view(torch.uint8) if cut.dtype == FP8_DTYPE else cut
                for part in cut.chunk(parts, dim):
                    part.narrow(dim, 0, lead).zero_()
        rest = {name: getattr(self, name).contiguous() for name in ("w13_scale", "w2_scale")
                if name not in fields and getattr(self, name) is not None}
        return replace(self, **fields, **rest)

    def pad_intermediate(self, multiple: int) -> ExpertWeights:
        """I zero-padded to a `multiple`, gate and up apart, new scales 1; self when aligned."""
        if multiple < 1:
            raise ValueError(f"multiple must be >= 1, got {multiple}")
        padded = -(-self.intermediate_size // multiple) * multiple
        if padded == self.intermediate_size:
            return self
        if self.format.fp4 and padded % MXFP4_GROUP:
            raise ValueError(f"MXFP4 experts pad I to whole {MXFP4_GROUP}-column groups: "
                             f"multiple={multiple} gives I={padded}")
        fields = {}
        for name, (dim, parts, step) in self._intermediate_axes().items():
            # zero weights (zero bytes: +0.0 in e4m3 and e2m1 alike) under scales of 1
            fill = 1.0 if name.endswith("scale") else 0.0
            fill = 127 if self.format.fp4 and fill else fill
            chunks = getattr(self, name).chunk(parts, dim)
            size = -(-padded // step)
            fields[name] = torch.cat([_pad_end(c, dim, size, fill) for c in chunks], dim)
        return replace(self, **fields)

    def _intermediate_axes(self) -> dict[str, tuple[int, int, int]]:
        """Each tensor with an I axis -> (dim, projections stacked on it, I columns per entry)."""
        axes = {"w13": (1, self.halves, 1), "w2": (2, 1, self.format.packing)}
        if self.w13_bias is not None:
            axes["w13_bias"] = (1, self.halves, 1)
        if self.format.fp4:  # w13's scales per row, w2's per 32 of I
            axes |= {"w13_scale": (1, self.halves, 1), "w2_scale": (2, 1, MXFP4_GROUP)}
        elif self.format.block is not None:
            block_n, block_c = self.format.block
            axes |= {"w13_scale": (1, self.halves, block_n), "w2_scale": (2, 1, block_c)}
        elif self.format.fp8 is not None:  # a scale per row: w13's rows are I's, w2's are H's
            axes["w13_scale"] = (1, self.halves, 1)
        return axes

    @classmethod
    def from_checkpoint(cls, w13: torch.Tensor | Sequence[torch.Tensor], w2: torch.Tensor,
                        fmt: WeightFormat, w13_scale=None, w2_scale=None, input_scale=None,
                        gated: bool = True, interleaved: bool = False, w13_bias=None,
                        w2_bias=None) -> ExpertWeights:
        """Experts as stored: w13 whole or as (gate, up), scales as `checkpoint_scale` takes.
        `interleaved`: w13's rows are [g0, u0, g1, u1, ...] (gpt-oss; transformers'
        is_concatenated=False), reordered once here into [gate; up], each row's scales and bias
        with it."""
        if interleaved and (not gated or fmt.fp8 not in (None, Fp8Scaling.CHANNEL)):
            raise ValueError("interleaved=True reorders gated w13 rows [g0, u0, g1, u1, ...] with "
                             "their per-row scales: it takes gated experts, unquantized, MXFP4 or "
                             "per-channel FP8 (a block or per-tensor scale would cover gate and up "
                             f"rows at once), got gated={gated}, {fmt}")
        if isinstance(w13, (list, tuple)):
            if len({tuple(w.shape) if isinstance(w, torch.Tensor) else None for w in w13}) != 1:
                raise ValueError("w13's projections must be tensors of one shape, "
                                 f"got {[_describe(w) for w in w13]}")
            w13 = torch.cat(list(w13), dim=1)
        if fmt.fp8 is not None and all(isinstance(w, torch.Tensor) and w.dim() == 3
                                       for w in (w13, w2)):
            w13_scale = fmt.checkpoint_scale(w13_scale, *w13.shape[1:], gated)
            w2_scale = fmt.checkpoint_scale(w2_scale, *w2.shape[1:])
            input_scale = fmt.checkpoint_input_scale(input_scale)
        if interleaved:
            w13, w13_scale, w13_bias = (_gate_rows_first(t) for t in (w13, w13_scale, w13_bias))
        return cls(w13, w2, gated, fmt, w13_scale, w2_scale, input_scale, w13_bias,
                   w2_bias)  # checks what is wrong


def _gate_rows_first(t):
    """Rows [g0, u0, g1, u1, ...] (dim 1) -> [g0, g1, ...; u0, u1, ...]; anything else as it is
    (ExpertWeights then says what is wrong with it)."""
    if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[1] % 2:
        return t
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


def quantize_weight(w: torch.Tensor, fmt: WeightFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """One linear's (N, C) -> (e4m3, float32 scale as a checkpoint stores it), as to_format does."""
    if w.dim() != 2 or fmt.fp8 is None or fmt.static_input:
        raise ValueError("quantize_weight takes a 2-D weight and a dynamic FP8 format, "
                         f"got {_describe(w)}, {fmt}")
    q, scale = _quantize(w[None].float(), fmt, 1)
    return q[0], scale[0] if fmt.fp8 is not Fp8Scaling.TENSOR else scale[0, :1]


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    if q.dim() != 2 or fmt.fp8 is None:
        raise ValueError("dequantize_weight takes a 2-D weight and an FP8 format, "
                         f"got {_describe(q)}, {fmt}")
    return _dequantize(q[None], fmt.checkpoint_scale(scale[None], *q.shape), fmt, 1)[0]


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., C] float -> (e2m1 pairs uint8 [..., C / 2], E8M0 scales uint8 [..., C / 32]).

    The rule: each group of 32's scale is the smallest power of two 2^e with max |w| / 2^e <= 6
    (the largest e2m1 value), so no value saturates; each value rounds to the nearest e2m1 value,
    ties to the even code; an all-zero group takes e = -127."""
    groups = w.float().unflatten(-1, (-1, MXFP4_GROUP))  # [..., G, 32]
    amax = groups.abs().amax(dim=-1)  # [..., G]
    mantissa, exponent = torch.frexp(amax / E2M1_VALUES[-1])
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # ceil(log2(amax / 6))
    exponent = torch.where(amax == 0, -127, exponent).clamp(-127, 127)
    scaled = (groups / torch.exp2(exponent.float())[..., None]).flatten(-2)  # [..., C], |.| <= 6
    grid = torch.tensor(E2M1_VALUES, device=w.device)
    midpoints = (grid[1:] + grid[:-1]) / 2
    magnitude = scaled.abs().clamp(max=E2M1_VALUES[-1])
    code = torch.bucketize(magnitude, midpoints)  # a tie takes the lower value's code
    tie = (code < len(midpoints)) & (magnitude == midpoints[code.clamp(max=len(midpoints) - 1)])
    code = code + (tie & (code % 2 == 1)).long()  # ties to the even code
    code = code | ((scaled < 0).long() << 3)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(MXFP4_DTYPE)  # the even index low
    return packed, (exponent + 127).to(MXFP4_DTYPE)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(e2m1 pairs [..., C / 2], E8M0 scales [..., C / 32]) -> [..., C] float32; a scale byte of
    255 is NaN, as the OCP MX spec has it."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=packed.device)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()  # [..., C]
    scale = torch.where(scales == 255, float("nan"), torch.exp2(scales.float() - 127))
    values = table[codes].unflatten(-1, (-1, MXFP4_GROUP))  # [..., G, 32]
    return (values * scale[..., None]).flatten(-2)


def per_tensor_rows(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """Per-tensor scales [E] or [E, 2] (gate, up) -> [E, rows] per row, exact (gate rows first)."""
    if scale.dim() == 1:
        return scale[:, None].expand(-1, rows).contiguous()
    if scale.dim() == 2 and scale.shape[1] == 2 and rows % 2 == 0:
        return scale.repeat_interleave(rows // 2, dim=1).contiguous()
    raise ValueError("per-tensor scales must be [E] or [E, 2] (gate, up), "
                     f"got {tuple(scale.shape)}")


def _row_blocks(scale: torch.Tensor, fmt: WeightFormat, halves: int, rows: int,
                cols: int) -> torch.Tensor:
    if fmt.block is None:
        return scale[:, :, None].expand(-1, rows, cols)
    block_n, block_c = fmt.block
    per_half = []
    for part in scale.chunk(halves, dim=1):  # the gate grid, then the up grid
        part = part.repeat_interleave(block_n, dim=1)[:, : rows // halves]
        per_half.append(part.repeat_interleave(block_c, dim=2)[:, :, :cols])
    return torch.cat(per_half, dim=1)


def _dequantize(w: torch.Tensor, scale: torch.Tensor, fmt: WeightFormat,
                halves: int) -> torch.Tensor:
    E, rows, cols = w.shape
    return w.float() * _row_blocks(scale.float(), fmt, halves, rows, cols)


def _quantize(w: torch.Tensor, fmt: WeightFormat,
              halves: int) -> tuple[torch.Tensor, torch.Tensor]:
    E, rows, cols = w.shape
    if fmt.block is not None:
        block_n, block_c = fmt.block
        grids = []
        for part in w.chunk(halves, dim=1):
            n = part.shape[1]
            padded = torch.nn.functional.pad(part.abs(), (0, -cols % block_c, 0, -n % block_n))
            blocks = padded.unflatten(1, (-1, block_n)).unflatten(3, (-1, block_c))
            grids.append(blocks.amax(dim=(2, 4)))  # [E, Nb, Cb] from [E, Nb, bn, Cb, bc]
        amax = torch.cat(grids, dim=1)
    elif fmt.fp8 is Fp8Scaling.CHANNEL:
        amax = w.abs().amax(dim=2)  # [E, rows]
    else:  # TENSOR: one amax per expert and half (gate, up), stored per row
        amax = per_tensor_rows(torch.stack([p.abs().amax(dim=(1, 2))
                                            for p in w.chunk(halves, dim=1)], dim=1)
                               if halves == 2 else w.abs().amax(dim=(1, 2)), rows)
    scale = amax.clamp(min=1e-12) / FP8_MAX
    q = (w / _row_blocks(scale, fmt, halves, rows, cols)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.float()


def _pad_end(t: torch.Tensor, dim: int, size: int, fill: float) -> torch.Tensor:
    """t grown to `size` along `dim` with `fill` (zero bytes for e4m3, which has no pad kernel)."""
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape) if fill == 0 else t.new_full(shape, fill)], dim)


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} tensor of shape {tuple(t.shape)}"


def tensor_signature(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)
