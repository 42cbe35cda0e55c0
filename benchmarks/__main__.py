"""``python -m benchmarks {mla_decode,paged_gather,moe,e2e,compile_depth,train} [options]``

(``--help`` after the name.)
"""

import sys

BENCHMARKS = {
    "mla_decode": "benchmarks.bench_mla_decode",
    "paged_gather": "benchmarks.bench_paged_gather",
    "moe": "benchmarks.bench_moe",
    "e2e": "benchmarks.bench_e2e",
    "compile_depth": "benchmarks.bench_compile_depth",
    "train": "benchmarks.bench_train",
}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m benchmarks {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    import importlib

    importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
