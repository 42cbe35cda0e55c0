"""The wheel is the product: built from a clean copy of the tree, it holds the four packages, the built-in
model and the training corpus, and nothing of scripts/, results/ or the tests; installed
where the checkout cannot be imported, its console scripts train and generate.

Guards: a data file the product reads but the wheel lacks (the corpus once lived in a top-level `data/`,
so `mla-train` with no arguments worked only in a checkout), scripts or measured results shipped in
a package, and an import that only resolves because the repository is on the path.

"Where the checkout cannot be imported": the wheel goes into a fresh `--target` directory, commands run
from an empty working directory with `python -S` (so no .pth file runs, in particular the editable
install's finder, which maps `models` and its subpackages to the repository) and with only that
directory and the interpreter's site-packages (jax, flax, ...) on PYTHONPATH.
"""

import hashlib
import json
import os
import pathlib
import shutil
import site
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"mla_jax", "pallas_kernels", "models", "benchmarks"}
pytestmark = pytest.mark.slow  # under a minute on 2 CPU cores, most of it compiling the train and decode steps


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the wheel's path, the --target directory it is installed in, the environment to run it in)."""
    d = tmp_path_factory.mktemp("wheel")
    # A copy without build leftovers: setuptools reuses a stale build/lib, which would ship deleted files.
    src = d / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "runs", "*.egg-info", "__pycache__", ".pytest_cache", "tests"
        ),
    )
    dist = d / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-q", "-w", str(dist)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = dist.glob("mla_jax-*.whl")
    target = d / "site"
    inst = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert inst.returncode == 0, inst.stderr
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=os.pathsep.join([str(target), *site.getsitepackages()]), JAX_PLATFORMS="cpu")
    cwd = d / "cwd"
    cwd.mkdir()
    return wheel, target, env, cwd


def _run(installed, *argv, timeout=300):
    _, target, env, cwd = installed
    return subprocess.run(
        [sys.executable, "-S", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_wheel_holds_the_product_only(installed):
    wheel = installed[0]
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops - {n for n in tops if n.endswith(".dist-info")} == PACKAGES, tops
    for n in names:
        assert "results/" not in n and "scripts/" not in n and "tests/" not in n, n
    for needed in (
        "models/data/corpus.txt",
        "models/data/README.md",
        "models/builtin/config.json",
        "models/builtin/model.safetensors",
        "models/builtin/byte_tokenizer.json",
    ):
        assert needed in names, needed
    with zipfile.ZipFile(wheel) as z:
        shipped = hashlib.sha256(z.read("models/data/corpus.txt")).hexdigest()
        scripts = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert shipped == hashlib.sha256((ROOT / "models" / "data" / "corpus.txt").read_bytes()).hexdigest()
    for cmd in ("mla-train", "mla-generate", "mla-capacity", "mla-bench"):
        assert f"{cmd} = " in scripts, scripts


def test_installed_packages_come_from_the_wheel(installed):
    target = installed[1]
    out = _run(
        installed,
        "-c",
        "import sys, mla_jax, models, models.data, models.builtin, models.training.loop, "
        "pallas_kernels, benchmarks\nfor m in sorted(sys.modules):\n"
        "    if m.split('.')[0] in ('mla_jax', 'models', 'pallas_kernels', 'benchmarks'):\n"
        "        print(sys.modules[m].__file__)",
    )
    assert out.returncode == 0, out.stderr
    files = out.stdout.split()
    assert files and all(f.startswith(str(target)) for f in files), files


def test_installed_mla_train_and_mla_generate_run(installed, tmp_path):
    from mla_jax import ModelConfig

    target = installed[1]
    run_dir = tmp_path / "run"
    # The smallest model with every part (a dense and a MoE layer, MTP): the test is about the installed
    # script finding its corpus and modules, not about the model (and a smaller one compiles sooner).
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            ModelConfig.tiny()
            .replace(
                num_hidden_layers=2,
                hidden_size=32,
                intermediate_size=48,
                moe_intermediate_size=16,
                num_attention_heads=2,
                q_lora_rank=16,
                kv_lora_rank=16,
                qk_nope_head_dim=8,
                qk_rope_head_dim=8,
                v_head_dim=8,
                n_routed_experts=4,
            )
            .to_hf_dict()
        )
    )
    train = _run(
        installed,
        str(target / "bin" / "mla-train"),
        "--out",
        str(run_dir),
        "--config",
        str(config),
        "--steps",
        "2",
        "--warmup",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--eval-windows",
        "2",
        "--no-progress",
    )
    assert train.returncode == 0, train.stderr
    summary = json.loads((run_dir / "export" / "training.json").read_text())
    assert summary["step"] == 2 and summary["args"]["corpus"] == os.path.join("models", "data", "corpus.txt")
    gen = _run(installed, str(target / "bin" / "mla-generate"), "--max-new-tokens", "4")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.strip() and "Traceback" not in gen.stderr
