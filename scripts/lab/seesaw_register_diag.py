"""Diagnosis of the seesaw kernel's register use (GPU only; what NOTES.md quotes).

Variants of `_decode_partials_seesaw` by source transform (P·V through run_scoped instead of
run_state, no barrier wait inside the P·V scope, no V-tail zeroing, Q·Kᵀ into the whole
accumulator); for each, ptxas prints registers and spills (MOSAIC_GPU_DUMP_PTXAS=1) and the
variant is checked against the reference and timed on two cells with wall-clock time per call
over 20 calls (dispatch included: for comparing variants only; the benchmark's CUPTI figures are
the ones to quote). "no_zero" is only valid on inputs without NaN page tails, which these cells
have.

  MOSAIC_GPU_DUMP_PTXAS=1 XLA_FLAGS=--xla_gpu_autotune_level=0 PYTHONPATH=. \\
      python3 scripts/lab/seesaw_register_diag.py 2>&1 | grep -E "###|RESULT|Used|spill stores|injected"
"""
import kernel_variants as kv  # scripts/lab/, the script's own directory
from pallas_kernels import MlaDecodeConfig

FN = "_decode_partials_seesaw"
T = {
    "scoped_pv": [("      if interp:   # the interpreter has no run_state", "      if True:")],
    "no_then": [("acc = pv(acc * bcast(alpha0, acc), 0, 0, then=lambda: plgpu.barrier_wait(s1_bar))",
                 "acc = pv(acc * bcast(alpha0, acc), 0, 0); plgpu.barrier_wait(s1_bar)")],
    "no_zero": [("        zero_v(0, j0, 0)\n", ""), ("        zero_v(1, j1, 0)\n", ""),
                ("        zero_v(0, j0, half)\n", ""), ("        zero_v(1, j1, half)\n", "")],
    "whole_acc_qk": [("plgpu.wgmma(acc_ref.at[:, ts], q_smem", "plgpu.wgmma(acc_ref, q_smem")],
}
T["scoped_nozero"] = T["scoped_pv"] + T["no_zero"]
T["all"] = T["scoped_pv"] + T["no_zero"] + T["no_then"] + T["whole_acc_qk"]
CONFIG = MlaDecodeConfig(seesaw=True)


def main():
  variants = [("default", None, MlaDecodeConfig()), ("v2", None, CONFIG)]
  variants += [(name, t, CONFIG) for name, t in T.items()]
  kv.run(FN, variants, [(128, 4096, 128), (128, 8192, 64)], kv.wall_us)


if __name__ == "__main__":
  main()
