"""The README's test command is what CI runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _commands(text):
    return [c.strip() for c in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_ci_runs_the_readme_test_command():
    readme = _commands((ROOT / "README.md").read_text())
    assert len(readme) >= 2, readme
    test_cmd = next(c for c in readme if "pytest" in c)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci.splitlines(), (test_cmd, ci)


def test_python_version_file_selects_312():
    assert (ROOT / ".python-version").read_text().strip() == "3.12"
