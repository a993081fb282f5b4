"""Resource usage of an offline-compiled kernel, read from its cubin (no GPU needed)."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import tempfile

__all__ = ["cubin_resources", "sass_opcodes"]


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


def sass_opcodes(cubin: bytes) -> list[str]:
    """The kernel's SASS opcodes in program order (predicates dropped), by the ``nvdisasm``
    that ships with triton's NVIDIA backend."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True)
    ops = []
    for line in text.stdout.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops.append(m.group(1))
    return ops
