"""The README runs as written: every ```python block executes on its own (a fresh namespace, on CPU), and
the README's test command is what CI runs."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(lang, text=README):
    return [c.strip() for c in re.findall(rf"```{lang}\n(.*?)```", text, re.S)]


def _commands(text):
    return _blocks("bash", text)


def test_ci_runs_the_readme_test_command():
    readme = _commands(README)
    assert len(readme) >= 2, readme
    test_cmd = next(c for c in readme if "pytest" in c)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci.splitlines(), (test_cmd, ci)


def _section(title: str) -> str:
    """The README's section that starts with `## title` (up to the next `## `), or '' when there is none."""
    m = re.search(rf"^## {re.escape(title)}.*?(?=^## |\Z)", README, re.S | re.M)
    return m.group(0) if m else ""


def test_readme_answers_what_a_newcomer_asked():
    """What a newcomer on a fresh clone could not find: a GPU quick start, a walk-through for serving a released
    DeepSeek checkpoint (where it comes from, memory, mesh, FP8 weights), how long the default training run takes,
    how to extend a finished run, and what MTP measurably does. Catches any of them dropped from the README."""
    gpu = _section("On a Hopper GPU")
    assert '".[cuda]"' in gpu and "pytest -m gpu" in gpu, gpu
    walk = _section("Serving a real DeepSeek checkpoint")
    for needle in ("deepseek-ai/", "mla-capacity", 'weights="fp8"', "mesh", 'kv_dtype="fp8"'):
        assert needle in walk, needle
    tools = _section("Command-line tools")
    assert re.search(r"800 steps, ~10 min on 2 CPU cores", tools) and "--resume --steps" in tools
    main_job = _section("Two commands")
    assert re.search(r"[\d ]+ tok/s against [\d ]+ without `--mtp`", main_job), main_job[:600]


def test_python_version_file_selects_312():
    assert (ROOT / ".python-version").read_text().strip() == "3.12"


def test_readme_has_python_blocks():
    assert len(_blocks("python")) >= 3


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_readme_python_block_runs(index, capsys):
    """Guards: a snippet that needs a name it never defines or imports (each block runs alone), or that
    calls an API the code no longer has."""
    code = _blocks("python")[index]
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": f"readme_block_{index}"})
