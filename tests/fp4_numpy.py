"""The fp4 page layout built with numpy and ml_dtypes from its documentation (pallas_kernels.page_format),
never from the code under test: the expected bytes and values of the fp4 tests.

Per token of L latent + R rope values: L/2 bytes of packed e2m1 codes (byte j: value j in the low
nibble, value j + L/2 in the high one), each the float4_e2m1fn of x / s_k (IEEE fp32 division, clipped
to ±6, nearest even; 0 where s_k = 0); L/16 float8_e4m3fn scales s_k = e4m3(min(amax_k / 6, 448)) of
16-block k; R little-endian bf16 rope values.
"""

import ml_dtypes
import numpy as np


def fp4_bytes(latent, rope_dim=64):
    """float [..., L + R] -> uint8 [..., L/2 + L/16 + 2R]."""
    x = np.asarray(latent, np.float32)
    lat = x.shape[-1] - rope_dim
    lead = x.shape[:-1]
    blocks = x[..., :lat].reshape(lead + (lat // 16, 16))
    with np.errstate(invalid="ignore"):
        scale = np.minimum(np.abs(blocks).max(-1) / np.float32(6), np.float32(448)).astype(ml_dtypes.float8_e4m3fn)
        s32 = scale.astype(np.float32)
        safe = np.where(s32 > 0, s32, np.float32(1))
        q = np.clip(blocks / safe[..., None], -6, 6).astype(ml_dtypes.float4_e2m1fn)
    codes = q.view(np.uint8) & 0xF  # ml_dtypes keeps a float4 in the low nibble of a byte
    codes = np.where((s32 > 0)[..., None] | np.isnan(s32)[..., None], codes, 0).astype(np.uint8)
    codes = codes.reshape(lead + (lat,))
    packed = codes[..., : lat // 2] | (codes[..., lat // 2 :] << 4)
    r_bytes = x[..., lat:].astype(ml_dtypes.bfloat16).view(np.uint8).reshape(lead + (2 * rope_dim,))
    return np.concatenate([packed, scale.view(np.uint8), r_bytes], axis=-1)


# e2m1 code -> value, from the OCP MX spec's table (sign bit 3; E bits 2..1, bias 1; M bit 0)
E2M1 = np.float32([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def fp4_values(stored, rope_dim=64, dtype=np.float32):
    """uint8 [..., W] -> [..., L + R] in `dtype`: the table's e2m1 value * the e4m3 scale of its
    16-block (exact in fp32 and bf16); the rope's bf16 values."""
    p = np.ascontiguousarray(np.asarray(stored))
    lat = 16 * (p.shape[-1] - 2 * rope_dim) // 9
    packed = p[..., : lat // 2]
    q = E2M1[np.concatenate([packed & 0xF, packed >> 4], axis=-1)]
    scale = p[..., lat // 2 : lat // 2 + lat // 16].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    values = (q.reshape(q.shape[:-1] + (lat // 16, 16)) * scale[..., None]).reshape(q.shape)
    rope = p[..., lat // 2 + lat // 16 :].view(ml_dtypes.bfloat16)
    return np.concatenate([values.astype(dtype), rope.astype(dtype)], axis=-1)
