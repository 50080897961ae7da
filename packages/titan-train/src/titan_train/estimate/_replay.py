"""``python -I -S _replay.py MMAP_THRESHOLD CAPPED_MMAP_THRESHOLD TRIM_THRESHOLD``: serve the
allocations on stdin (``<qq`` records: key, bytes; 0 bytes frees the key) with this fresh
process's own glibc, as c10's CPU allocator calls it (``posix_memalign(64)``, ``free``), and
print how far its heap and mappings grew at most (bytes, ``mallinfo2``). Standalone (no
torch, no titan): its heap starts as small as Python's (``titan_train.estimate.host``)."""

import ctypes
import struct
import sys

_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS.split()]


def main() -> None:
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    # As titan_train.trainer.host_memory sets them (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD).
    if not libc.mallopt(-3, int(sys.argv[1])):
        libc.mallopt(-3, int(sys.argv[2]))
    libc.mallopt(-1, int(sys.argv[3]))
    data = sys.stdin.buffer.read()
    memalign, free = libc.posix_memalign, libc.free
    free.argtypes = [ctypes.c_void_p]
    held: dict[int, ctypes.c_void_p] = {}
    start = libc.mallinfo2()
    high = 0
    for key, nbytes in struct.iter_unpack("<qq", data):
        pointer = held.pop(key, None)
        if pointer is not None:
            free(pointer)
        if nbytes > 0:
            pointer = ctypes.c_void_p()
            memalign(ctypes.byref(pointer), 64, nbytes)
            held[key] = pointer
            info = libc.mallinfo2()
            high = max(high, info.arena + info.hblkhd)
    print(max(0, high - start.arena - start.hblkhd))


if __name__ == "__main__":
    main()
