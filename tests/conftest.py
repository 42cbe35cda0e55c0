"""The command-line tools turn on jax's persistent compilation cache by default; tests turn theirs off
(MLA_JAX_COMPILE_CACHE=off; set it per test where a test is about it), so they never read or write
a user's cache: a run compiles into a cache of its own (below).

Under `-n N` (pytest-xdist's default "load" distribution) the tests go to the workers one by one,
except those of the modules in WHOLE_MODULES, each of which runs whole on one worker (the largest
first): their module-scoped fixtures (a model, an engine, a trained run, a built wheel) and the
steps their tests compile are then built once, not once per worker that happens to get one of
their tests. (xdist's own `--dist loadgroup` does not group under pytest 9: it renames the test
ids through an attribute pytest no longer reads.)"""

import os
import shutil
import tempfile

import pytest

os.environ.setdefault("MLA_JAX_COMPILE_CACHE", "off")

# XLA:CPU sizes its client's thread pool by the cores (NPROC overrides it). The Pallas interpreter
# runs each warpgroup of a kernel as its own XLA program whose callbacks block on the simulated
# barriers; on the 2-core CI machine two blocked warpgroups took both pool threads and the third
# never ran (an fp8 decode kernel hung in interpret mode whenever a CTA read two or more pages).
os.environ.setdefault("NPROC", "8")

# XLA without most of its optimisation work (jax's `jax_disable_most_optimizations`: LLVM at -O0, no
# expensive passes): most of the suite's time is XLA compiling small programs that then run for
# milliseconds, and those compile much faster (tests/test_training.py 67 -> 37 s on the 2-core machine).
# Set before jax is imported, so the tools the tests start inherit it too. Only on a machine without an
# NVIDIA driver (nvidia-smi): the GPU suite keeps XLA's defaults. Tests that run their programs for
# long (thousands of sampled tokens, 2048-token forwards) take the `xla_optimized` marker: they compile
# with the optimisations on (the `_xla_optimized` fixture below), where they run 2x faster.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
else:
    # The GPU tests check values, not speed: XLA's autotuner (each GEMM and fusion compiled and timed in several
    # configurations, its trial buffers on the card) is off for them and the tools they start. Under `-n 8` the
    # autotuners of eight processes ran the card out of memory (an H100, 2026-12-06).
    if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # `pytest -m gpu -n 4`: four processes share the card, so none may take JAX's default 75 % up front.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


@pytest.fixture(autouse=True)
def _xla_optimized(request):
    """For a test marked `xla_optimized`: XLA's optimisations on while it runs, off again after (module
    fixtures are built before this one: one that compiles uses `tests.xla_opt.optimized` itself)."""
    if request.node.get_closest_marker("xla_optimized") is None:
        yield
        return
    from tests.xla_opt import optimized

    with optimized():
        yield


# One run's own compilation cache: a fresh directory per `pytest` run, shared by its xdist workers
# and by the tools the tests start (they inherit the environment), removed at the end. Most of the
# suite's time is XLA compiling, and many tests compile the same programs through fresh jitted
# closures (a new Engine's steps, a CLI run in a subprocess, the other worker): they hit here.
# Never a user's cache, and never one from an earlier run.
_RUN_CACHE_ENV = "MLA_JAX_TEST_RUN_CACHE"
_OWN_RUN_CACHE = _RUN_CACHE_ENV not in os.environ  # true in the process that starts the run
if _OWN_RUN_CACHE:
    os.environ[_RUN_CACHE_ENV] = tempfile.mkdtemp(prefix="mla-jax-test-xla-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_RUN_CACHE_ENV]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


def pytest_unconfigure(config):
    if _OWN_RUN_CACHE:
        shutil.rmtree(os.environ[_RUN_CACHE_ENV], ignore_errors=True)


WHOLE_MODULES = frozenset(
    {
        "test_engine.py",  # the model / spec_model / engine fixtures; steps shared by equal shapes
        "test_generate_cli.py",  # the built-in model's steps, shared by the runs of equal pool shapes
        "test_memory_plan.py",  # the planned engine, and the largest steps its plan measured (compiled)
        "test_model_hf.py",  # a loaded model per fixture, and eager ops shared across them
        "test_serve.py",  # the engine `mla-bench serve --config tiny` builds; its run last finds the steps compiled
        "test_sharding.py",  # the one 8-device subprocess every multi-device test reads
        "test_train_cli.py",  # the train step, compiled once for every run of the module
        "test_training.py",  # the five-step run fixture
        "test_wheel.py",  # the built and installed wheel
    }
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "load":
        return None  # another --dist is kept
    from xdist.scheduler import LoadScopeScheduling

    # The GPU tests of those modules use none of their module fixtures (each builds its own engine), so a GPU run
    # (`-m gpu`) hands them out one by one: kept whole, test_engine.py's seven compiled-engine tests ran in
    # sequence on one worker, however many workers the run had.
    whole = frozenset() if config.getoption("markexpr", "").strip() == "gpu" else WHOLE_MODULES

    class ModulesWhole(LoadScopeScheduling):
        """Scope = the module for WHOLE_MODULES (none in a GPU run), the test itself otherwise; scopes with more
        tests are handed out first (LoadScopeScheduling's reordering)."""

        def _split_scope(self, nodeid):
            module = nodeid.split("::", 1)[0]
            return module if os.path.basename(module) in whole else nodeid

    return ModulesWhole(config, log)


# Two tiers (tests/tiers.py): the quick tier (the default run: the README's command) and `pytest --full`.
def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False, help="also run the full tier (tests marked `full`)")
    parser.addoption(
        "--test-log",
        default=None,
        metavar="FILE",
        help="append a line per test as it ends (seconds since the run began, its own seconds, outcome, id), so a "
        "run cut by a time limit still says what it covered and how long each test took (`scripts/gpu_run.sh suite`)",
    )


_TEST_LOG = {}


def pytest_configure(config):
    # the controller's (xdist's workers send it their reports: a worker writing too would write each line twice)
    if (path := config.getoption("--test-log", None)) and not hasattr(config, "workerinput"):
        import time

        _TEST_LOG.update(file=open(path, "a", buffering=1), t0=time.monotonic())  # noqa: SIM115 - open for the run


def pytest_runtest_logreport(report):
    """With --test-log: one line per test (its call; a setup that did not pass, which has none), written as it ends
    (on the xdist controller for a parallel run)."""
    if "file" in _TEST_LOG and (report.when == "call" or (report.when == "setup" and not report.passed)):
        import time

        elapsed = time.monotonic() - _TEST_LOG["t0"]
        _TEST_LOG["file"].write(f"{elapsed:8.1f} {report.duration:7.1f} {report.outcome:7s} {report.nodeid}\n")


def pytest_collection_modifyitems(config, items):
    from tests.tiers import full_tier

    if config.getoption("markexpr", "").strip() == "gpu":
        # The GPU run's longest tests first (the tools in subprocesses, the compiled engines: 1-3 minutes each,
        # `mla-bench serve` the longest): handed out last, one of them alone set the run's end. A stable sort.
        first = ("tests/test_gpu_tools.py::test_gpu_mla_bench_serve", "tests/test_engine.py", "tests/test_gpu_tools.py")
        items.sort(key=lambda item: next((i for i, f in enumerate(first) if item.nodeid.startswith(f)), len(first)))
    if full_tier(config):
        return
    dropped = [item for item in items if item.get_closest_marker("full") is not None]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item.get_closest_marker("full") is None]


def pytest_report_header(config):
    from tests.tiers import full_tier

    return f"test tier: {'full' if full_tier(config) else 'quick (pytest --full adds the tests marked full)'}"


@pytest.fixture
def mla_decode_races(monkeypatch):
    """Runs `mla_decode`'s interpreted kernels under the interpreter's race detector; call the returned function
    after the kernel ran: it says whether any race was found."""
    import importlib

    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    md = importlib.import_module("pallas_kernels.mla_decode")  # the package (its name is also the function's)
    monkeypatch.setattr(md, "INTERPRET_PARAMS", plgpu.InterpretGPUParams(detect_races=True))
    return lambda: interpret_pallas_call.get_races().races_found
