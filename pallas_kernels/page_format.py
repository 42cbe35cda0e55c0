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

One `PageFormat` names the storage of a cache: the cache allocates `page_shape`, encodes every
write with `encode`, readers decode with `decode`; the capacity planner counts `token_bytes`,
so planned and allocated bytes are the same number. Imports nothing from the rest of the project.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

FP8_BLOCK = 128          # latent values per fp32 scale
FP8_MAX = 448.0          # largest finite float8_e4m3fn
_PLAIN = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
NAMES = tuple(_PLAIN) + ("fp8",)


@dataclasses.dataclass(frozen=True)
class PageFormat:
  """How one cache page stores its tokens (hashable: a static argument of jitted code).

  Attributes:
    name: "bf16", "fp16", "fp32" or "fp8" (see the module docstring for the byte layouts).
    kernel_supported: whether `paged_gather`'s Mosaic GPU kernel has a body for this format.
    latent_dim: L, the latent values per token (a multiple of 128 for "fp8").
    rope_dim: R, the rope values per token, stored after the latent.
  """

  name: str
  kernel_supported: bool = True
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
      raise ValueError(f"fp8 pages need latent_dim a positive multiple of {FP8_BLOCK} "
                       f"(one fp32 scale per {FP8_BLOCK} values), got {self.latent_dim}")

  # --- shape and bytes ---------------------------------------------------------------------
  @property
  def quantized(self) -> bool:
    return self.name == "fp8"

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
    if self.quantized:
      return self.latent_dim + 4 * (self.latent_dim // FP8_BLOCK) + 2 * self.rope_dim
    return self.value_dim

  @property
  def token_bytes(self) -> int:
    """Bytes one token takes in one layer's pages (656 for fp8 at L=512, R=64; 1152 in bf16)."""
    return self.width * jnp.dtype(self.storage_dtype).itemsize

  def page_shape(self, page_size: int) -> tuple[int, int]:
    return (page_size, self.width)

  def with_dims(self, latent_dim: int, rope_dim: int) -> "PageFormat":
    return dataclasses.replace(self, latent_dim=latent_dim, rope_dim=rope_dim)

  # --- values in and out --------------------------------------------------------------------
  def encode(self, values):
    """Values [..., C] (any float dtype) -> stored [..., W] in this format."""
    if values.shape[-1] != self.value_dim:
      raise ValueError(f"{self.name} pages store {self.value_dim} values a token "
                       f"({self.latent_dim} latent + {self.rope_dim} rope), got last dim {values.shape[-1]}")
    if not self.quantized:
      return values.astype(self.storage_dtype)
    return quantize_latent_fp8(values, rope_dim=self.rope_dim)

  def decode(self, stored, dtype=None):
    """Stored [..., W] -> values [..., C] in ``dtype`` (None: the stored dtype, float32 for fp8)."""
    if stored.shape[-1] != self.width:
      raise ValueError(f"{self.name} pages hold {self.width} elements a token, got last dim {stored.shape[-1]}")
    out = dequantize_latent_fp8(stored, rope_dim=self.rope_dim) if self.quantized else stored
    return out if dtype is None else out.astype(dtype)

  # --- the hooks `paged_gather` uses (kernel shapes: 64-token pages, L=512, R=64) --------------
  def validate(self, kv_pages, page_size: int = 64) -> None:
    """Raises ValueError unless ``kv_pages`` is [num_pages, page_size, W] of `storage_dtype`."""
    want = (page_size, self.width)
    if kv_pages.ndim != 3 or kv_pages.shape[1:] != want:
      raise ValueError(f"{self.name} kv_pages must be [num_pages, {want[0]}, {want[1]}] "
                       f"(page size {page_size}), got {kv_pages.shape}")
    if kv_pages.dtype != self.storage_dtype:
      raise ValueError(f"{self.name} kv_pages must be {jnp.dtype(self.storage_dtype).name}, got {kv_pages.dtype}")

  def dequantize_reference(self, pages):
    """Pages [..., W] in this format -> bf16 [..., C] (jnp)."""
    return self.decode(pages, jnp.bfloat16)


BF16_PAGES = PageFormat(name="bf16", kernel_supported=True)
FP8_PAGES = PageFormat(name="fp8", kernel_supported=True)


def page_format_of(pages, *, rope_dim: int = 64) -> PageFormat:
  """The format of a pages array [..., W]: uint8 -> fp8 (L from W and ``rope_dim``), else its dtype."""
  dt = jnp.dtype(pages.dtype)
  if dt == jnp.uint8:
    # W = L + L/32 + 2R  ->  L = 32 (W - 2R) / 33
    lat = 32 * (pages.shape[-1] - 2 * rope_dim)
    if lat <= 0 or lat % 33:
      raise ValueError(f"uint8 pages of last dim {pages.shape[-1]} are not fp8 pages with rope_dim={rope_dim}")
    lat //= 33
    # paged_gather's fp8 kernel body reads DeepSeek's 656-byte tokens only
    kernel = FP8_PAGES.kernel_supported and (lat, rope_dim) == (FP8_PAGES.latent_dim, FP8_PAGES.rope_dim)
    return PageFormat("fp8", kernel_supported=kernel, latent_dim=lat, rope_dim=rope_dim)
  for name, d in _PLAIN.items():
    if dt == jnp.dtype(d):
      return PageFormat(name, latent_dim=pages.shape[-1] - rope_dim, rope_dim=rope_dim)
  raise ValueError(f"pages of dtype {dt.name} are in no known page format; known: {', '.join(NAMES)}")


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
    raise ValueError(f"fp8 pages need a latent width that is a positive multiple of {FP8_BLOCK}, "
                     f"got {L} (last dim {latent.shape[-1]} - rope_dim {rope_dim})")
  lead = latent.shape[:-1]
  x = latent[..., :L].astype(jnp.float32).reshape(lead + (L // FP8_BLOCK, FP8_BLOCK))
  scale = _divide(jnp.max(jnp.abs(x), axis=-1), jnp.float32(FP8_MAX))   # [..., L/128]
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
    raise ValueError(f"last dim {W} is not an fp8 page row (L + L/32 + 2*{rope_dim} bytes with L a multiple "
                     f"of {FP8_BLOCK}); 656 for L=512, R=64")
  L //= 33
  nb = L // FP8_BLOCK
  lead = stored.shape[:-1]
  q = jax.lax.bitcast_convert_type(stored[..., :L], jnp.float8_e4m3fn).astype(jnp.float32)
  scale = jax.lax.bitcast_convert_type(stored[..., L:L + 4 * nb].reshape(lead + (nb, 4)), jnp.float32)
  lat = (q.reshape(lead + (nb, FP8_BLOCK)) * scale[..., None]).reshape(lead + (L,))
  rope = jax.lax.bitcast_convert_type(stored[..., L + 4 * nb:].reshape(lead + (rope_dim, 2)), jnp.bfloat16)
  return jnp.concatenate([lat, rope.astype(jnp.float32)], axis=-1)
