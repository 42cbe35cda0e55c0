"""A run's checkpoints (orbax `CheckpointManager`, `<out>/checkpoints/<step>`) and its HF-layout export.

A checkpoint holds every variable of the model (Params and router biases), the optax state (moments and the
schedule's step count) and a JSON record: the step, what `models.training.loop.Trainer.record` adds (data-order
seed, trajectory settings, model config, corpus fingerprint) and a sha256 of each array tree, so a restore
refuses files that do not read back exactly as they were saved (truncated, edited, renamed, half written):
each is one `TrainerError` naming the checkpoint directory. A save that fails (a full disk, no permission) is
one `TrainerError` naming the step directory and the cause; its partial files are removed and the earlier
checkpoints stay. Checkpoints hold global arrays: a run may resume on another mesh or on one device.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from models.checkpoint import save_hf_checkpoint
from models.tokenizer import save_byte_tokenizer
from models.training.settings import TrainerError

_ITEMS = ("state", "opt_state")


def checkpoint_manager(out: str, create: bool = True, tidy: bool = False):
    """The orbax CheckpointManager of `<out>/checkpoints` (the last two steps are kept). `tidy`: first remove
    the unfinished saves (`*.orbax-checkpoint-tmp*`) a killed run left behind (a run's own manager only: never
    while another process may be saving there)."""

    opts = ocp.CheckpointManagerOptions(max_to_keep=2, create=create, cleanup_tmp_directories=tidy)
    return ocp.CheckpointManager(os.path.abspath(os.path.join(out, "checkpoints")), options=opts)


def tree_sha256(tree) -> str:
    """sha256 over every leaf's key path, dtype, shape and bytes, in tree order."""

    h = hashlib.sha256()
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        a = np.ascontiguousarray(host_array(x))
        h.update(f"{jax.tree_util.keystr(path)}|{a.dtype}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def host_array(x) -> np.ndarray:
    """The whole of a (global) array in this process's memory: sharded over other processes' devices, it
    is gathered from them (a collective: every process must call it, in the same order)."""

    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def save_checkpoint(mgr, step: int, state, opt_state, meta: dict) -> None:
    """Write step `step`: both array trees and `meta` plus their checksums (`tree_sha256`), then wait.

    A save that fails (a full disk, no permission) is one TrainerError naming the step directory and the
    cause; its partial files are removed and the earlier checkpoints stay as they were. A KeyboardInterrupt
    during the save removes them too, once orbax's threads have ended, and goes on."""

    meta = {**meta, "step": step, "sha256": {"state": tree_sha256(state), "opt_state": tree_sha256(opt_state)}}
    directory = str(mgr.directory)
    where = os.path.join(directory, str(step))
    existed = os.path.exists(where)
    try:
        with _OrbaxNoiseHeld():
            try:
                mgr.save(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardSave(state),
                        opt_state=ocp.args.StandardSave(opt_state),
                        meta=ocp.args.JsonSave(meta),
                    ),
                    force=True,
                )
                mgr.wait_until_finished()
            except BaseException:
                try:  # orbax's threads write into the folder removed below: let them end first
                    mgr.wait_until_finished()
                except Exception:  # noqa: BLE001 - their error is the one being reported
                    pass
                raise
    except BaseException as e:
        _remove_partial_save(directory, step, existed)
        try:
            mgr.reload()  # forget the step it did not finish
            last = mgr.latest_step()
        except Exception:  # noqa: BLE001
            last = None
        if not isinstance(e, Exception):  # an interruption: `train` says what there is
            raise
        kept = (
            "there is no earlier checkpoint"
            if last is None
            else f"the last checkpoint, {os.path.join(directory, str(last))}, is intact (--resume continues from it)"
        )
        raise TrainerError(
            f"cannot save checkpoint {where}: {_save_failure(e)}; its partial files were removed; {kept}"
        ) from None


def _remove_partial_save(directory: str, step: int, existed: bool, patience_s: float = 5.0) -> None:
    """Remove what the failed save of `step` wrote (its `*.orbax-checkpoint-tmp*` folders; the step's folder if
    it was new). A write still finishing in a thread orbax or tensorstore did not join can put a file back as
    the folder goes (the test suite once found the tmp folder back after the removal), so the removal is
    repeated until nothing of the save is left, for up to `patience_s` seconds."""

    def leftovers() -> list[str]:
        names = os.listdir(directory) if os.path.isdir(directory) else ()
        return [n for n in names if n.startswith(f"{step}.orbax-checkpoint-tmp") or (n == str(step) and not existed)]

    deadline = time.monotonic() + patience_s
    while True:
        for name in leftovers():
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        if not leftovers() or time.monotonic() > deadline:
            return
        time.sleep(0.05)


class _OrbaxNoiseHeld:
    """Holds back what orbax and its threads print while a save runs. A failed save logs the traceback of each
    thread that saw the error, tensorstore's callbacks report theirs ("Event loop is closed") and asyncio reports
    every failed write as its task is collected: about a thousand lines, where one line says it all. What a
    save that succeeds logs at WARNING or above is passed on at the end."""

    LOGGERS = ("absl", "asyncio")

    def __enter__(self):
        self.held: list = []
        self.unraisablehook, sys.unraisablehook = sys.unraisablehook, self.held.append
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self._hold)
        return self

    def _hold(self, record) -> bool:
        self.held.append(record)
        return False

    def __exit__(self, exc_type, *_):
        if exc_type is not None:
            gc.collect()  # the failed write tasks go now, while asyncio's reports of them are held
        sys.unraisablehook = self.unraisablehook
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self._hold)
        if exc_type is not None:  # and those collected or reported later (by a thread still ending) are dropped
            for name in self.LOGGERS:
                logging.getLogger(name).addFilter(_not_an_orbax_orphan)
        if exc_type is None:
            for item in self.held:
                if not isinstance(item, logging.LogRecord):
                    self.unraisablehook(item)
                elif item.levelno >= logging.WARNING:
                    logging.getLogger(item.name).handle(item)


def _not_an_orbax_orphan(record) -> bool:
    """False for a late report of a failed save's write error, already said in one line: asyncio's for an orbax
    write task whose error nobody read, and the traceback an orbax thread logs (through absl) as it ends after
    the save has returned."""
    text = record.getMessage()
    if text.startswith("Task exception was never retrieved") and "orbax" in text:
        return False
    return not ("orbax" in record.pathname and "raised an exception" in text)


def _save_failure(e: BaseException) -> str:
    """Why a save failed, in words: the operating system's reason where there is one ("No space left on
    device"; tensorstore reports it as os_error_code=28 inside its message), else the exception's first line."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return os.strerror(seen.errno)
        code = re.search(r"os_error_code='?(\d+)", str(seen))
        if code:
            return os.strerror(int(code.group(1)))
        seen = seen.__cause__ or seen.__context__
    return _reason(e)


def _reason(e: BaseException) -> str:
    """An exception as a short phrase: its first line, without tensorstore's spec dump."""
    text = (str(e).strip().splitlines() or [""])[0].split(" See full TensorStore details")[0]
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def checkpoint_record(mgr, step: int | None = None) -> tuple[int, str, dict]:
    """(step, its directory, its JSON record) of `step` (default the latest), checked to belong to that
    directory; TrainerError when there is none or it cannot be read."""

    try:
        steps = mgr.all_steps()
    except Exception as e:  # noqa: BLE001 - anything orbax cannot list is a damaged directory
        raise TrainerError(f"cannot list the checkpoints in {mgr.directory}: {_reason(e)}") from e
    if not steps:
        raise TrainerError(f"no checkpoint in {mgr.directory} to resume from")
    step = max(steps) if step is None else step
    where = os.path.join(str(mgr.directory), str(step))
    try:
        meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # noqa: BLE001
        raise TrainerError(f"checkpoint {where}: its record (meta/metadata) cannot be read: {_reason(e)}") from e
    if not isinstance(meta, dict) or not {"step", "trajectory", "corpus_sha256"} <= meta.keys():
        raise TrainerError(f"checkpoint {where}: its record (meta/metadata) is not one mla-train wrote")
    if meta["step"] != step:
        raise TrainerError(
            f"checkpoint {where} holds step {meta['step']}, not {step}: a step directory renamed or "
            "copied from another run; remove it or restore its name"
        )
    return step, where, meta


def recorded_steps(out: str) -> int | None:
    """The total steps of the run in `out` as its latest checkpoint records them (the run's own total, what
    `--resume` without `--steps` continues to); None when `out` holds no checkpoint or its record cannot be
    read (restoring it says why)."""
    if not os.path.isdir(os.path.join(out, "checkpoints")):
        return None
    mgr = checkpoint_manager(out, create=False)
    try:
        steps = checkpoint_record(mgr)[2]["trajectory"].get("steps")
    except (TrainerError, AttributeError):
        return None
    finally:
        mgr.close()
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def restore_checkpoint(mgr, state_template, opt_template, step: int | None = None):
    """(state, opt_state, meta) of `step` (default the latest), restored into the templates' structure and
    checked against the checksums saved with them. TrainerError, naming the step directory and what is
    wrong, on a missing, truncated, altered or mismatched checkpoint."""

    step, where, meta = checkpoint_record(mgr, step)
    abstract = lambda t: jax.tree.map(ocp.utils.to_shape_dtype_struct, t)  # noqa: E731

    # orbax hands back arrays committed to a device; fresh ones are uncommitted, and jit keys its cache
    # on that, so a resumed run would compile the step again. A host round-trip is exact. A template on a
    # mesh (committed, sharded) is what orbax restored onto: kept as it comes.
    def fresh(tree, template):
        return jax.tree.map(
            lambda x, ref: x if isinstance(ref.sharding, NamedSharding) else jnp.asarray(np.asarray(x)), tree, template
        )

    restored = []
    for item, template in zip(_ITEMS, (state_template, opt_template)):
        try:
            tree = mgr.restore(step, args=ocp.args.Composite(**{item: ocp.args.StandardRestore(abstract(template))}))
            tree = fresh(tree[item], template)
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many kinds; all mean "unreadable"
            raise TrainerError(f"checkpoint {where}/{item} cannot be read: {_reason(e)}") from e
        saved = meta.get("sha256", {}).get(item)
        if saved is not None and tree_sha256(tree) != saved:
            raise TrainerError(
                f"checkpoint {where}/{item}: the arrays read back differ from those saved (sha256 "
                "mismatch): its files were damaged or changed"
            )
        restored.append(tree)
    return restored[0], restored[1], meta


def export(graphdef, state, directory: str, summary: dict | None = None) -> None:
    """HF layout (config.json + model.safetensors) plus the byte-tokenizer marker, loadable by
    `load_hf_checkpoint` / `load_tokenizer` / `mla-generate --checkpoint`; `summary` -> training.json.
    Of several processes every one calls it (the arrays are gathered from all) and process 0 writes."""

    state = jax.tree.map(host_array, state)  # from every process's devices (a collective)
    if jax.process_index() != 0:
        return
    save_hf_checkpoint(nnx.merge(graphdef, state), directory)
    save_byte_tokenizer(directory)
    if summary is not None:
        with open(os.path.join(directory, "training.json"), "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
