"""The shape of the project, checked: the direction of imports, no import circle, no private module of another
package imported, the engine and its scheduler free of kernels, the sizes of files and classes, and one tuple of names
per implementation choice, the command lines' choices included (they were six lists that had drifted apart)."""

import argparse
import ast
import os

import pytest

from mla_jax.attention import DECOMPRESSED_IMPLS
from mla_jax.cache_paths import CACHE_IMPLS
from models.experts import MOE_IMPLS, MOE_TRAINING_IMPLS
from pallas_kernels import backend
from pallas_kernels.page_format import NAMES as PAGE_FORMATS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("pallas_kernels", "mla_jax", "models", "benchmarks")
# Each package may import those before it (DESIGN.md: kernels <- mla_jax <- models <- benchmarks).
LAYER = {p: i for i, p in enumerate(PACKAGES)}


def _modules() -> dict[str, str]:
    """{dotted module name: path} of every Python file of the four packages."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


MODULES = _modules()


def _imports(name: str, path: str) -> list[tuple[str, int]]:
    """(project module imported, line) for every import statement of the module, resolved to modules: `from
    pkg import x` is `pkg.x` when that is a module, else `pkg`."""
    tree = ast.parse(open(path).read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub if sub in MODULES else base, node.lineno))
    return [(m, line) for m, line in out if m.split(".")[0] in PACKAGES]


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_imports_go_one_way_and_reach_no_private_module_of_another_package():
    """DESIGN.md's direction (pallas_kernels <- mla_jax <- models <- benchmarks), and nothing imports a
    private module (a name part starting with "_") of another package: the engine and four other modules
    imported the Hopper check from a private module of `pallas_kernels` (now `pallas_kernels.backend`)."""
    bad = []
    for name, imports in GRAPH.items():
        pkg = name.split(".")[0]
        for target, line in imports:
            tpkg = target.split(".")[0]
            if LAYER[tpkg] > LAYER[pkg]:
                bad.append(f"{name}:{line} imports {target} (a later package)")
            if tpkg != pkg and any(part.startswith("_") for part in target.split(".")[1:]):
                bad.append(f"{name}:{line} imports {target} (private to {tpkg})")
    assert not bad, "\n".join(bad)


# The engine and its host scheduler, and the modules each is made of.
ENGINE_MODULES = ("engine", "options", "checks", "pool", "handles")
SCHEDULER_MODULES = ("scheduler", "pages", "launches", "calls", "outputs", "warmup", "requests")


@pytest.mark.parametrize("module", ENGINE_MODULES + SCHEDULER_MODULES)
def test_the_engine_imports_no_kernel(module):
    """The engine schedules; the MLA layer decides how attention reads the cache (it imported the kernels'
    limits and the private Hopper check before). The same holds for each module the engine and its
    scheduler are made of, so a limit cannot come back through one of them."""
    name = f"models.serving.{module}"
    assert name in GRAPH, f"{name} is gone: update ENGINE_MODULES / SCHEDULER_MODULES"
    assert not [t for t, _ in GRAPH[name] if t.startswith("pallas_kernels")]


def test_no_import_circle():
    """A strongly connected component of more than one module is an import circle (models.deepseek and
    models.mtp formed one, held open by a function-local import)."""
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w, _ in GRAPH.get(v, ()):
            if w not in GRAPH:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_kernel_files_stay_small():
    """A kernel is a package of small files (mla_decode was one file of 1 541 lines)."""
    sizes = {n: sum(1 for _ in open(p)) for n, p in MODULES.items() if n.startswith("pallas_kernels")}
    assert {n: s for n, s in sizes.items() if s > 600} == {}


MAX_MODULE_LINES = 650  # a module outside `pallas_kernels/` (whose files stay under 600, above)
MAX_CLASS_LINES = 300  # a class a reader can hold in mind (DESIGN.md)


def test_modules_outside_the_kernels_stay_under_650_lines():
    """No module of `mla_jax`, `models` or `benchmarks` past `MAX_MODULE_LINES` (the host scheduler's module was
    839 lines, the engine's 743; moe, checkpoint, attention and capacity 673-705)."""
    sizes = {n: sum(1 for _ in open(p)) for n, p in MODULES.items() if not n.startswith("pallas_kernels")}
    long = {n: s for n, s in sizes.items() if s > MAX_MODULE_LINES}
    assert not long, long


def test_classes_stay_under_300_lines():
    """No class of the four packages past `MAX_CLASS_LINES`, from its first decorator to its last line (the host
    scheduler `_Generation` was 753 lines, `Engine` 508, `ModelConfig` 466)."""
    long = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ClassDef):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if node.end_lineno - first + 1 > MAX_CLASS_LINES:
                    long[f"{name}.{node.name}"] = node.end_lineno - first + 1
    assert not long, long


def _choices(parser: argparse.ArgumentParser, flag: str) -> tuple:
    action = next(a for a in parser._actions if flag in a.option_strings)
    return tuple(action.choices)


@pytest.mark.parametrize(
    "parser,flag,names",
    [
        pytest.param("models.serving.cli:_build_parser", "--attention-impl", CACHE_IMPLS, id="generate-attention"),
        pytest.param("models.serving.cli:_build_parser", "--kv-dtype", ("auto", *PAGE_FORMATS), id="generate-pages"),
        pytest.param("models.training.cli:build_parser", "--attn-impl", DECOMPRESSED_IMPLS, id="train-attention"),
        pytest.param("models.training.cli:build_parser", "--moe-impl", MOE_TRAINING_IMPLS, id="train-moe"),
        pytest.param("benchmarks.bench_train:parser", "--attn-impl", DECOMPRESSED_IMPLS, id="bench-train-attention"),
        pytest.param("benchmarks.bench_train:parser", "--moe-impl", MOE_TRAINING_IMPLS, id="bench-train-moe"),
        pytest.param("mla_jax.capacity:_build_parser", "--kv-dtype", PAGE_FORMATS, id="capacity-pages"),
        pytest.param("benchmarks.bench_e2e:parser", "--kv-dtype", PAGE_FORMATS, id="bench-e2e-pages"),
    ],
)
def test_command_lines_offer_the_one_tuple_of_each_choice(parser, flag, names):
    """Each implementation axis has one tuple, defined beside its code, and the command lines take their
    choices from it (mla-generate kept a literal copy of the engine's list; mla-train a copy of the
    attention's; the capacity planner a table of its own)."""
    module, _, fn = parser.partition(":")
    built = getattr(__import__(module, fromlist=[fn]), fn)()
    assert _choices(built, flag) == names


def test_one_vocabulary_for_which_implementation():
    """The kernels, the cache and the engine spell "auto" the same way (None at the kernels, "auto" above
    them before), and the MoE's training names are its own names less the forward-only kernel."""
    assert backend.IMPLS == CACHE_IMPLS == ("auto", "kernel", "interpret", "reference")
    assert backend.resolve(None) == backend.resolve("auto")
    assert set(MOE_IMPLS) - set(MOE_TRAINING_IMPLS) == {"decode"}
    assert DECOMPRESSED_IMPLS[0] == "auto"
