"""JAX's persistent compilation cache for the command-line tools, on by default.

A second `mla-generate` (or `mla-train`, `mla-bench e2e`) run over the same model shapes then
loads its compiled steps from disk instead of compiling them again. Where the cache lives:
  --compile-cache DIR         that directory ("off" disables it)
  $MLA_JAX_COMPILE_CACHE      the same, when the flag is not given ("off", "0" or "" disables it)
  default                     $XDG_CACHE_HOME/mla-jax/xla, else ~/.cache/mla-jax/xla
"""

from __future__ import annotations

import os

import jax

ENV = "MLA_JAX_COMPILE_CACHE"
_OFF = ("", "0", "off", "none", "false")


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mla-jax", "xla")


def resolve(flag: str | None) -> str | None:
    """The cache directory the flag and the environment ask for, or None when disabled."""
    value = flag if flag is not None else os.environ.get(ENV)
    if value is None:
        return default_dir()
    return None if value.strip().lower() in _OFF else os.path.expanduser(value)


def enable(flag: str | None = None) -> str | None:
    """Turn the persistent cache on (before the first compilation) -> its directory, or None.

    Every compiled step is cached, however quick its compilation (jax's default skips those under
    a second). A directory that cannot be created raises OSError naming it.
    """
    path = resolve(flag)
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OSError(f"compile cache directory {path!r} cannot be created: {e.strerror or e}") from None

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def add_argument(parser) -> None:
    """The `--compile-cache` option, the same in every tool."""
    parser.add_argument(
        "--compile-cache",
        metavar="DIR",
        default=None,
        help=f"persistent compilation cache directory, 'off' to disable (default: ${ENV} or {default_dir()})",
    )
