"""`mla-generate` in-process: streams text and a stats line; errors are one line and exit status 2."""

import json
import os
import shutil

import pytest

from models.serving.cli import format_stats, main

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf_v3_tiny")


def test_no_arguments_streams_text_and_stats(capsys, monkeypatch):
    written = []
    real_write = __import__("sys").stdout.write

    def spy(text):  # records each write: the text must arrive in pieces, as it is generated
        written.append(text)
        return real_write(text)

    monkeypatch.setattr("sys.stdout.write", spy)
    assert main(["--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    lines = out.rstrip("\n").split("\n")
    stats = lines[-1]
    assert stats.startswith("[stats] prefill ") and " tok/s" in stats and "decode " in stats
    assert "MTP acceptance off" in stats and "pages used " in stats
    from models.builtin import BUILTIN_PROMPT

    assert out.startswith(BUILTIN_PROMPT)
    assert len(written) >= 3  # the prompt, then generated text in several writes, then the stats
    if "warning" in err:  # the built-in weights are not trained yet: the fallback says so
        assert "randomly initialised" in err


def test_the_timed_run_compiles_nothing(capsys, monkeypatch):
    """Guards the stats line of every plain run: the warm-up generated 2 tokens, so it compiled only a 1-step
    decode call, and the timed run compiled its 8-step and 4-step calls inside the clock, charged to prefill
    and decode (prefill 21 tok/s and decode 42 where the steps run at ~1 900 and ~330). The warm-up compiles
    what the timed run (the second `generate`) takes: nothing compiles there."""
    from models.serving.engine import Engine, trace_counts

    compiled, real = [], Engine.generate

    def counting(self, *a, **k):
        before = sum(trace_counts().values())
        try:
            return real(self, *a, **k)
        finally:
            compiled.append(sum(trace_counts().values()) - before)

    monkeypatch.setattr(Engine, "generate", counting)
    assert main(["--max-new-tokens", "20"]) == 0  # 19 decode tokens: calls of 8, 8 and 3 (a 4-step loop)
    assert len(compiled) == 2 and compiled[1] == 0, compiled
    stats = capsys.readouterr().out.rstrip("\n").split("\n")[-1]
    assert "(19 tokens, 19 steps)" in stats, stats


def test_prompt_sampling_and_mtp(capsys):
    assert (
        main(
            [
                "--prompt",
                "Hello",
                "--max-new-tokens",
                "5",
                "--temperature",
                "0.8",
                "--top-p",
                "0.9",
                "--top-k",
                "50",
                "--min-p",
                "0.01",
                "--seed",
                "3",
                "--mtp",
            ]
        )
        == 0
    )
    out, _ = capsys.readouterr()
    assert out.startswith("Hello")
    assert "MTP acceptance " in out and "MTP acceptance off" not in out


def test_hf_checkpoint_with_tokenizer_json(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    for name in os.listdir(FIXTURE):
        if name.endswith((".json", ".safetensors")):
            shutil.copy(os.path.join(FIXTURE, name), tmp_path / name)
    vocab = json.load(open(os.path.join(FIXTURE, "config.json")))["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert (
        main(
            [
                "--checkpoint",
                str(tmp_path),
                "--prompt",
                "w5 w9 w17",
                "--max-new-tokens",
                "4",
                "--mtp",
                "--mtp-draft-tokens",
                "2",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert out.startswith("w5 w9 w17") and "[stats] prefill" in out and "warning" not in err


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--checkpoint", "no/such/dir"], "no such directory"),
        ([f"--checkpoint={FIXTURE}"], "no tokenizer"),  # the fixture has weights but no tokenizer.json
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--top-p", "0"], "--top-p must be in"),
        (["--top-k", "-2"], "--top-k must be >= 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--mtp", "--mtp-draft-tokens", "5"], "--mtp-draft-tokens must be in [1, 3]"),
        (["--dtype", "int8"], "invalid choice"),
        (["--bogus"], "unrecognized arguments"),
        (
            ["--num-processes", "2", "--process-id", "0"],
            "--num-processes 2 and --process-id 0: several processes need "
            "--coordinator HOST:PORT (or $MLA_JAX_COORDINATOR)",
        ),
        (
            ["--coordinator", "h:1", "--num-processes", "two", "--process-id", "0"],
            "--num-processes two: must be an integer >= 1",
        ),
        (["--coordinator", "h:port"], "--coordinator h:port: not HOST:PORT"),
    ],
)
def test_errors_are_one_line_exit_2(argv, match, capsys, monkeypatch):
    for var in ("MLA_JAX_COORDINATOR", "MLA_JAX_NUM_PROCESSES", "MLA_JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    lines = [ln for ln in err.strip().split("\n") if not ln.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith("mla-generate: error: ") and match in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--mtp-draft-tokens", "2"], "mla-generate: error: --mtp-draft-tokens 2 drafts with the MTP head: add --mtp"),
        (["--decode-steps", "0"], "mla-generate: error: --decode-steps must be >= 1, got 0"),
        (["--memory-fraction", "1.5"], "mla-generate: error: --memory-fraction must be a number in (0, 1], got 1.5"),
    ],
)
def test_flags_are_handled_evenly(argv, line, capsys):
    """Guards: `--mtp-draft-tokens 2` without `--mtp` was ignored without a word (while 4 was refused), and
    `--decode-steps 0` was refused naming the Python parameter (`Engine decode_steps must be ...`), not the flag."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err == line + "\n"


def test_a_stop_at_the_end_of_text_token_is_said(capsys):
    """Guards: a run that ended at the end-of-text token said nothing (only a stop at the context limit was
    said), so 130 tokens of 200 asked for looked like a cut. The built-in story ends after 130 new tokens."""
    assert main(["--max-new-tokens", "200"]) == 0
    out, err = capsys.readouterr()
    assert "(129 tokens, 129 steps)" in out.rstrip("\n").split("\n")[-1]
    assert err.endswith("mla-generate: note: stopped after 130 of 200 new tokens at the end-of-text token (257)\n")


def test_format_stats():
    line = format_stats(
        dict(
            prefill_tok_s=10.0,
            prefill_tokens=5,
            decode_tok_s=2.5,
            decode_tokens=8,
            decode_steps=5,
            mtp_acceptance=0.75,
            mtp_accepted=3,
            mtp_drafted=4,
            pages_used_peak=2,
            pages_total=9,
            compile_s=1.25,
        )
    )
    assert line == (
        "[stats] prefill 10.0 tok/s (5 tokens) | decode 2.5 tok/s (8 tokens, 5 steps) | "
        "MTP acceptance 75.0% (3/4) | pages used 2/9 | compile 1.2 s"
    )


def test_kv_dtype_fp8_generates(capsys):
    """--kv-dtype fp8: the built-in model (latent 512 + 64) generates through fp8 pages (a model whose
    latent fp8 pages cannot hold: tests/test_bad_inputs.py)."""
    assert main(["--kv-dtype", "fp8", "--max-new-tokens", "4", "--no-warmup"]) == 0
    out, _ = capsys.readouterr()
    assert "[stats] prefill " in out


def test_distributed_flags_and_environment(capsys, monkeypatch):
    """`mla-generate --coordinator/--num-processes/--process-id` (else $MLA_JAX_*) call
    `jax.distributed.initialize` with them before anything else is checked, and a bad environment is
    named as such (guards: the flags ignored, the variables ignored, an error that names a flag the
    user never typed)."""
    calls = []
    monkeypatch.setattr("jax.distributed.initialize", lambda **kw: calls.append(kw))
    monkeypatch.setenv("MLA_JAX_COORDINATOR", "127.0.0.1:5555")
    monkeypatch.setenv("MLA_JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("MLA_JAX_PROCESS_ID", "1")
    with pytest.raises(SystemExit):
        main(["--max-new-tokens", "0"])  # fails after the call, before anything else
    assert calls == [dict(coordinator_address="127.0.0.1:5555", num_processes=2, process_id=1)]
    monkeypatch.setenv("MLA_JAX_PROCESS_ID", "5")
    with pytest.raises(SystemExit):
        main(["--max-new-tokens", "0"])
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        "mla-generate: error: MLA_JAX_PROCESS_ID=5: must be an integer in [0, 2) (MLA_JAX_NUM_PROCESSES=2)"
    ), err
    assert len(calls) == 1


def _interrupt_the_stream(monkeypatch):
    """Ctrl-C after the third generated token (the KeyboardInterrupt Python raises for SIGINT)."""
    from models.serving import cli as generate_cli

    real = generate_cli._TextStream.__call__

    def call(self, request, token):
        real(self, request, token)
        if len(self.ids) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(generate_cli._TextStream, "__call__", call)


def _interrupt_the_load(monkeypatch):
    """Ctrl-C while the model loads, before anything is printed."""

    def load(args):
        raise KeyboardInterrupt

    monkeypatch.setattr("models.serving.cli._load", load)


@pytest.mark.parametrize(
    "interrupt, printed",
    [
        pytest.param(_interrupt_the_stream, True, id="mid-stream-20-line-KeyboardInterrupt-traceback"),
        pytest.param(_interrupt_the_load, False, id="while-loading-traceback"),
    ],
)
def test_ctrl_c_ends_the_text_in_one_line_exit_130(capsys, monkeypatch, interrupt, printed):
    """Ctrl-C in `mla-generate` printed a 20-line KeyboardInterrupt traceback. Now the text printed so far ends
    its line, then one line `mla-generate: interrupted` on stderr, exit status 130, no stats line."""
    interrupt(monkeypatch)
    try:
        main(["--prompt", "Once upon", "--max-new-tokens", "12", "--no-warmup"])
        code = 0
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:  # caught here: escaping, it would end the pytest run
        code = "KeyboardInterrupt escaped (its traceback on the console)"
    out, err = capsys.readouterr()
    assert code == 130, code
    assert [ln for ln in err.splitlines() if not ln.startswith("warning:")] == ["mla-generate: interrupted"], err
    if printed:  # the prompt and the three tokens, the line ended
        assert out.startswith("Once upon") and out.endswith("\n") and out.count("\n") == 1, repr(out)
        assert len(out) > len("Once upon\n")
    else:
        assert out == ""
