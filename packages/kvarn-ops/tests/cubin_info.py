"""Resource usage of an offline-compiled kernel, read from its cubin (no GPU needed)."""

from __future__ import annotations

import struct

__all__ = ["cubin_resources"]


def cubin_resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack frame bytes) of the kernel in a cubin, read from its ``.nv.info``
    attributes (EIATTR_REGCOUNT 0x2f, EIATTR_FRAME_SIZE 0x11): offline, the compiled kernel's
    ``n_regs``/``n_spills`` exist only once loaded on a GPU. A nonzero frame here is spill space
    (these kernels have no local arrays or calls)."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [
        struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)
    ]
    names = headers[shstrndx][4]
    found = {}
    for h in headers:
        name = cubin[names + h[0] : cubin.index(b"\0", names + h[0])]
        if name != b".nv.info":
            continue
        data = cubin[h[4] : h[4] + h[5]]
        pos = 0
        while pos + 4 <= len(data):
            fmt, attr, size = struct.unpack_from("<BBH", data, pos)
            if fmt != 0x04:  # attributes without a payload
                pos += 4
                continue
            if attr in (0x2F, 0x11) and size == 8:
                found[attr] = struct.unpack_from("<II", data, pos + 4)[1]
            pos += 4 + size
    return found.get(0x2F, 0), found.get(0x11, 0)
