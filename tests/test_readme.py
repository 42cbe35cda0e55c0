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
