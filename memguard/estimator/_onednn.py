"""Arithmetic shared by memguard's ports of oneDNN's scratchpad sizing (``onednn_matmul``, ``onednn_conv``).

oneDNN books each scratchpad buffer with 128 bytes of alignment slack (``common/memory_tracking.hpp``,
``registry_t::book``, oneDNN 3.12) and scores its blocking choices in float32.
"""

from __future__ import annotations

import struct

BOOK_PAD = 128  # memory_tracking.hpp: each booking's capacity is its size + 128-byte alignment


def f32(x: float) -> float:
    """Round to float32, as oneDNN's heuristics compute."""
    return struct.unpack("f", struct.pack("f", x))[0]


def div_up(a: int, b: int) -> int:
    return -(-a // b)


def rnd_up(a: int, b: int) -> int:
    return div_up(a, b) * b


def book(nbytes: int) -> int:
    """What one booking of ``nbytes`` costs (nothing for an empty one)."""
    return nbytes + BOOK_PAD if nbytes > 0 else 0
