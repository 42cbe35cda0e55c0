"""The one check of a block table against its lengths and the page pool, shared by both kernels.

Sequence b reads the first cdiv(length_b, page_size) entries of row b of its block table. The
rules: 0 <= length_b <= page_size * max_pages (the table covers the sequence), and every entry
that is read is a page id in [0, num_pages). Nothing else catches a bad id: the reference's
``kv_pages[block_table]`` clamps it (a silent read of the last page, or of page -1 + num_pages
for a negative id), the interpreter answers something else, and the GPU reads past the pool.

Concrete inputs (numpy arrays, jax arrays outside a trace) are checked on the host and raise
`ValueError` naming the first bad entry and the limit. Traced inputs (under `jax.jit`) cannot
raise; with ``checked=True`` the same rules become `jax.experimental.checkify` checks, which
the caller functionalises:

    f = checkify.checkify(jax.jit(lambda *a: mla_decode(*a, softmax_scale=s, checked=True)))
    err, (out, lse) = f(q, kv_pages, block_table, seq_lens)
    err.throw()        # checkify.JaxRuntimeError (a ValueError) with the same message

(``checked=True`` under `jax.jit` without `checkify.checkify` fails at trace time: JAX says that
a check was not functionalised.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify


def _traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _length_message(name: str, capacity: int, max_pages: int, page_size: int, index: str, value: str) -> str:
    return (
        f"{name}[{index}] = {value} is outside [0, {capacity}]: the block table holds "
        f"{max_pages} pages of {page_size} tokens a sequence"
    )


def _page_message(num_pages: int, b: str, j: str, value: str) -> str:
    return (
        f"block_table[{b}, {j}] = {value} is not a page id: kv_pages has {num_pages} pages "
        f"(ids 0..{num_pages - 1}), and sequence {b} reads this entry"
    )


def check_page_table(
    block_table, lengths, *, num_pages: int, page_size: int, lengths_name: str = "seq_lens", checked: bool = False
) -> None:
    """Raises ValueError (or, traced with ``checked``, fails a checkify check) unless every entry
    of ``block_table`` int32 [B, max_pages] that ``lengths`` (int [B], or one Python int for every
    row) makes a kernel read is a page id in [0, num_pages), and 0 <= lengths <= page_size * max_pages.
    """
    B, max_pages = block_table.shape
    capacity = page_size * max_pages
    if _traced(block_table) or _traced(lengths):
        if checked:
            _checkify_page_table(
                block_table, lengths, num_pages=num_pages, page_size=page_size, lengths_name=lengths_name
            )
        return
    table = np.asarray(block_table)
    lens = np.broadcast_to(np.asarray(lengths, np.int64), (B,))
    bad = np.flatnonzero((lens < 0) | (lens > capacity))
    if bad.size:
        b = int(bad[0])
        raise ValueError(_length_message(lengths_name, capacity, max_pages, page_size, str(b), str(int(lens[b]))))
    read = np.arange(max_pages)[None, :] < -(-lens // page_size)[:, None]
    bad = np.argwhere(read & ((table < 0) | (table >= num_pages)))
    if bad.size:
        b, j = (int(i) for i in bad[0])
        raise ValueError(_page_message(num_pages, str(b), str(j), str(int(table[b, j]))))


def _checkify_page_table(block_table, lengths, *, num_pages, page_size, lengths_name):
    B, max_pages = block_table.shape
    capacity = page_size * max_pages
    lens = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), (B,))
    bad_len = (lens < 0) | (lens > capacity)
    b = jnp.argmax(bad_len)
    checkify.check(
        ~jnp.any(bad_len),
        _length_message(lengths_name, capacity, max_pages, page_size, "{b}", "{value}"),
        b=b,
        value=lens[b],
    )
    need = (jnp.clip(lens, 0, capacity) + page_size - 1) // page_size
    read = jnp.arange(max_pages)[None, :] < need[:, None]
    bad = (read & ((block_table < 0) | (block_table >= num_pages))).reshape(-1)
    first = jnp.argmax(bad)
    checkify.check(
        ~jnp.any(bad),
        _page_message(num_pages, "{b}", "{j}", "{value}"),
        b=first // max_pages,
        j=first % max_pages,
        value=block_table.reshape(-1)[first],
    )
