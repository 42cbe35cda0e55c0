"""Hugging Face DeepSeek-V2/V2-Lite/V3 checkpoints (safetensors only) <-> `DeepSeekModel`.

Layout read and written (DEEPSEEK_SEMANTICS.md §4): `config.json` + one `model.safetensors`, or
shards listed by `model.safetensors.index.json`; torch weights [out, in] (transposed to our
[in, out] kernels; the interleaved RoPE rows are used as they are, no permutation); per-expert
keys `mlp.experts.{e}.{gate,up,down}_proj.weight` (stacked to [E, D, I] / [E, I, D]); the MTP
module k at `model.layers.{num_hidden_layers + k}.*`. That layer's `embed_tokens.weight` and
`shared_head.head.weight` are copies of the main embedding and LM head (our MTP shares them):
on load they are CHECKED equal to the main ones (a mismatch raises); on save they are written
as copies, as the release does. The names of each variable are `models.hf_names`.

FP8 releases: a weight stored as F8_E4M3 with a `<name>_scale_inv` companion
(`weight_scale_inv` fp32 [ceil(out/128), ceil(in/128)]) is dequantized on load, W = q · s per
128×128 block (edge blocks partial). With `load_hf_checkpoint(..., weights="fp8")` they are kept as
released instead (`mla_jax.fp8_weights`): each quantized projection's e4m3 values [out, in] and fp32
scales go into the model's `Fp8Linear` / `Fp8Experts` variables unchanged (no transpose, no rounding);
the checkpoint must then say so (`quantization_config`: quant_method "fp8", fmt "e4m3", weight_block_size
[128, 128]) and store every projection the release quantizes in e4m3 with its scales: a dense checkpoint
is refused in one line, never quantized on the way in. safetensors 0.8 cannot read F8_E4M3 through numpy/flax, so
this module parses the file format itself (8-byte header length, JSON header, raw bytes) and
views the bytes with `ml_dtypes` (§5.4). Pickle formats (.bin/.pt/...) are refused.

Loading streams: every check (names, shapes, dtypes, scale pairs) reads only the files' headers; then the
files are read one at a time, memory-mapped, each tensor converted on its own and put on the device (a
scanned layer stack is a device buffer written slice by slice, in place), so the host allocates about one
tensor's conversion at a time, never a whole stack or the whole checkpoint; a progress bar on a terminal.
"""

from __future__ import annotations

import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax import lax
from tqdm import tqdm

from mla_jax import fp8_weights
from mla_jax.config import ModelConfig
from mla_jax.hf_config import read_json_object
from models.deepseek import DeepSeekModel
from models.hf_names import SCALE_SUFFIX, Entry, hf_entries, hf_shape, mtp_copies, variable

_ST_TO_NP = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NP_TO_ST = {v: k for k, v in _ST_TO_NP.items()}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
FP8_BLOCK = 128
# Buffers some exporters write that carry no parameters (recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ------------------------------------------------------------------------------------------
# safetensors files, read and written by hand (F8_E4M3 and BF16 through ml_dtypes)
# ------------------------------------------------------------------------------------------
def read_safetensors(file: str) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as read-only numpy arrays (memory-mapped, any dtype incl. F8_E4M3).

    Raises ValueError naming the file, and the tensor where there is one, unless the file is well
    formed: an 8-byte little-endian header length that fits in the file, a header that is a UTF-8
    JSON object, and per tensor a known dtype, a shape of non-negative integers and data_offsets
    [begin, end] inside the data section whose length matches the shape.
    """
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise ValueError(f"{file}: not a safetensors file (shorter than 8 bytes)")
        n = int(np.frombuffer(raw_len, dtype="<u8")[0])
        if n > size - 8:
            raise ValueError(
                f"{file}: not a safetensors file, or truncated: its header length {n} exceeds the "
                f"{size - 8} bytes that follow"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{file}: not a safetensors file: its {n}-byte header is not UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: the safetensors header must be a JSON object, got {type(header).__name__}")
    data_size = size - 8 - n
    buf = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + n) if data_size > 0 else np.zeros((0,), np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{file}: tensor {name!r}"
        if not isinstance(info, dict):
            raise ValueError(
                f"{where}: header entry must be an object with dtype, shape and data_offsets, got {info!r:.80}"
            )
        st_dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(st_dtype, str) or st_dtype not in _ST_TO_NP:
            raise ValueError(f"{where} has unsupported dtype {st_dtype!r} (known: {', '.join(_ST_TO_NP)})")
        if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
            raise ValueError(f"{where}: shape must be a list of non-negative integers, got {shape!r:.80}")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]
        ):
            raise ValueError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r:.80}")
        dt = _ST_TO_NP[st_dtype]
        begin, end = offsets
        shape = tuple(shape)
        if end > data_size:
            raise ValueError(
                f"{where}: byte range {begin}..{end} lies past the end of the data section "
                f"({data_size} bytes): the file is truncated or its header is wrong"
            )
        if end - begin != math.prod(shape) * dt.itemsize:
            raise ValueError(f"{where}: byte range {begin}..{end} does not fit shape {shape} {dt}")
        out[name] = buf[begin:end].view(dt).reshape(shape)
    return out


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def write_safetensors(file: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write numpy arrays (f32/bf16/f16/fp8/ints) as one .safetensors file, names sorted, format 'pt'."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _NP_TO_ST:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} cannot be written to safetensors")
        header[name] = {
            "dtype": _NP_TO_ST[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
        arrays.append(a)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # the data section starts 8-byte aligned
    with open(file, "wb") as f:
        f.write(np.uint64(len(hb)).astype("<u8").tobytes())
        f.write(hb)
        for a in arrays:
            f.write(a.tobytes())


def check_fp8_scales(q: np.ndarray, scale_inv: np.ndarray, block: int = FP8_BLOCK) -> None:
    """ValueError unless q is 2-D [out, in] and scale_inv is [ceil(out/block), ceil(in/block)]."""
    if q.ndim != 2 or scale_inv.ndim != 2:
        raise ValueError(
            f"fp8 block scaling needs a 2-D weight and 2-D scales, got weight {q.shape} and "
            f"weight_scale_inv {tuple(scale_inv.shape)}"
        )
    o, i = q.shape
    want = (-(-o // block), -(-i // block))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight {q.shape} "
            f"in {block}x{block} blocks (expected {want})"
        )


def dequantize_fp8_blocks(q: np.ndarray, scale_inv: np.ndarray, block: int = FP8_BLOCK) -> np.ndarray:
    """fp8 [out, in] · scale_inv [ceil(out/block), ceil(in/block)] per block -> float32 [out, in]."""
    check_fp8_scales(q, scale_inv, block)
    o, i = q.shape
    s = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block, axis=0), block, axis=1)[:o, :i]
    return np.asarray(q).astype(np.float32) * s


def _refuse_pickle(path: str) -> None:
    raise ValueError(
        f"{path!r} is a pickle-based checkpoint; only safetensors is supported "
        "(pickle files can run arbitrary code). Convert it to .safetensors first."
    )


def checkpoint_files(path: str) -> list[str]:
    """The .safetensors files of a checkpoint directory (index.json shards, or the files present)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        if path.endswith(_PICKLE_SUFFIXES):
            _refuse_pickle(path)
        if not path.endswith(".safetensors"):
            raise ValueError(f"{path!r} is not a .safetensors file")
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json_object(index).get("weight_map")
        if not (
            isinstance(weight_map, dict) and weight_map and all(isinstance(v, str) and v for v in weight_map.values())
        ):
            raise ValueError(f'{index}: "weight_map" must be a non-empty object of tensor name -> shard file name')
        files = [os.path.join(path, s) for s in sorted(set(weight_map.values()))]
        for s in files:
            if not os.path.isfile(s):
                raise FileNotFoundError(f"shard {os.path.basename(s)!r} listed in {index!r} is missing")
        return files
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        pick = sorted(f for f in os.listdir(path) if f.endswith(_PICKLE_SUFFIXES))
        if pick:
            _refuse_pickle(os.path.join(path, pick[0]))
        raise FileNotFoundError(f"no .safetensors files in {path!r}")
    return files


class _Stored:
    """A tensor as a checkpoint stores it: its file, shape and dtype (read from the header; no data)."""

    __slots__ = ("file", "shape", "dtype")

    def __init__(self, file: str, shape: tuple, dtype: np.dtype):
        self.file, self.shape, self.dtype = file, shape, dtype


def _stored_tensors(path: str) -> dict[str, _Stored]:
    """Every tensor of a checkpoint by HF name -> where and how it is stored, from the files' headers (the
    data stays on disk), with the fp8 weight / `_scale_inv` pairs checked as `read_hf_tensors` does."""
    stored: dict[str, _Stored] = {}
    for file in checkpoint_files(path):
        for k, v in read_safetensors(file).items():  # memory-mapped views: only the header is read
            if k in stored:
                raise ValueError(f"tensor {k!r} appears in more than one shard: {stored[k].file} and {file}")
            stored[k] = _Stored(file, tuple(v.shape), v.dtype)
    for k, v in stored.items():
        if k.endswith(SCALE_SUFFIX):
            if k[: -len(SCALE_SUFFIX)] not in stored:
                raise ValueError(
                    f"{v.file}: unexpected tensor {k!r}: scale without its weight {k[: -len(SCALE_SUFFIX)]!r}"
                )
            continue
        if v.dtype in (_ST_TO_NP["F8_E4M3"], _ST_TO_NP["F8_E5M2"]):
            s = stored.get(k + SCALE_SUFFIX)
            if s is None:
                raise ValueError(f"{v.file}: fp8 tensor {k!r} has no {k + SCALE_SUFFIX!r} block scales")
            if len(v.shape) != 2:
                raise ValueError(f"{v.file}: fp8 tensor {k!r} must be 2-D, got shape {v.shape}")
            try:
                check_fp8_scales(np.empty(v.shape, np.uint8), np.empty(s.shape, np.uint8))
            except ValueError as e:
                raise ValueError(f"{v.file}: tensor {k + SCALE_SUFFIX!r}: {e}") from None
        elif k + SCALE_SUFFIX in stored:
            raise ValueError(f"{v.file}: tensor {k!r} has block scales {k + SCALE_SUFFIX!r} but is {v.dtype}, not fp8")
    return stored


def _is_fp8(dtype) -> bool:
    return dtype in (_ST_TO_NP["F8_E4M3"], _ST_TO_NP["F8_E5M2"])


def read_hf_tensors(path: str, *, dequantize: bool = True) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint, HF names, fp8 block-scaled weights dequantized to float32
    (`dequantize=False`: kept as stored, e4m3 beside its `<name>_scale_inv`, the pairs checked the same way).
    The whole checkpoint in host memory (memory-mapped where kept as stored); `load_hf_checkpoint` streams
    instead.

    ValueErrors name the file and the tensor (see `read_safetensors`, `checkpoint_files`).
    """
    stored = _stored_tensors(path)
    raw: dict[str, np.ndarray] = {}
    for file in sorted({v.file for v in stored.values()}):
        raw.update(read_safetensors(file))
    out = {}
    for k, v in raw.items():
        if k.endswith(SCALE_SUFFIX):
            if not dequantize:
                out[k] = v
        elif _is_fp8(v.dtype) and dequantize:
            out[k] = dequantize_fp8_blocks(v, raw[k + SCALE_SUFFIX])
        else:
            out[k] = v
    return out


# ------------------------------------------------------------------------------------------
# Load / save
# ------------------------------------------------------------------------------------------
def _check_fp8_release(config_dir: str) -> None:
    """ValueError (one line) unless config.json declares the release's FP8 format."""
    file = os.path.join(config_dir, "config.json")
    qc = read_json_object(file).get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        raise ValueError(
            f"weights='fp8' keeps FP8 weights as released, but {file} has no fp8 quantization_config "
            f"(quantization_config={qc!r:.80}): load this checkpoint without weights="
        )
    block = qc.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
    if block != [FP8_BLOCK, FP8_BLOCK] or qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(
            f"weights='fp8' reads e4m3 weights in {FP8_BLOCK}x{FP8_BLOCK} blocks; {file} has "
            f"weight_block_size={block!r}, fmt={qc.get('fmt')!r}: load this checkpoint without weights="
        )


def _dequantized_on_load(model, entries: list[Entry], stored: dict[str, _Stored], path: str, weights) -> set[str]:
    """The FP8-stored weights to dequantize while loading: all of them, or with weights="fp8" those the model
    keeps dense (the others must be stored in e4m3: ValueError naming the first that is not)."""
    fp8 = {k for k, v in stored.items() if _is_fp8(v.dtype)}
    if weights != "fp8":
        return fp8
    kept = set()
    for mpath, _, _, names in entries:
        if not isinstance(variable(model, mpath), fp8_weights.Fp8Weight):
            continue
        for n in [names] if isinstance(names, str) else names:
            kept.add(n)
            if n in stored and stored[n].dtype != fp8_weights.FP8_DTYPE:
                raise ValueError(
                    f"weights='fp8' keeps FP8 weights as released, but checkpoint {path!r} stores {n!r} as "
                    f"{stored[n].dtype}, not float8_e4m3fn with a weight_scale_inv: load it without weights="
                )
    return fp8 - kept


@functools.partial(jax.jit, donate_argnums=0)
def _put(buf, value, start):
    """buf with `value` written at `start` (leading indices; the rest from 0), in place (donated)."""
    value = value.reshape((1,) * len(start) + value.shape)
    return lax.dynamic_update_slice(buf, value.astype(buf.dtype), (*start, *(0,) * (buf.ndim - len(start))))


def load_hf_checkpoint(
    path: str | os.PathLike,
    dtype=None,
    *,
    param_dtype=None,
    moe_impl: str = "auto",
    mtp_hidden_source: str = "post_norm",
    weights=None,
):
    """A `DeepSeekModel` with the weights of an HF-layout checkpoint directory.

    weights (`mla_jax.fp8_weights.WEIGHT_FORMATS`): None dequantizes an FP8 release into `param_dtype`;
    "fp8" keeps its projections as released, e4m3 [out, in] with fp32 block scales, in the model's
    `Fp8Linear` / `Fp8Experts` variables (see the module docstring; the other weights go to `param_dtype`,
    an FP8-stored one among them dequantized). With "fp8", a checkpoint whose config.json has no fp8
    `quantization_config` (e4m3, 128x128 blocks), or that stores a quantized projection in another dtype,
    raises ValueError in one line.

    dtype: compute dtype; None = bf16 on a GPU (fp32 would double the bytes every decode step reads
    and keep the MoE off its Mosaic GPU kernel), fp32 elsewhere. param_dtype: storage dtype
    (default `dtype`). The router kernel and
    `e_score_correction_bias` are kept in fp32 whatever the dtype. Raises ValueError naming the
    tensor for a missing, unexpected or mis-shaped tensor, a floating-point weight stored with an integer
    dtype, an fp8 weight without scales, an MTP copy of the embedding/head that differs from the main one,
    or a pickle checkpoint.
    """

    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(_PICKLE_SUFFIXES):
        _refuse_pickle(path)
    # config.json sits beside the weights when `path` names one .safetensors file.
    config_dir = os.path.dirname(path) if os.path.isfile(path) else path
    cfg = ModelConfig.from_hf(config_dir)
    fp8_weights.check_weights(weights)
    if weights == "fp8":
        _check_fp8_release(config_dir)
    stored = _stored_tensors(path)
    if dtype is None:
        dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    param_dtype = dtype if param_dtype is None else param_dtype
    model = nnx.eval_shape(
        lambda: DeepSeekModel(
            cfg,
            rngs=nnx.Rngs(0),
            dtype=dtype,
            param_dtype=param_dtype,
            moe_impl=moe_impl,
            mtp_hidden_source=mtp_hidden_source,
            weights=weights,
        )
    )
    entries = hf_entries(cfg, weights)
    dequantized = _dequantized_on_load(model, entries, stored, path, weights)
    copies = mtp_copies(cfg)
    expected = {n for _, _, _, names in entries for n in ([names] if isinstance(names, str) else names)}
    missing = sorted(expected - stored.keys())
    if missing:
        raise ValueError(
            f"checkpoint {path!r} lacks {len(missing)} tensor(s) the config needs: {missing[:8]}"
            + (" ..." if len(missing) > 8 else "")
        )
    unexpected = sorted(
        k
        for k in stored
        if k not in expected
        and k not in copies
        and not k.endswith(_IGNORED_SUFFIXES)
        and not (k.endswith(SCALE_SUFFIX) and k[: -len(SCALE_SUFFIX)] in dequantized)
    )
    if unexpected:
        raise ValueError(
            f"checkpoint {path!r} has {len(unexpected)} unexpected tensor(s): {unexpected[:8]}"
            + (" ..." if len(unexpected) > 8 else "")
        )
    # Every mapped tensor's shape and dtype first: a bad main tensor must be named as such, not through
    # the MTP copy that no longer matches it.
    target: dict[str, tuple] = {}  # HF name -> (variable path, leading indices in the variable, kind)
    for mpath, index, kind, names in entries:
        var = variable(model, mpath)
        shape = tuple(var.shape) if index is None else tuple(var.shape[1:])
        want = hf_shape(shape, kind)
        lead = () if index is None else (index,)
        for e, n in enumerate([names] if isinstance(names, str) else names):
            if stored[n].shape != want:
                raise ValueError(f"tensor {n!r} has shape {stored[n].shape}, expected {want} for this config")
            if stored[n].dtype.kind in "iub" and jnp.issubdtype(var.dtype, jnp.floating):
                raise ValueError(
                    f"tensor {n!r} is stored as {stored[n].dtype}, but it is a floating-point weight "
                    f"({np.dtype(var.dtype)} here): a float tensor written with an integer dtype has lost its fractions"
                )
            target[n] = (mpath, lead + ((e,) if kind in ("stack", "stackT") else ()), kind)
    for copy, main in copies.items():
        if copy in stored:
            a, b = _read(stored, copy), _read(stored, main)
            same = a.shape == b.shape and (
                np.array_equal(a, b)
                if a.dtype == b.dtype
                else np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
            )
            del a, b
            if not same:
                raise ValueError(
                    f"tensor {copy!r} should be a copy of {main!r} (the MTP module shares it), but it differs"
                )
    # Stream: one file at a time, each tensor straight to the device (a stacked variable is a device buffer
    # written slice by slice); the host holds the file's pages it reads and one tensor's conversion.
    bufs: dict[tuple, jax.Array] = {}
    files = sorted({stored[n].file for n in target})
    total = sum(os.path.getsize(f) for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading", disable=None, leave=False) as bar:
        for file in files:
            views = read_safetensors(file)
            for n, view in views.items():
                if n not in target:
                    continue
                mpath, start, kind = target[n]
                var = variable(model, mpath)
                arr = view
                if n in dequantized:
                    arr = dequantize_fp8_blocks(view, _read(stored, n + SCALE_SUFFIX, views))
                if kind in ("T", "stackT"):
                    arr = arr.T
                if arr.dtype.itemsize < 2 and var.dtype != fp8_weights.FP8_DTYPE:
                    arr = arr.astype(np.float32)
                if not start and kind not in ("stack", "stackT"):
                    var.set_value(jnp.array(arr, dtype=var.dtype))
                else:
                    if mpath not in bufs:
                        bufs[mpath] = jnp.zeros(var.shape, var.dtype)
                    bufs[mpath] = _put(bufs[mpath], jnp.array(arr), tuple(np.int32(i) for i in start))
                del arr
                bar.update(view.nbytes)
            del views  # the file's memory map goes with its last view
    for mpath, buf in bufs.items():
        variable(model, mpath).set_value(buf)
    left = [
        jax.tree_util.keystr(k)
        for k, v in jax.tree_util.tree_leaves_with_path(nnx.state(model))
        if isinstance(v, jax.ShapeDtypeStruct)
    ]
    if left:  # every variable must come from the file
        raise RuntimeError(f"internal: model variables not covered by the HF name map: {left}")
    return model


def _read(stored: dict[str, _Stored], name: str, views: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """One tensor's data: from `views` (an open file's) when it is there, else read from its own file."""
    if views is not None and name in views:
        return views[name]
    return np.array(read_safetensors(stored[name].file)[name])


def to_hf_tensors(model) -> dict[str, np.ndarray]:
    """The model's weights under HF names as numpy arrays (torch layout), MTP copies included; an FP8
    model's (`weights="fp8"`) projections as e4m3 with their `_scale_inv`, as released."""
    cfg = model.cfg
    out: dict[str, np.ndarray] = {}
    host: dict[tuple, np.ndarray] = {}  # each (stacked) variable copied to the host once
    for mpath, index, kind, names in hf_entries(cfg, getattr(model, "weights", None)):
        if mpath not in host:
            host[mpath] = np.asarray(jax.device_get(variable(model, mpath)[...]))
        a = host[mpath] if index is None else host[mpath][index]
        if kind == "T":
            out[names] = np.ascontiguousarray(a.T)
        elif kind == "stackT":
            for e, n in enumerate(names):
                out[n] = np.ascontiguousarray(a[e].T)
        elif kind == "stack":
            for e, n in enumerate(names):
                out[n] = np.ascontiguousarray(a[e])
        else:
            out[names] = a
    for copy, main in mtp_copies(cfg).items():
        out[copy] = out[main] if main in out else np.ascontiguousarray(np.asarray(model.embed_tokens.embedding[...]))
    return out


def save_hf_checkpoint(model, path: str | os.PathLike, *, max_shard_bytes: int | None = None) -> None:
    """Write `config.json` (cfg.to_hf_dict()) and safetensors in HF naming (per-expert keys, MTP at layer L).

    Tensors keep the model's parameter dtypes (fp32/bf16; router and bias fp32; an FP8 model's projections
    e4m3 + fp32 scales, with the release's `quantization_config` in config.json). With
    `max_shard_bytes`, tensors are split over `model-0000i-of-0000n.safetensors` files plus
    `model.safetensors.index.json`; otherwise one `model.safetensors`.
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = to_hf_tensors(model)
    d = model.cfg.to_hf_dict()
    d["torch_dtype"] = "float32"
    if getattr(model, "weights", None) == "fp8":
        d["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
        f.write("\n")
    if max_shard_bytes is None:
        write_safetensors(os.path.join(path, "model.safetensors"), tensors)
        return
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nb = tensors[name].nbytes
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nb
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        write_safetensors(os.path.join(path, fname), shard)
        weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))}, "weight_map": weight_map}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
