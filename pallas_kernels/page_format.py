"""Page formats of the latent KV cache: how one cached token (latent ; rope) is stored.

Dimension letters: L latent width (kv_lora_rank, 512 for DeepSeek-V2/V3), R rope width
(qk_rope_head_dim, 64), C = L + R, W the stored width of one token.

* "bf16" / "fp16" / "fp32": the values themselves, W = C elements of that dtype.
* "fp8": FlashMLA's fp8 KV layout, W = L + 4·L/128 + 2·R bytes (656 for L=512, R=64), uint8:

      bytes [0, L)              the L latent values as float8_e4m3fn, x / scale_k for value x of
                                128-block k (values are rounded to nearest, clipped to ±448)
      bytes [L, L + 4·L/128)    L/128 float32 scales, little-endian, scale_k = amax_k / 448 of
                                block k (0 for an all-zero block)
      bytes [L + 4·L/128, W)    the R rope values as bfloat16, little-endian

  Dequantised value = float(e4m3) · scale_k; the rope part is exact in bf16. A 64-token page is
  `uint8 [64, 656]` (41 984 bytes, against 73 728 in bf16).
* "fp4": e2m1 pairs with an e4m3 scale per 16 values, W = L/2 + L/16 + 2·R bytes (416 for L=512,
  R=64; L a positive multiple of 32), uint8:

      bytes [0, L/2)            packed e2m1 codes: byte j holds latent value j in its low nibble and
                                value j + L/2 in its high nibble (the low nibbles of a row are the
                                first half of the latent, the high nibbles the second half). A code
                                is sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0: the
                                values {0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6}
      bytes [L/2, L/2 + L/16)   the L/16 float8_e4m3fn scales, s_k of 16-block k = value_index // 16
      bytes [L/2 + L/16, W)     the R rope values as bfloat16, little-endian

  s_k = amax_k / 6 (fp32, correctly rounded), clipped to 448 and rounded to nearest-even e4m3; the
  code of x is x / float(s_k) (fp32, correctly rounded), clipped to ±6 and rounded to nearest-even
  e2m1 (-0.0 keeps its sign bit). Because s_k is rounded, x / s_k may exceed 6 by up to one e4m3
  step (1/16): it is clipped to ±6. A block whose amax / 6 rounds to 0 in e4m3 (amax < 6·2^-10,
  an all-zero block included) has scale 0 and stores 0 codes; values above 6·448 = 2688 saturate.
  A NaN in a block makes its scale NaN (e4m3 0x7F), so all 16 values decode to NaN.
  Dequantised value = e2m1 · float(s_k), exact in bf16 (at most 2 x 4 significant bits); the rope
  part is exact in bf16. A 64-token page is `uint8 [64, 416]` (26 624 bytes).

One `PageFormat` names the storage of a cache: the cache allocates `page_shape`, encodes every
write with `encode`, readers decode with `decode`; the capacity planner counts `token_bytes`,
so planned and allocated bytes are the same number. Imports nothing from the rest of the project.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

FP8_BLOCK = 128  # latent values per fp32 scale
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_BLOCK = 16  # latent values per e4m3 scale
FP4_MAX = 6.0  # largest e2m1
_PLAIN = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
QUANTIZED = ("fp8", "fp4")
NAMES = tuple(_PLAIN) + QUANTIZED


@dataclasses.dataclass(frozen=True)
class PageFormat:
    """How one cache page stores its tokens (hashable: a static argument of jitted code).

    Attributes:
      name: "bf16", "fp16", "fp32", "fp8" or "fp4" (`NAMES`; the module docstring has the byte layouts).
      latent_dim: L, the latent values per token (a multiple of 128 for "fp8", of 32 for "fp4").
      rope_dim: R, the rope values per token, stored after the latent.
    """

    name: str
    latent_dim: int = 512
    rope_dim: int = 64

    def __post_init__(self):
        if self.name not in NAMES:
            raise ValueError(f"page format {self.name!r} is unknown; known: {', '.join(NAMES)}")
        for field in ("latent_dim", "rope_dim"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{field} must be a non-negative integer, got {v!r}")
        if self.name == "fp8" and (self.latent_dim < FP8_BLOCK or self.latent_dim % FP8_BLOCK):
            raise ValueError(
                f"fp8 pages need latent_dim a positive multiple of {FP8_BLOCK} "
                f"(one fp32 scale per {FP8_BLOCK} values), got {self.latent_dim}"
            )
        if self.name == "fp4" and (self.latent_dim < 2 * FP4_BLOCK or self.latent_dim % (2 * FP4_BLOCK)):
            raise ValueError(
                f"fp4 pages need latent_dim a positive multiple of {2 * FP4_BLOCK} (two halves of "
                f"{FP4_BLOCK}-value blocks, paired in bytes), got {self.latent_dim}"
            )

    # --- shape and bytes ---------------------------------------------------------------------
    @property
    def quantized(self) -> bool:
        return self.name in QUANTIZED

    @property
    def value_dim(self) -> int:
        """C = L + R: the values a token holds once decoded."""
        return self.latent_dim + self.rope_dim

    @property
    def storage_dtype(self):
        return jnp.uint8 if self.quantized else _PLAIN[self.name]

    @property
    def width(self) -> int:
        """W: elements of `storage_dtype` one token takes (the pages' last dimension)."""
        if self.name == "fp8":
            return self.latent_dim + 4 * (self.latent_dim // FP8_BLOCK) + 2 * self.rope_dim
        if self.name == "fp4":
            return self.latent_dim // 2 + self.latent_dim // FP4_BLOCK + 2 * self.rope_dim
        return self.value_dim

    @property
    def token_bytes(self) -> int:
        """Bytes one token takes in one layer's pages (656 for fp8, 416 for fp4 at L=512, R=64; 1152 in bf16)."""
        return self.width * jnp.dtype(self.storage_dtype).itemsize

    def page_shape(self, page_size: int) -> tuple[int, int]:
        return (page_size, self.width)

    def with_dims(self, latent_dim: int, rope_dim: int) -> "PageFormat":
        return dataclasses.replace(self, latent_dim=latent_dim, rope_dim=rope_dim)

    # --- values in and out --------------------------------------------------------------------
    def encode(self, values):
        """Values [..., C] (any float dtype) -> stored [..., W] in this format."""
        if values.shape[-1] != self.value_dim:
            raise ValueError(
                f"{self.name} pages store {self.value_dim} values a token "
                f"({self.latent_dim} latent + {self.rope_dim} rope), got last dim {values.shape[-1]}"
            )
        if not self.quantized:
            return values.astype(self.storage_dtype)
        quantize = quantize_latent_fp8 if self.name == "fp8" else quantize_latent_fp4
        return quantize(values, rope_dim=self.rope_dim)

    def decode(self, stored, dtype=None):
        """Stored [..., W] -> values [..., C] in ``dtype`` (None: the stored dtype, float32 for fp8 / fp4)."""
        if stored.shape[-1] != self.width:
            raise ValueError(f"{self.name} pages hold {self.width} elements a token, got last dim {stored.shape[-1]}")
        if self.quantized:
            dequantize = dequantize_latent_fp8 if self.name == "fp8" else dequantize_latent_fp4
            stored = dequantize(stored, rope_dim=self.rope_dim)
        return stored if dtype is None else stored.astype(dtype)

    # --- what the kernels ask of a format ---------------------------------------------------------
    def validate(self, kv_pages, page_size: int = 64) -> None:
        """Raises ValueError unless ``kv_pages`` is [num_pages, page_size, W] of `storage_dtype`."""
        want = (page_size, self.width)
        if kv_pages.ndim != 3 or kv_pages.shape[1:] != want:
            raise ValueError(
                f"{self.name} kv_pages must be [num_pages, {want[0]}, {want[1]}] "
                f"(page size {page_size}), got {kv_pages.shape}"
            )
        if kv_pages.dtype != self.storage_dtype:
            raise ValueError(f"{self.name} kv_pages must be {jnp.dtype(self.storage_dtype).name}, got {kv_pages.dtype}")

    def dequantize_reference(self, pages):
        """Pages [..., W] in this format -> bf16 [..., C] (jnp)."""
        return self.decode(pages, jnp.bfloat16)


BF16_PAGES = PageFormat(name="bf16")
FP8_PAGES = PageFormat(name="fp8")
FP4_PAGES = PageFormat(name="fp4")


def resolve_page_format(spec, *, value_dim: int | None = None, rope_dim: int = 64) -> PageFormat:
    """The one way a page format is named: `spec` is a name of `NAMES` ("bf16", "fp8", ...), a `PageFormat`,
    or the jnp dtype of a plain format (bfloat16, float16, float32) -> its `PageFormat`.

    value_dim: C = L + R, the values a token holds (None: 512 + 64 for a name or a dtype, a `PageFormat`'s
    own). rope_dim: R, the last values of a token, stored after the latent. Plain formats store every value
    alike, so for them the split only names the widths (a rope wider than the token is read as all of it).
    ValueError, naming the value, for an unknown format, uint8 (the dtype of both fp8 and fp4 pages: name
    the format), or widths a quantized format cannot store (fp8: L a positive multiple of 128; fp4: of 32).
    """
    if isinstance(spec, PageFormat):
        if value_dim is None:
            return spec
        name = spec.name
    elif isinstance(spec, str) and spec in NAMES:
        name = spec
    else:
        try:
            dt = jnp.dtype(spec)
        except TypeError:
            raise ValueError(f"page format {spec!r} is unknown; known: {', '.join(NAMES)}") from None
        if dt == jnp.uint8:
            raise ValueError(f"uint8 is the storage of both quantized page formats; name one of {QUANTIZED}")
        name = next((n for n, d in _PLAIN.items() if dt == jnp.dtype(d)), None)
        if name is None:
            raise ValueError(f"page format {dt.name} is unknown; known: {', '.join(NAMES)}")
    if value_dim is None:
        return PageFormat(name)
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or rope_dim < 0:
        raise ValueError(f"rope_dim must be a non-negative integer, got {rope_dim!r}")
    if name not in QUANTIZED:
        rope_dim = min(rope_dim, value_dim)
    elif rope_dim >= value_dim:
        raise ValueError(f"{name} pages need a latent part: rope_dim={rope_dim} >= the token's {value_dim} values")
    return PageFormat(name, latent_dim=value_dim - rope_dim, rope_dim=rope_dim)


def _quantized_latent_dim(name: str, width: int, rope_dim: int) -> int | None:
    """L of a `name` (fp8 / fp4) token of `width` bytes with `rope_dim` rope values, None if none fits."""
    if name == "fp8":  # W = L + L/32 + 2R  ->  L = 32 (W - 2R) / 33, a multiple of 128
        num, den, multiple = 32 * (width - 2 * rope_dim), 33, FP8_BLOCK
    else:  # W = L/2 + L/16 + 2R  ->  L = 16 (W - 2R) / 9, a multiple of 32
        num, den, multiple = 16 * (width - 2 * rope_dim), 9, 2 * FP4_BLOCK
    if num <= 0 or num % den or (num // den) % multiple:
        return None
    return num // den


def page_format_of(pages, *, rope_dim: int = 64) -> PageFormat:
    """The format of a pages array [..., W]: uint8 -> fp8 or fp4, told apart by W (656 vs 416 at
    L=512, R=64; L from W and ``rope_dim``), else its dtype. A uint8 width that both quantized
    layouts fit (W - 2R a multiple of 396, e.g. 524 at R=64) raises: name the format explicitly."""
    dt = jnp.dtype(pages.dtype)
    if dt == jnp.uint8:
        W = pages.shape[-1]
        fits = {name: lat for name in QUANTIZED if (lat := _quantized_latent_dim(name, W, rope_dim)) is not None}
        if not fits:
            raise ValueError(f"uint8 pages of last dim {W} are not fp8 or fp4 pages with rope_dim={rope_dim}")
        if len(fits) > 1:
            raise ValueError(
                f"uint8 pages of last dim {W} fit both fp8 (L={fits['fp8']}) and fp4 (L={fits['fp4']}) "
                f"pages with rope_dim={rope_dim}; pass the PageFormat explicitly"
            )
        ((name, lat),) = fits.items()
        return PageFormat(name, latent_dim=lat, rope_dim=rope_dim)
    for name, d in _PLAIN.items():
        if dt == jnp.dtype(d):  # plain values: the split only names the widths (as in `resolve_page_format`)
            rope = min(rope_dim, pages.shape[-1])
            return PageFormat(name, latent_dim=pages.shape[-1] - rope, rope_dim=rope)
    raise ValueError(f"pages of dtype {dt.name} are in no known page format; known: {', '.join(NAMES)}")


def check_pages(kv_pages, page_format: PageFormat | None = None, *, page_size: int) -> PageFormat:
    """The format of the pages array ``kv_pages`` [num_pages, page_size, W], as every kernel takes it:
    ``page_format`` checked against the pages' dtype and width, or (None) read from them (`page_format_of`).
    ValueError, naming the value, when they disagree or name no format."""
    if page_format is None:
        page_format = page_format_of(kv_pages)
    elif not isinstance(page_format, PageFormat):
        raise ValueError(f"page_format must be a PageFormat or None, got {page_format!r}")
    page_format.validate(kv_pages, page_size)
    return page_format


def _divide(a, b):
    """a / b, correctly rounded in every element. XLA rewrites a division by a broadcast (a scalar
    constant, or a per-block scale) into a multiplication by its reciprocal, which is off by one ulp
    in about half the elements (amax / 448 included); the barrier keeps the division a division, so
    the stored bytes are the documented ones on every backend."""
    return a / jax.lax.optimization_barrier(jnp.broadcast_to(b, a.shape))


def quantize_latent_fp8(latent, *, rope_dim: int = 64):
    """float latent [..., L + R] -> uint8 [..., L + 4·L/128 + 2·R] in the fp8 page layout.

    Layout (the module docstring): L float8_e4m3fn bytes of x / scale_k (both divisions correctly
    rounded fp32, the quotient rounded to nearest e4m3 after clipping to ±448); L/128 little-endian
    float32 scales scale_k = amax_k / 448 (0 for an all-zero block); R little-endian bf16 rope
    values. 576 -> 656 bytes for DeepSeek's L=512, R=64. Pure jnp: it fuses into the cache write.
    """
    L = latent.shape[-1] - rope_dim
    if L < FP8_BLOCK or L % FP8_BLOCK:
        raise ValueError(
            f"fp8 pages need a latent width that is a positive multiple of {FP8_BLOCK}, "
            f"got {L} (last dim {latent.shape[-1]} - rope_dim {rope_dim})"
        )
    lead = latent.shape[:-1]
    x = latent[..., :L].astype(jnp.float32).reshape(lead + (L // FP8_BLOCK, FP8_BLOCK))
    scale = _divide(jnp.max(jnp.abs(x), axis=-1), jnp.float32(FP8_MAX))  # [..., L/128]
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(_divide(x, safe[..., None]), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    q_bytes = jax.lax.bitcast_convert_type(q, jnp.uint8).reshape(lead + (L,))
    s_bytes = jax.lax.bitcast_convert_type(scale, jnp.uint8).reshape(lead + (4 * (L // FP8_BLOCK),))
    rope = latent[..., L:].astype(jnp.bfloat16)
    r_bytes = jax.lax.bitcast_convert_type(rope, jnp.uint8).reshape(lead + (2 * rope_dim,))
    return jnp.concatenate([q_bytes, s_bytes, r_bytes], axis=-1)


def dequantize_latent_fp8(stored, *, rope_dim: int = 64):
    """uint8 [..., W] in the fp8 page layout -> float32 [..., L + R] (the inverse of
    `quantize_latent_fp8` up to the e4m3 rounding of the latent; the rope part is bf16-exact)."""
    if stored.dtype != jnp.uint8:
        raise ValueError(f"fp8 pages are uint8, got {stored.dtype}")
    W = stored.shape[-1]
    L = 32 * (W - 2 * rope_dim)
    if L <= 0 or L % 33 or (L // 33) % FP8_BLOCK:
        raise ValueError(
            f"last dim {W} is not an fp8 page row (L + L/32 + 2*{rope_dim} bytes with L a multiple "
            f"of {FP8_BLOCK}); 656 for L=512, R=64"
        )
    L //= 33
    nb = L // FP8_BLOCK
    lead = stored.shape[:-1]
    q = jax.lax.bitcast_convert_type(stored[..., :L], jnp.float8_e4m3fn).astype(jnp.float32)
    scale = jax.lax.bitcast_convert_type(stored[..., L : L + 4 * nb].reshape(lead + (nb, 4)), jnp.float32)
    lat = (q.reshape(lead + (nb, FP8_BLOCK)) * scale[..., None]).reshape(lead + (L,))
    rope = jax.lax.bitcast_convert_type(stored[..., L + 4 * nb :].reshape(lead + (rope_dim, 2)), jnp.bfloat16)
    return jnp.concatenate([lat, rope.astype(jnp.float32)], axis=-1)


# e2m1 round-to-nearest-even by thresholds on |q| in [0, 6]: the code (0..7) is the number of
# thresholds passed; a tie (0.25, 1.25, 2.5, 5 strictly; 0.75, 1.75, 3.5 inclusively) goes to the
# even mantissa. Plain comparisons: no float4 conversion is needed from XLA on any backend.
_E2M1_UP = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _e2m1_codes(q):
    """float32 [...] (already clipped to ±6, or NaN) -> uint8 e2m1 codes [...] (NaN -> 0 or 8: its
    block's scale is NaN, so it decodes to NaN)."""
    a = jnp.abs(q)
    mag = sum(((a >= t) if inclusive else (a > t)).astype(jnp.uint8) for t, inclusive in _E2M1_UP)
    return mag | (jnp.signbit(q).astype(jnp.uint8) << 3)


def quantize_latent_fp4(latent, *, rope_dim: int = 64):
    """float latent [..., L + R] -> uint8 [..., L/2 + L/16 + 2·R] in the fp4 page layout.

    Layout (the module docstring): byte j < L/2 holds the e2m1 code of latent value j in its low
    nibble and of value j + L/2 in its high nibble; then L/16 float8_e4m3fn scales
    s_k = e4m3(min(amax_k / 6, 448)) of 16-block k (nearest-even; 0 when it rounds to 0, and then
    the block's codes are 0); then R little-endian bf16 rope values. A code is the e2m1 value of
    x / float(s_k) (fp32, correctly rounded) clipped to ±6, rounded to nearest-even. 576 -> 416 bytes
    for DeepSeek's L=512, R=64. Pure jnp: it fuses into the cache write.
    """
    L = latent.shape[-1] - rope_dim
    if L < 2 * FP4_BLOCK or L % (2 * FP4_BLOCK):
        raise ValueError(
            f"fp4 pages need a latent width that is a positive multiple of {2 * FP4_BLOCK}, "
            f"got {L} (last dim {latent.shape[-1]} - rope_dim {rope_dim})"
        )
    lead = latent.shape[:-1]
    nb = L // FP4_BLOCK
    x = latent[..., :L].astype(jnp.float32).reshape(lead + (nb, FP4_BLOCK))
    amax = jnp.max(jnp.abs(x), axis=-1)  # [..., L/16]
    scale = jnp.minimum(_divide(amax, jnp.float32(FP4_MAX)), FP8_MAX).astype(jnp.float8_e4m3fn)
    s32 = scale.astype(jnp.float32)
    safe = jnp.where(s32 > 0, s32, 1.0)
    q = jnp.clip(_divide(x, safe[..., None]), -FP4_MAX, FP4_MAX)
    codes = jnp.where((s32 > 0)[..., None] | jnp.isnan(s32)[..., None], _e2m1_codes(q), 0)
    codes = codes.astype(jnp.uint8).reshape(lead + (L,))
    packed = codes[..., : L // 2] | (codes[..., L // 2 :] << 4)
    s_bytes = jax.lax.bitcast_convert_type(scale, jnp.uint8)
    rope = latent[..., L:].astype(jnp.bfloat16)
    r_bytes = jax.lax.bitcast_convert_type(rope, jnp.uint8).reshape(lead + (2 * rope_dim,))
    return jnp.concatenate([packed, s_bytes, r_bytes], axis=-1)


def dequantize_latent_fp4(stored, *, rope_dim: int = 64):
    """uint8 [..., W] in the fp4 page layout -> float32 [..., L + R]: e2m1 · float(e4m3 scale of its
    16-block) (the inverse of `quantize_latent_fp4` up to the e2m1 / e4m3 rounding; the rope part is
    bf16-exact)."""
    if stored.dtype != jnp.uint8:
        raise ValueError(f"fp4 pages are uint8, got {stored.dtype}")
    W = stored.shape[-1]
    L = _quantized_latent_dim("fp4", W, rope_dim)
    if L is None:
        raise ValueError(
            f"last dim {W} is not an fp4 page row (L/2 + L/16 + 2*{rope_dim} bytes with L a multiple "
            f"of {2 * FP4_BLOCK}); 416 for L=512, R=64"
        )
    nb = L // FP4_BLOCK
    lead = stored.shape[:-1]
    packed = stored[..., : L // 2]
    codes = jnp.concatenate([packed & 0xF, packed >> 4], axis=-1)  # [..., L]
    # e2m1 -> f16 bits: sign to bit 15, exponent and mantissa to bits 11..9; times 2^14 it is the value
    bits = ((codes.astype(jnp.uint16) & 8) << 12) | ((codes.astype(jnp.uint16) & 7) << 9)
    q = jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32) * 2.0**14
    scale = jax.lax.bitcast_convert_type(stored[..., L // 2 : L // 2 + nb], jnp.float8_e4m3fn).astype(jnp.float32)
    lat = (q.reshape(lead + (nb, FP4_BLOCK)) * scale[..., None]).reshape(lead + (L,))
    rope = jax.lax.bitcast_convert_type(stored[..., L // 2 + nb :].reshape(lead + (rope_dim, 2)), jnp.bfloat16)
    return jnp.concatenate([lat, rope.astype(jnp.float32)], axis=-1)
