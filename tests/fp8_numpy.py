"""The fp8 page layout built with numpy and ml_dtypes from its documentation (pallas_kernels.page_format),
never from the code under test: the expected bytes and values of the fp8 tests.

Per token of L latent + R rope values: L float8_e4m3fn bytes of x / scale_k (IEEE fp32 division,
round to nearest even after clipping to ±448), L/128 little-endian fp32 scales amax_k / 448, R
little-endian bf16 rope values.
"""

import ml_dtypes
import numpy as np


def fp8_bytes(latent, rope_dim=64):
    """float [..., L + R] -> uint8 [..., L + L/32 + 2R]."""
    x = np.asarray(latent, np.float32)
    lat = x.shape[-1] - rope_dim
    lead = x.shape[:-1]
    blocks = x[..., :lat].reshape(lead + (lat // 128, 128))
    scale = (np.abs(blocks).max(-1) / np.float32(448)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(blocks / safe[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    q_bytes = q.view(np.uint8).reshape(lead + (lat,))
    s_bytes = scale.astype("<f4").view(np.uint8).reshape(lead + (4 * (lat // 128),))
    r_bytes = x[..., lat:].astype(ml_dtypes.bfloat16).view(np.uint8).reshape(lead + (2 * rope_dim,))
    return np.concatenate([q_bytes, s_bytes, r_bytes], axis=-1)


def fp8_values(stored, rope_dim=64, dtype=np.float32):
    """uint8 [..., W] -> [..., L + R] in `dtype`: e4m3 * the fp32 scale of its 128-block, computed in
    fp32 and rounded once to `dtype`; the rope's bf16 values."""
    p = np.ascontiguousarray(np.asarray(stored))
    lat = 32 * (p.shape[-1] - 2 * rope_dim) // 33
    q = p[..., :lat].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scale = p[..., lat : lat + 4 * (lat // 128)].view("<f4")
    values = (q.reshape(q.shape[:-1] + (lat // 128, 128)) * scale[..., None]).reshape(q.shape)
    rope = p[..., lat + 4 * (lat // 128) :].view(ml_dtypes.bfloat16)
    return np.concatenate([values.astype(dtype), rope.astype(dtype)], axis=-1)
