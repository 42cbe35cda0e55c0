"""``mla-bench NAME [options]`` (``python -m benchmarks NAME [options]``): the benchmarks below;
``mla-bench --help`` lists them, ``mla-bench NAME --help`` gives a benchmark's options.
"""

import importlib
import sys

BENCHMARKS = {
    "mla_decode": "benchmarks.bench_mla_decode",
    "paged_gather": "benchmarks.bench_paged_gather",
    "moe": "benchmarks.bench_moe",
    "e2e": "benchmarks.bench_e2e",
    "compile_depth": "benchmarks.bench_compile_depth",
    "train": "benchmarks.bench_train",
    "serve": "benchmarks.bench_serve",
}
# One line each for --help (the modules' docstrings say the rest). `main` imports only the benchmark it runs
# (`importlib.import_module`, a dispatch by name): importing all seven would import the models, the kernels and
# matplotlib, seconds more for --help (the package itself imports jax, ~1-2 s).
SUMMARIES = {
    "mla_decode": "the absorbed paged MLA decode kernel beside XLA and the naive path (GPU; --peers DIR: "
    "FlashMLA and vLLM's Triton MLA decode in the same process)",
    "paged_gather": "the paged gather kernel beside XLA's kv_pages[block_table] (GPU)",
    "moe": "one MoE layer's routed experts: the decode kernel, the Mosaic GPU grouped GEMM, lax.ragged_dot (GPU)",
    "e2e": "V2-Lite- and V3-shaped models through the engine, HF transformers as a peer (GPU; --quick: the "
    "reference cells; --config tiny: tiny models on a CPU in under a minute)",
    "compile_depth": "compile time of a generation at 4 and 27 layers (CPU or GPU)",
    "train": "one training step: compile time, peak memory, step time, tok/s and MFU (GPU; --model tiny on a CPU)",
    "serve": "the engine online under Poisson arrivals: throughput, TTFT and inter-token latency per rate (GPU; "
    "--config tiny on a CPU)",
}
PROG = "mla-bench"


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    return "\n".join(
        [
            f"usage: {PROG} {{{','.join(BENCHMARKS)}}} [options]   (also: python -m benchmarks ...)",
            "",
            "benchmarks (`mla-bench NAME --help` for a benchmark's options):",
            *(f"  {name.ljust(width)}  {SUMMARIES[name]}" for name in BENCHMARKS),
        ]
    )


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in BENCHMARKS:
        what = f"unknown benchmark {argv[0]!r}" if argv else "no benchmark named"
        print(f"{PROG}: error: {what}; choose from {', '.join(BENCHMARKS)} (see --help)", file=sys.stderr)
        return 2
    importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
