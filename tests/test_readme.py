"""The README runs as written: every ```python block executes on its own (a fresh namespace, on CPU), and
the README's test command is what CI runs."""

import os
import pathlib
import re
import sys

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


def _is_usage(block: str) -> bool:
    """The Usage example: test_the_usage_example_prints_readable_lines runs it (and reads what it prints)."""
    return "handle.finish_reason" in block


@pytest.mark.parametrize("index", [i for i, b in enumerate(_blocks("python")) if not _is_usage(b)])
def test_readme_python_block_runs(index, capsys):
    """Guards: a snippet that needs a name it never defines or imports (each block runs alone), or that
    calls an API the code no longer has. (The Usage example runs once, in the test below, which checks its
    output too: running it here as well doubled the module's time.)"""
    code = _blocks("python")[index]
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": f"readme_block_{index}"})


def _claim(pattern: str) -> tuple[str, ...]:
    """The groups of `pattern` in the README (a claim it makes), which must be there."""
    m = re.search(pattern, README)
    assert m, f"the README no longer says {pattern!r}"
    return m.groups()


def test_the_builtin_model_and_corpus_are_as_the_readme_says():
    """Guards the README's figures of what ships against a retrained model or an edited corpus that leave them
    stale: the built-in model's file size and parameter count (in its section and in the Usage example) and the
    corpus's size."""
    import jax
    from flax import nnx

    from models import load_hf_checkpoint
    from models.builtin import BUILTIN_DIR
    from models.data import CORPUS_PATH

    mb, millions = _claim(r"`models/builtin/` \(HF layout, ([\d.]+) MB, ([\d.]+) M parameters")
    assert f"{os.path.getsize(os.path.join(BUILTIN_DIR, 'model.safetensors')) / 1e6:.1f}" == mb
    params = sum(x.size for x in jax.tree.leaves(nnx.state(load_hf_checkpoint(BUILTIN_DIR), nnx.Param)))
    assert f"{params / 1e6:.2f}" == millions == _claim(r"the built-in ([\d.]+)M-parameter model")[0]
    (kb,) = _claim(r"The corpus \((\d+) KB of simple English stories\)")
    assert f"{os.path.getsize(CORPUS_PATH) / 1e3:.0f}" == kb


@pytest.mark.full("the MTP acceptance counts the README quotes; tests/test_engine.py holds MTP to plain greedy")
@pytest.mark.parametrize(
    "draft_tokens, pattern",
    [
        (1, r"accepted \*\*([\d.]+) %\*\* of drafts \((\d+)/(\d+)\) and needed (\d+) decode\s+steps instead of (\d+)"),
        (2, r"\(`--draft-tokens 2`\) ([\d.]+) % \((\d+)/(\d+)\), (\d+) steps"),
    ],
)
def test_mtp_acceptance_is_what_the_readme_quotes(draft_tokens, pattern):
    """Guards the README's MTP counts against the model, engine or sampler they measure: it said 491/528 and
    597/844 while `scripts/measure_mtp_acceptance.py` printed 488/525 and 592/838. The script's measurement,
    run here, gives the README's figures."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from measure_mtp_acceptance import measure
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    percent, accepted, drafted, steps, *plain = _claim(pattern)
    m = measure(draft_tokens=draft_tokens)
    assert (m["accepted"], m["drafted"], m["mtp_steps"]) == (int(accepted), int(drafted), int(steps)), m
    assert f"{100 * m['accepted'] / m['drafted']:.1f}" == percent and m["same"]
    if plain:  # the steps without MTP, quoted beside the one-draft figures
        assert m["plain_steps"] == int(plain[0])


def test_the_usage_example_prints_readable_lines(capsys):
    """Guards: the README's Usage example printed a raw `GenerationStats(...)` and ran its streamed text into
    the finish reason (`, there length`)."""
    (code,) = [b for b in _blocks("python") if _is_usage(b)]
    exec(compile(code, "README.md usage block", "exec"), {"__name__": "readme_usage"})
    out = capsys.readouterr().out
    assert "GenerationStats(" not in out and out.endswith("\nlength\n"), out
    assert re.search(r"^MTP acceptance \d+% \(\d+/\d+\)$", out, re.M), out


def test_the_checkpoint_walk_through_downloads_with_the_current_client():
    """Guards: the V2-Lite walk-through told `pip install -U "huggingface_hub[cli]"` then `huggingface-cli
    download`, a command the current client no longer installs; its command is `hf download`."""
    walk = _blocks("bash", _section("Serving a real DeepSeek checkpoint"))[0].splitlines()
    assert any(line.startswith("hf download deepseek-ai/") for line in walk), walk
    assert not any(line.startswith("huggingface-cli") for line in walk), walk


def test_test_log_writes_a_line_per_test_as_it_ends_once_under_xdist(tmp_path):
    """`pytest --test-log FILE` (the GPU suite's timing, `scripts/gpu_run.sh suite`): one line per test, with its
    outcome, in a parallel run too. Catches xdist's workers writing beside the controller (every line twice) and a
    failed setup (no call report) left out."""
    import subprocess

    (tmp_path / "test_a.py").write_text(
        "import pytest\n\n@pytest.fixture\ndef broken():\n    raise RuntimeError\n\n"
        "def test_ok():\n    pass\n\ndef test_no(broken):\n    pass\n\ndef test_fails():\n    assert False\n"
    )
    log = tmp_path / "log.txt"
    conftest = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conftest.py")
    (tmp_path / "conftest.py").write_text(open(conftest).read())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(conftest)), str(tmp_path)]))
    args = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "--test-log", str(log)]
    subprocess.run([*args, str(tmp_path / "test_a.py")], cwd=tmp_path, env=env, capture_output=True, timeout=120)
    lines = sorted(line.split()[2:] for line in log.read_text().splitlines())
    assert [(outcome, node.split("::")[-1]) for outcome, node in lines] == [
        ("failed", "test_fails"),
        ("failed", "test_no"),
        ("passed", "test_ok"),
    ]
