"""`mla-bench mla_decode --peers DIR` on a CPU: stub peer modules (numpy, no torch, no GPU) written to a
temporary bundle, a numpy bridge with fixed times, and the benchmark's own cell generator, reference,
peer columns and report (CSV + table)."""

import csv
import functools
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import bench_mla_decode as bench
from benchmarks import mla_decode_report, peers

ROOT = pathlib.Path(__file__).resolve().parent.parent

# numpy attention over one request's pages, shared by both stubs (the stubs' own code, no torch)
_ATTEND = """
import numpy as np

def _attend(q_hd, pages_pkd, n, scale, dv):
    kv = np.asarray(pages_pkd, np.float32).reshape(-1, pages_pkd.shape[-1])[:n]
    s = np.asarray(q_hd, np.float32) @ kv.T * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ kv[:, :dv]
"""

_FLASH_MLA = (
    _ATTEND
    + """
__version__ = "stub"
OFFSET = {offset}

def get_mla_metadata(*args, **kwargs):
    return {{"calls": 0}}, None

def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, sched, softmax_scale=None,
                           causal=False):
    sched["calls"] += 1
    B, s_q, H, _ = q.shape
    kc = np.asarray(k_cache, np.float32)[:, :, 0]
    out = np.zeros((B, s_q, H, head_dim_v), np.float32)
    for b in range(B):
        for t in range(s_q):
            n = int(cache_seqlens[b]) - ((s_q - 1 - t) if causal else 0)
            out[b, t] = _attend(q[b, t], kc[np.asarray(block_table[b])], n, softmax_scale, head_dim_v)
    return out + OFFSET, None
"""
)

_VLLM = (
    _ATTEND
    + """
def decode_attention_fwd(q, k_buffer, v_buffer, o, lse, req_to_token, b_seq_len, attn_logits, num_kv_splits,
                         sm_scale, page_size=1):
    assert attn_logits.shape[2] == num_kv_splits and page_size == 64 and v_buffer.shape[-1] == 512
    kc = np.asarray(k_buffer, np.float32)[:, :, 0]
    for r in range(q.shape[0]):
        o[r] = _attend(q[r], kc[np.asarray(req_to_token[r])], int(b_seq_len[r]), sm_scale, o.shape[-1])
"""
)


def write_bundle(root, *, fmla_offset=0.0, fmla_builds=None):
    """A stub bundle: flashmla/flash_mla (importable, or, with ``fmla_builds`` = setup.py text, failing to
    import until built) and vllm_triton_mla.py."""
    pkg = root / "flashmla" / "flash_mla"
    pkg.mkdir(parents=True)
    if fmla_builds is None:
        (pkg / "__init__.py").write_text(_FLASH_MLA.format(offset=fmla_offset))
    else:
        (pkg / "__init__.py").write_text("raise ImportError('flash_mla.cuda is not built')\n")
        (root / "flashmla" / "setup.py").write_text(fmla_builds)
    (root / "vllm_triton_mla.py").write_text(_VLLM)
    return root


class NumpyBridge(peers.Bridge):
    """Host numpy arrays; fixed kernel times per peer (and the event loop twice that); records what it timed."""

    name = "numpy (test)"

    def __init__(self, us):
        self.us, self.timed = us, []

    def from_jax(self, x):
        return np.asarray(x)

    def from_numpy(self, a):
        return np.array(a)

    def empty(self, shape, dtype):
        return np.zeros(shape, np.float32)

    def to_numpy(self, y):
        return np.asarray(y, np.float32)

    def kernel_sum_us(self, fn, iterations, peer):
        self.timed.append(peer)
        fn()
        return self.us[peer], "fixed (test bridge)"

    def event_us(self, fn, peer):
        return 2 * self.us[peer]


@functools.lru_cache(maxsize=None)
def xla_reference():
    import jax

    return jax.jit(bench.xla_absorbed, static_argnames="causal")


@pytest.fixture(scope="module")
def cell():
    """B=3, s_q=2 (causal), lengths uniform in [60, 130] (2 pages at most: 120, 105, 96), H=16, and the
    benchmark's XLA reference."""
    spec = (3, 2, 130, 16, (60, 130))
    q, kv, table, lens, total = bench.make_cell(*spec, group_pages=True)
    ref, _ = xla_reference()(q, kv, table, lens, causal=True)
    return spec, (q, kv, table, lens), np.asarray(ref, np.float32)


def project_row(spec, us=10.0):
    B, s_q, seq, H, ragged = spec
    return dict(
        B=B,
        s_q=s_q,
        seq=seq,
        H=H,
        lengths=bench.lengths_name(ragged),
        causal=True,
        gbytes=1e-3,
        gflop=1e-2,
        config="default",
        schedule="per_sequence",
        splits=1,
        row_blocks=1,
        us=us,
    )


def run_cell(tmp_path, bundle, cell, monkeypatch):
    """One cell through the peers and the benchmark's report (the roofline plot left out); the CSV row."""
    monkeypatch.setattr(mla_decode_report, "plot_roofline", lambda *a, **k: None)
    spec, arrays, ref = cell
    cols = bundle.measure(*arrays, causal=True, scale=bench.SCALE, ref=ref)
    row = project_row(spec)
    bench.attach_peers(row, cols, bundle)
    bench.report(
        [row], dict(bandwidth_gbps=4000.0, matmul_tflops=800.0), dict(device="CPU (test)", jax="x"), str(tmp_path)
    )
    with open(tmp_path / "mla_decode.csv", newline="") as f:
        return list(csv.DictReader(f))[0]


def test_missing_peer_dir_is_a_one_line_error(tmp_path):
    """`--peers` naming no directory must fail at once, in one line, with a non-zero status (not a traceback
    after minutes of JAX warm-up, nor a run that silently drops the peers)."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "mla_decode", "--peers", str(tmp_path / "nope")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "--peers" in out.stderr and "no such directory" in out.stderr


def test_peer_columns_and_ratio_are_ours_over_theirs(tmp_path, cell, monkeypatch):
    """The CSV gets each peer's time, method and check, and ours_over_<peer> = our µs / the peer's µs (an
    inverted ratio, or peer columns lost on the way to the CSV, fail here); each Triton split is checked and
    timed, and the fastest correct one kept."""
    bridge = NumpyBridge({"fmla": 40.0, "triton": 80.0})
    bundle = peers.open_bundle(str(write_bundle(tmp_path / "bundle")), str(tmp_path), bridge=bridge, splits=(4, 8))
    row = run_cell(tmp_path, bundle, cell, monkeypatch)
    assert float(row["fmla_us"]) == 40.0 and float(row["triton_us"]) == 80.0
    assert float(row["ours_over_fmla"]) == pytest.approx(10.0 / 40.0)
    assert float(row["ours_over_triton"]) == pytest.approx(10.0 / 80.0)
    assert row["fmla_status"] == row["triton_status"] == "ok"
    assert row["fmla_method"] == "fixed (test bridge)" and float(row["fmla_event_us"]) == 80.0
    assert row["triton_variant"] in ("splits=4", "splits=8")
    assert float(row["fmla_rel_err"]) < 1e-2 and float(row["triton_rel_err"]) < 1e-2
    assert sorted(bridge.timed) == ["fmla", "triton", "triton"]  # each correct split timed, then the best kept


def test_a_peer_that_disagrees_is_marked_not_timed(tmp_path, cell, capsys, monkeypatch):
    """A peer whose output is off must be reported as disagreeing, with no time and no ratio, and never
    reach the timer; the other peer is still timed."""
    bridge = NumpyBridge({"fmla": 40.0, "triton": 80.0})
    bundle = peers.open_bundle(
        str(write_bundle(tmp_path / "bundle", fmla_offset=0.5)), str(tmp_path), bridge=bridge, splits=(4,)
    )
    row = run_cell(tmp_path, bundle, cell, monkeypatch)
    assert row["fmla_status"] == "disagrees" and "not timed" in row["fmla_note"]
    assert row.get("fmla_us", "") == "" and row.get("ours_over_fmla", "") == ""
    assert bridge.timed == ["triton"] and float(row["ours_over_triton"]) == pytest.approx(0.125)
    assert "WRONG" in capsys.readouterr().out


def test_triton_peer_on_int32_page_groups(tmp_path, cell, monkeypatch):
    """With a cache beyond vLLM's int32 offsets, the table is permuted within page groups and the Triton
    peer runs one call per group on its slice of the cache (wrong group offsets: a wrong output here). The
    limit is shrunk so that 3 two-page sequences make 2 groups."""
    spec, _, _ = cell
    monkeypatch.setattr(peers, "page_groups", functools.partial(peers.page_groups, limit=2 * 2 * 64 * 576))
    q, kv, table, lens, _ = bench.make_cell(*spec, group_pages=True)
    t = np.asarray(table)
    assert t.shape == (3, 2) and peers.page_groups(3, 2) == [(0, 2, 0, 4), (2, 3, 4, 6)]
    assert sorted(t[:2].ravel()) == [0, 1, 2, 3] and sorted(t[2]) == [4, 5]
    ref, _ = xla_reference()(q, kv, table, lens, causal=True)
    bundle = peers.open_bundle(
        str(write_bundle(tmp_path / "bundle")),
        str(tmp_path),
        bridge=NumpyBridge({"fmla": 1.0, "triton": 2.0}),
        splits=(4,),
    )
    cols = bundle.measure(q, kv, table, lens, causal=True, scale=bench.SCALE, ref=np.asarray(ref, np.float32))
    assert cols["triton_status"] == "ok" and cols["fmla_status"] == "ok", cols


def test_flashmla_build_failure_is_one_line_naming_the_peer(tmp_path, cell, monkeypatch):
    """flash_mla that does not import is built in place (setup.py build_ext --inplace, log in the output
    dir); a failed build leaves FlashMLA marked unavailable with one line (the log's error), and the other
    peer still timed — not a traceback that ends the benchmark."""
    setup = "import sys\nprint('compiling')\nprint('error: nvcc fatal: stub')\nsys.exit(1)\n"
    bundle = peers.open_bundle(
        str(write_bundle(tmp_path / "bundle", fmla_builds=setup)),
        str(tmp_path),
        bridge=NumpyBridge({"fmla": 1.0, "triton": 2.0}),
        splits=(4,),
    )
    row = run_cell(tmp_path, bundle, cell, monkeypatch)
    assert row["fmla_status"] == "unavailable" and row["triton_status"] == "ok"
    note = row["fmla_note"]
    assert note.startswith("FlashMLA unavailable: build failed (rc 1") and "nvcc fatal: stub" in note
    assert "\n" not in note and (tmp_path / peers.BUILD_LOG).exists()


def test_flashmla_still_building_is_measured_late(tmp_path, cell, monkeypatch):
    """While FlashMLA builds in the background the cells go on without it ("pending"), and once the build is
    over `late_peers` measures it on the regenerated cell and fills the rows (a pending peer left blank in the
    CSV, or a stale "waiting" note, fail here). The stub build writes the package in place after a second."""
    spec, arrays, ref = cell
    stub = _FLASH_MLA.format(offset=0.0)
    setup = f"import time, pathlib\ntime.sleep(1.0)\npathlib.Path('flash_mla/__init__.py').write_text({stub!r})\n"
    bundle = peers.open_bundle(
        str(write_bundle(tmp_path / "bundle", fmla_builds=setup)),
        str(tmp_path),
        bridge=NumpyBridge({"fmla": 40.0, "triton": 80.0}),
        splits=(4,),
    )
    cols = bundle.measure(*arrays, causal=True, scale=bench.SCALE, ref=ref, wait=False)
    assert cols["fmla_status"] == "pending" and cols["triton_status"] == "ok"
    row = project_row(spec)
    bench.attach_peers(row, cols, bundle)
    assert "ours_over_fmla" not in row
    bench.late_peers([spec], {spec: cols}, {spec: [row]}, bundle, xla_reference())
    assert row["fmla_status"] == "ok" and row["ours_over_fmla"] == pytest.approx(0.25), row
    assert "fmla_note" not in row and row["ours_over_triton"] == pytest.approx(0.125)


def test_no_torch_marks_both_peers_unavailable(tmp_path, monkeypatch):
    """Without torch (the default bridge's framework) each peer is unavailable with a one-line reason naming
    it, instead of an ImportError."""
    monkeypatch.setitem(sys.modules, "torch", None)
    bundle = peers.open_bundle(str(write_bundle(tmp_path / "bundle")), str(tmp_path))
    whys = [p.why for p in bundle.peers]
    assert whys[0].startswith("FlashMLA unavailable: torch") and whys[1].startswith("vLLM Triton unavailable: torch")
    cols = bundle.measure(None, None, None, None, causal=False, scale=1.0, ref=None)
    assert cols["fmla_status"] == cols["triton_status"] == "unavailable"


def test_cell_list():
    """--cell-list: fixed, normal-ragged (N~) and uniform (lo-hi) lengths; a malformed cell is a ValueError
    naming it (main turns it into a one-line usage error)."""
    assert bench.parse_cell_list("128,1,8192,64; 128,1,256-16384,64;8,1,4096~,128") == [
        (128, 1, 8192, 64, False),
        (128, 1, 16384, 64, (256, 16384)),
        (8, 1, 4096, 128, True),
    ]
    with pytest.raises(ValueError, match="128,1,x,64"):
        bench.parse_cell_list("128,1,x,64")
