"""Other projects' MLA decode kernels, timed beside ours: ``mla-bench mla_decode --peers DIR``.

DIR is a peer bundle kept outside the repository (never committed; on the GPU machine a copy in
``.peers/``):

* ``DIR/flashmla/`` — a FlashMLA source tree. Its python package ``flash_mla`` is imported from
  there; when that fails (the CUDA extension is not built yet) it is built in place, in a
  background process started before the JAX warm-up (``setup.py build_ext --inplace`` with
  ``MAX_JOBS``, ``TORCH_CUDA_ARCH_LIST=9.0``, ``NVCC_THREADS``; log ``flashmla_build_log.txt`` in
  the output directory). Called through its public API: ``get_mla_metadata()`` then
  ``flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, sched, softmax_scale=,
  causal=)``; the scheduler metadata is filled by the first call (the checked one), before timing.
* ``DIR/vllm_triton_mla.py`` — vLLM's Triton MLA decode, ``decode_attention_fwd(q, k_buffer,
  v_buffer, o, lse, req_to_token, b_seq_len, attn_logits, num_kv_splits, sm_scale, page_size=)``.
  s_q > 1 runs as B*s_q one-token requests (causal: each token its own length); ``num_kv_splits``
  is tried over ``--triton-splits`` and the split with the least kernel time among those whose
  output is right is kept (every split's time in ``triton_note``). Its kernel
  computes cache offsets in int32, so the benchmark (with ``--peers``) permutes each batch group's
  pages within a range of fewer than 2^31 cache elements (`page_groups`) and the peer gets one
  call per group on that slice of the cache: one group unless the cache exceeds 4 GiB.

Every peer sees the benchmark's own arrays (handed over by DLPack, no copy), is checked against the
benchmark's XLA reference before it is timed (a peer that disagrees is reported, not timed), and is
timed two ways: ``<key>_us``, the median over calls of the CUPTI kernel-time sum of one call — the
same recording `benchmarks.cupti_median_us` makes of ours (`benchmarks.cupti_call_us`: same
arguments every call, L2 not flushed) — and ``<key>_event_us``, CUDA events around back-to-back
calls (host launch gaps included). ``<key>_method`` names the method of ``<key>_us`` (CUPTI, or the
event loop where CUPTI failed); the benchmark's ratio ``ours_over_<key>`` = our ``us`` / ``<key>_us``.

A `Peer` adapter sees its arrays only through a `Bridge` (array hand-over, host copies, timing),
so the plumbing runs on a CPU with a stub bridge and stub peer modules (tests/test_bench_peers.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import signal
import statistics
import subprocess
import sys
import time

import jax
import numpy as np

import benchmarks as bm

PAGE = 64
D_QK, D_V = 576, 512
INT32_ELEMS = 2**31 - 1
BUILD_LOG = "flashmla_build_log.txt"


def page_groups(B: int, max_pages: int, limit: int = INT32_ELEMS):
    """[(row_lo, row_hi, page_lo, page_hi)]: batch groups whose pages (max_pages a sequence, laid out
    group after group) span fewer than ``limit`` cache elements, as even as possible; one group unless
    the cache is larger. A single sequence longer than ``limit`` elements still gets a group of its own."""
    per_seq = max_pages * PAGE * D_QK
    per = max(1, limit // per_seq)
    n = -(-B // per)
    per = -(-B // n)
    return [(r, min(B, r + per), r * max_pages, min(B, r + per) * max_pages) for r in range(0, B, per)]


# ------------------------------------------------------------------------------------------ bridges
class Bridge:
    """How peers see the benchmark's arrays and how their calls are timed (interface)."""

    name = "abstract"

    def from_jax(self, x):
        raise NotImplementedError

    def from_numpy(self, a):
        raise NotImplementedError

    def empty(self, shape, dtype: str):
        raise NotImplementedError

    def to_numpy(self, y):
        raise NotImplementedError

    def sync(self):
        pass

    def kernel_sum_us(self, fn, iterations: int, peer: str):
        """(µs, method): per-call kernel time of ``fn``."""
        raise NotImplementedError

    def event_us(self, fn, peer: str) -> float:
        raise NotImplementedError

    def release(self):
        pass

    def versions(self) -> dict:
        return {}


class TorchBridge(Bridge):
    """torch on the benchmark's GPU: DLPack hand-over, CUPTI kernel sums, CUDA-event loops."""

    name = "torch"

    def __init__(self):
        # a failure here makes both peers unavailable (see open_bundle)
        import torch  # noqa: PLC0415 (optional: the peers' runtime, not a dependency)

        if not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
        self.torch = torch

    def from_jax(self, x):
        jax.block_until_ready(x)
        return self.torch.utils.dlpack.from_dlpack(x)

    def from_numpy(self, a):
        return self.torch.from_numpy(a).to("cuda")

    def empty(self, shape, dtype):
        return self.torch.empty(tuple(shape), dtype=getattr(self.torch, dtype), device="cuda")

    def to_numpy(self, y):
        return y.float().cpu().numpy()

    def sync(self):
        self.torch.cuda.synchronize()

    def kernel_sum_us(self, fn, iterations, peer):
        try:
            us, kernels = bm.cupti_call_us(fn, sync=self.sync, iterations=iterations)
            return us, f"cupti_kernel_sum (median of {iterations} calls, {kernels} kernels a call)"
        except Exception as e:  # noqa: BLE001 - fall back to events, and say so
            return self.event_us(fn, peer), f"cuda_events_loop (CUPTI failed: {_short(e, 80)})"

    def event_us(self, fn, peer, target_ms=50.0, trials=5):
        torch = self.torch
        for _ in range(2):
            fn()
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        n = int(max(3, min(200, target_ms * 1e-3 / max(time.perf_counter() - t0, 1e-6))))
        ts = []
        for _ in range(trials):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(n):
                fn()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) / n)
        return statistics.median(ts) * 1e3

    def release(self):
        self.sync()
        self.torch.cuda.empty_cache()

    def versions(self):
        out = {"torch": self.torch.__version__, "torch_cuda": self.torch.version.cuda}
        try:
            import triton  # noqa: PLC0415 (optional: the Triton peer's, GPU only, not a dependency)

            out["triton"] = triton.__version__
        except Exception:  # noqa: BLE001
            pass
        return out


# -------------------------------------------------------------------------------------------- peers
@dataclasses.dataclass
class Inputs:
    """One cell's arrays as a peer sees them (bridged), plus host copies of the metadata."""

    q: object  # [B, s_q, H, 576]
    kv: object  # [N, 64, 576]
    table: object  # int32 [B, max_pages]
    lens: object  # int32 [B]
    table_np: object
    lens_np: object
    causal: bool
    scale: float


class Peer:
    """A peer adapter: ``start()`` and ``load()`` (a failure sets ``why``, one line naming the peer),
    then ``candidates(inputs, bridge)`` ->
    [(variant, fn)], fn() -> output [B, s_q, H, 512] in the bridge's array type."""

    key = "peer"
    label = "peer"

    def __init__(self, root):
        self.root = root
        self.module = None
        self.why = ""  # unavailable: the reason
        self.broken = ""  # a CUDA error earlier in the run: not called again

    def load(self):
        raise NotImplementedError

    def ready(self) -> bool:
        """Whether `load` would return at once (FlashMLA: its build is over)."""
        return True

    def candidates(self, x: Inputs, bridge: Bridge):
        raise NotImplementedError

    def version(self) -> str:
        return str(getattr(self.module, "__version__", "")) if self.module else ""


class FlashMLA(Peer):
    key, label = "fmla", "FlashMLA"

    def __init__(self, root, out_dir, *, build=True, build_timeout_s=480.0):
        super().__init__(root)
        self.src = os.path.join(root, "flashmla")
        self.log_path = os.path.join(out_dir, BUILD_LOG)
        self.build_timeout_s = build_timeout_s
        self.proc = None
        self.t_build = None
        self.build = build

    def _import(self):
        for name in [m for m in sys.modules if m == "flash_mla" or m.startswith("flash_mla.")]:
            del sys.modules[name]
        sys.path.insert(0, os.path.abspath(self.src))
        try:
            mod = importlib.import_module("flash_mla")
        finally:
            sys.path.remove(os.path.abspath(self.src))
        where = os.path.abspath(os.path.dirname(getattr(mod, "__file__", "") or ""))
        if not where.startswith(os.path.abspath(self.src)):
            raise ImportError(f"flash_mla came from {where}, not from {self.src}")
        for fn in ("get_mla_metadata", "flash_mla_with_kvcache"):
            if not hasattr(mod, fn):
                raise ImportError(f"flash_mla has no {fn}")
        return mod

    def start(self):
        """Imports flash_mla now if it is built; else starts the in-place build in the background."""
        if not os.path.isdir(self.src):
            self.why = f"FlashMLA unavailable: no {self.src} in the peer bundle"
            return
        try:
            self.module = self._import()
            return
        except Exception as e:  # noqa: BLE001 - typically flash_mla.cuda not built yet
            first = _short(e, 160)
        if not self.build:
            self.why = f"FlashMLA unavailable: flash_mla does not import from {self.src} ({first})"
            return
        jobs = os.environ.get("MAX_JOBS") or str(max(1, min(16, os.cpu_count() or 1)))
        env = dict(
            os.environ,
            MAX_JOBS=jobs,
            TORCH_CUDA_ARCH_LIST=os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"),
            NVCC_THREADS=os.environ.get("NVCC_THREADS", "4"),
        )
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        _say(
            f"# peers: FlashMLA does not import yet ({first}); building it in place in {self.src} in the "
            f"background (MAX_JOBS={jobs}, log {self.log_path})"
        )
        self.t_build = time.time()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "setup.py", "build_ext", "--inplace"],
                cwd=self.src,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                process_group=0,  # a process group of its own, for killpg
            )

    def load(self):
        if self.module is not None or self.why:
            return
        if self.proc is None:
            self.why = "FlashMLA unavailable: not started"
            return
        rc = self._wait()
        if rc != 0:
            how = f"rc {rc}" if isinstance(rc, int) else rc
            self.why = f"FlashMLA unavailable: build failed ({how}, log {self.log_path})" + _first_error(self.log_path)
            return
        try:
            self.module = self._import()
            _say(f"# peers: FlashMLA built in {time.time() - self.t_build:.0f} s and imported")
        except Exception as e:  # noqa: BLE001
            self.why = f"FlashMLA unavailable: built, but the import failed: {_short(e, 200)}"

    def _wait(self):
        deadline = self.t_build + self.build_timeout_s
        while True:
            try:
                return self.proc.wait(timeout=min(30.0, max(0.1, deadline - time.time())))
            except subprocess.TimeoutExpired:
                if time.time() >= deadline:
                    os.killpg(self.proc.pid, signal.SIGKILL)  # the build's own process group
                    self.proc.wait()
                    return f"timeout after {self.build_timeout_s:.0f} s"
                _say(f"# peers: waiting for the FlashMLA build ({time.time() - self.t_build:.0f} s so far)")

    def ready(self):
        return self.module is not None or bool(self.why) or self.proc is None or self.proc.poll() is not None

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the build's own process group
            self.proc.wait()

    def candidates(self, x, bridge):
        fm = self.module
        sched = fm.get_mla_metadata()[0]
        n = x.kv.shape[0]
        k_cache = x.kv.reshape(n, PAGE, 1, D_QK)

        def call():
            return fm.flash_mla_with_kvcache(
                x.q, k_cache, x.table, x.lens, D_V, sched, softmax_scale=x.scale, causal=x.causal
            )[0]

        return [("dense", call)]


class TritonMLA(Peer):
    key, label = "triton", "vLLM Triton"

    def __init__(self, root, splits=(4, 8, 16, 32)):
        super().__init__(root)
        self.path = os.path.join(root, "vllm_triton_mla.py")
        self.splits = tuple(splits)

    def start(self):
        if not os.path.isfile(self.path):
            self.why = f"vLLM Triton unavailable: no {self.path} in the peer bundle"
            return
        try:
            name = "mla_bench_peer_vllm_triton_mla"
            spec = importlib.util.spec_from_file_location(name, self.path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod  # as an import would (Triton's JIT reads its functions' source)
            try:
                spec.loader.exec_module(mod)
            except BaseException:
                del sys.modules[name]
                raise
            if not hasattr(mod, "decode_attention_fwd"):
                raise ImportError("no decode_attention_fwd")
            self.module = mod
        except Exception as e:  # noqa: BLE001
            self.why = f"vLLM Triton unavailable: {os.path.basename(self.path)} does not import ({_short(e, 200)})"

    def load(self):
        pass

    def version(self):
        try:
            import triton  # noqa: PLC0415 (optional: the Triton peer's, GPU only, not a dependency)

            return f"triton {triton.__version__}"
        except Exception:  # noqa: BLE001
            return ""

    def candidates(self, x, bridge):
        B, s_q, H, _ = x.q.shape
        n = x.kv.shape[0]
        rows = B * s_q
        table_np, lens_np = np.asarray(x.table_np), np.asarray(x.lens_np)
        groups = page_groups(B, table_np.shape[1])
        for r0, r1, p0, p1 in groups:
            t = table_np[r0:r1]
            if t.size and (t.min() < p0 or t.max() >= p1):
                raise RuntimeError("block table not grouped for int32 offsets (pages of a group outside its range)")
        # one request per query token; causal: token j of s_q sees len - (s_q - 1 - j) keys
        tok_table = np.repeat(table_np, s_q, axis=0)
        tok_lens = np.repeat(lens_np.astype(np.int64), s_q)
        if x.causal and s_q > 1:
            tok_lens = tok_lens - (s_q - 1 - np.tile(np.arange(s_q), B))
        tok_lens = tok_lens.astype(np.int32)
        q_tok = x.q.reshape(rows, H, D_QK)
        kv4 = x.kv.reshape(n, PAGE, 1, D_QK)
        out = bridge.empty((rows, H, D_V), "bfloat16")
        lse = bridge.empty((rows, H), "float32")
        parts = []
        for r0, r1, p0, p1 in groups:
            a, b = r0 * s_q, r1 * s_q
            k = kv4[p0:p1]
            parts.append(
                (
                    a,
                    b,
                    q_tok[a:b],
                    k,
                    k[..., :D_V],
                    bridge.from_numpy(np.ascontiguousarray(tok_table[a:b] - p0)),
                    bridge.from_numpy(np.ascontiguousarray(tok_lens[a:b])),
                    out[a:b],
                    lse[a:b],
                )
            )
        fwd = self.module.decode_attention_fwd
        cands = []
        for splits in self.splits:
            logits = bridge.empty((rows, H, splits, D_V + 1), "float32")

            def call(splits=splits, logits=logits):
                for a, b, qg, kg, vg, tg, lg, og, sg in parts:
                    fwd(qg, kg, vg, og, sg, tg, lg, logits[a:b], splits, x.scale, page_size=PAGE)
                return out.reshape(B, s_q, H, D_V)

            cands.append((f"splits={splits}", call))
        return cands


# ------------------------------------------------------------------------------------------- bundle
class Bundle:
    """The loaded peers of one run and the bridge they share."""

    def __init__(self, root, peers, bridge, tol=1e-2, iterations=30):
        self.root, self.peers, self.bridge = root, peers, bridge
        self.tol, self.iterations = tol, iterations

    def close(self):
        """Stops a FlashMLA build still running (the run ended before it was needed)."""
        for p in self.peers:
            stop = getattr(p, "stop", None)
            if stop:
                stop()

    def describe(self) -> dict:
        out = {
            "dir": os.path.basename(os.path.abspath(self.root)),
            "bridge": self.bridge.name if self.bridge else None,
            **(self.bridge.versions() if self.bridge else {}),
        }
        for p in self.peers:
            out[p.key] = p.why or f"loaded {p.version()}".strip()
        return out

    def ready(self) -> bool:
        return all(p.ready() for p in self.peers)

    def measure(self, q, kv, table, lens, *, causal, scale, ref, wait=True, only=None):
        """Columns for one cell: per peer ``<key>_us/_method/_event_us/_rel_err/_variant/_status/_note``.

        ``ref``: the benchmark's reference output as a float32 numpy array (None: nothing to check
        against, so nothing is timed). ``wait`` False: a peer still building is left "pending" (the
        caller measures it later, ``only=[its key]``)."""
        cols = {}
        peers = [p for p in self.peers if only is None or p.key in only]
        for p in peers:
            if not wait and not p.ready():
                cols.update({f"{p.key}_status": "pending", f"{p.key}_note": "waiting for its build"})
            else:
                p.load()
        live = [p for p in peers if not p.why and not p.broken and f"{p.key}_status" not in cols]
        x = None
        if live and ref is not None:
            br = self.bridge
            x = Inputs(
                q=br.from_jax(q),
                kv=br.from_jax(kv),
                table=br.from_jax(table),
                lens=br.from_jax(lens),
                table_np=np.asarray(table),
                lens_np=np.asarray(lens),
                causal=causal,
                scale=scale,
            )
        for p in peers:
            k = p.key
            if f"{k}_status" in cols:
                continue
            if p.why:
                cols.update({f"{k}_status": "unavailable", f"{k}_note": p.why})
                continue
            if p.broken:
                cols.update({f"{k}_status": "failed", f"{k}_note": f"not run: {p.broken}"})
                continue
            if ref is None:
                cols.update({f"{k}_status": "no reference", f"{k}_note": "not timed: the XLA reference failed"})
                continue
            cols.update(self._measure_peer(p, x, ref))
        del x
        if self.bridge is not None:
            self.bridge.release()
        return cols

    def _measure_peer(self, p, x, ref):
        k, br = p.key, self.bridge
        try:
            cands = p.candidates(x, br)
        except Exception as e:  # noqa: BLE001
            return self._failed(p, f"setup failed: {_short(e)}", e)
        timed, wrong = [], []
        for variant, fn in cands:
            try:
                got = br.to_numpy(fn())  # the check, before any timing (and any compile)
                br.sync()
                err = rel_err(np.asarray(got, np.float32).reshape(ref.shape), ref)
                del got
                if not err < self.tol:
                    wrong.append((variant, err))
                    continue
                us, method = br.kernel_sum_us(fn, self.iterations, k)
                timed.append((us, method, variant, fn, err))
            except Exception as e:  # noqa: BLE001
                return self._failed(p, f"{variant}: run failed: {_short(e)}", e)
        if not timed:
            worst = ", ".join(f"{v} rel_err {e:.3g}" for v, e in wrong)
            return {
                f"{k}_status": "disagrees",
                f"{k}_rel_err": min(e for _, e in wrong),
                f"{k}_note": f"output disagrees with the reference ({worst}; tol {self.tol:g}): not timed",
            }
        us, method, variant, fn, err = min(timed, key=lambda t: t[0])  # fastest correct variant
        try:
            event_us = br.event_us(fn, k)
        except Exception as e:  # noqa: BLE001
            return self._failed(p, f"{variant}: timing failed: {_short(e)}", e)
        cols = {
            f"{k}_us": us,
            f"{k}_method": method,
            f"{k}_event_us": event_us,
            f"{k}_rel_err": err,
            f"{k}_variant": variant,
            f"{k}_status": "ok",
        }
        notes = []
        if len(timed) > 1:
            notes.append("variants (µs): " + " ".join(f"{v}={t:.1f}" for t, _, v, _, _ in timed))
        if wrong:
            notes.append("disagree, not timed: " + ", ".join(f"{v} (rel_err {e:.3g})" for v, e in wrong))
        if notes:
            cols[f"{k}_note"] = "; ".join(notes)
        return cols

    def _failed(self, p, msg, e):
        if _sticky_cuda_error(e):
            p.broken = f"an earlier CUDA error ({_short(e, 120)})"
        return {f"{p.key}_status": "failed", f"{p.key}_note": msg}


def open_bundle(
    root, out_dir, *, splits=(4, 8, 16, 32), bridge=None, build=True, build_timeout_s=480.0, tol=1e-2, iterations=30
) -> Bundle:
    """The peers of bundle ``root``: imports what is there, starts FlashMLA's build in the background
    when it is not built (returns at once). ``bridge`` None: a `TorchBridge` (a peer whose framework
    does not import is unavailable, named, with the reason)."""
    peers = [FlashMLA(root, out_dir, build=build, build_timeout_s=build_timeout_s), TritonMLA(root, splits)]
    if bridge is None:
        try:
            bridge = TorchBridge()
        except Exception as e:  # noqa: BLE001 - no torch, or no CUDA for it
            why = _short(e, 200)
            for p in peers:
                p.why = f"{p.label} unavailable: torch with CUDA is needed ({why})"
    for p in peers:
        if not p.why:
            p.start()
    for p in peers:
        state = p.why or ("loaded" if p.module else "building in the background")
        _say(f"# peers: {p.label}: {state}" if not p.why else f"# peers: {state}")
    return Bundle(root, peers, bridge, tol=tol, iterations=iterations)


def check_bundle_dir(path) -> str | None:
    """None if ``path`` looks like a peer bundle, else the one-line reason it does not."""
    if not os.path.isdir(path):
        return f"--peers {path}: no such directory (the peer bundle: flashmla/ and vllm_triton_mla.py)"
    if not (os.path.isdir(os.path.join(path, "flashmla")) or os.path.isfile(os.path.join(path, "vllm_triton_mla.py"))):
        return f"--peers {path}: holds neither flashmla/ nor vllm_triton_mla.py"
    return None


def rel_err(got, ref) -> float:
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def _first_error(log_path) -> str:
    try:
        with open(log_path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    errs = [ln.strip() for ln in lines if "error" in ln.lower() and "warning" not in ln.lower()]
    pick = errs[0] if errs else (lines[-1].strip() if lines else "")
    return f": {pick[:200]}" if pick else ""


def _sticky_cuda_error(e) -> bool:
    m = str(e).lower()
    return (
        "illegal" in m or "misaligned" in m or "launch failure" in m or "cuda error" in m
    ) and "out of memory" not in m


def _short(e, n=300) -> str:
    return f"{type(e).__name__}: {e}".replace("\n", " ")[:n]


def _say(msg):
    print(msg, flush=True)
