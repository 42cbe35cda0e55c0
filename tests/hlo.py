"""Reading compiled HLO text in tests: copies by size, while loops without a known trip count, conditionals."""

import re

import numpy as np

_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO array shape like `f32[5,25,64,576]` (1-byte types: u8, s8, pred, f8*)."""
    dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", shape).groups()
    n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    return n * _BYTES.get(dtype, 1)


def copies(text: str) -> list[str]:
    """The array shapes of every `copy` and `copy-start` in a compiled module's text."""
    return re.findall(r"= (\w+\[[\d,]*\])\{[\d,:A-Z()]*\} copy(?:-start)?\(", text)


def big_copies(text: str, limit: int = 1 << 20) -> list[str]:
    """Copies of more than `limit` bytes."""
    return [c for c in copies(text) if shape_bytes(c) > limit]


def host_round_trips(text: str) -> list[str]:
    """While loops whose trip count XLA does not know, and conditionals: on a GPU each copies its predicate
    to the host at every iteration (or call), blocking the launch stream."""
    lines = text.splitlines()
    loops = [ln for ln in lines if re.search(r" while\(", ln) and 'known_trip_count":{"n":"' not in ln]
    conds = [ln for ln in lines if re.search(r" conditional\(", ln)]
    return [ln.strip()[:160] for ln in loops + conds]


def buffers(text: str, limit: int, dtypes=("f16", "bf16", "f32", "f64")) -> list[str]:
    """The arrays of `dtypes` of more than `limit` bytes that a compiled module's text holds as buffers: the
    outputs of instructions outside fused computations (a fusion's own instructions are not buffers), tuple
    elements included (a while loop's carried arrays), as `shape opcode` strings."""
    fused = set(re.findall(r"calls=(%[\w.\-]+)", text))
    out, current = [], None
    for line in text.splitlines():
        head = re.match(r"(?:ENTRY )?(%[\w.\-]+) \(", line)
        if head:
            current = head.group(1)
            continue
        if current in fused or " = " not in line:
            continue
        kind = re.match(r"(.*?) ([\w\-]+)\(", line.split(" = ", 1)[1])
        if not kind:
            continue
        for dtype, dims in re.findall(r"\b(\w+)\[([\d,]*)\]", kind.group(1)):
            if dtype in dtypes and shape_bytes(f"{dtype}[{dims}]") > limit:
                out.append(f"{dtype}[{dims}] {kind.group(2)}")
    return out
