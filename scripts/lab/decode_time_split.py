"""What the warp-specialised split-QK decode kernel's time splits into (GPU only; docs/NOTES.md).

Ablations of `_decode_partials` by source transform, each timed with CUPTI (median of 30, whole
call) on two cells beside the unmodified kernel. The ablated kernels compute wrong results on
purpose (their rel_err is printed, not checked); the point is the time each part costs:
  no_pv      P·V skipped (loads + Q·Kᵀ + softmax + exchanges)
  no_qk      Q·Kᵀ skipped, scores = 0 (loads + softmax + exchanges + P·V)
  no_mma     both skipped (loads + softmax + exchanges: the non-tensor floor)
  l2_pages   every step of a split re-reads the split's first page (L2-resident): the kernel
             with DRAM traffic taken out

  PYTHONPATH=. python3 scripts/lab/decode_time_split.py
"""

import kernel_variants as kv  # scripts/lab/, the script's own directory

from pallas_kernels import MlaDecodeConfig

FN = "_decode_partials"
_NO_QK = (
    "      sc = pl.run_scoped(qk, plgpu.ACC((ROWS, PAGE_SIZE // 2), jnp.float32)) * scale_log2",
    "      sc = plgpu.layout_cast(jnp.zeros((ROWS, PAGE_SIZE // 2), jnp.float32), wgmma_layout)",
)
_NO_PV = ("      return pv_update(acc, p16, kv.at[:, cols]), m_new, l", "      return acc, m_new, l")
T = {
    "no_pv": [_NO_PV],
    "no_qk": [_NO_QK],
    "no_mma": [_NO_QK, _NO_PV],
    "l2_pages": [
        ("lambda i: (table[first_page + i], 0, 0)", "lambda i: (table[first_page + jnp.minimum(i, 0)], 0, 0)")
    ],
}
CONFIG = MlaDecodeConfig(scorer=False, split_qk=True)


def main():
    variants = [("default", None, CONFIG)] + [(name, t, CONFIG) for name, t in T.items()]
    kv.run(FN, variants, [(128, 4096, 128), (128, 8192, 64)], kv.cupti_us)


if __name__ == "__main__":
    main()
