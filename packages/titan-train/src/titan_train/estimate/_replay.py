"""``python -I -S _replay.py MMAP_THRESHOLD CAPPED_MMAP_THRESHOLD TRIM_THRESHOLD``: serve the
allocations on stdin (``<qqq`` records: key, bytes, thread; 0 bytes frees the key) with this
fresh process's own glibc, as c10's CPU allocator calls it (``posix_memalign(64)``, ``free``),
and print how far its heap and mappings grew at most (bytes, ``mallinfo2``, all arenas).
Thread 0 is this process's main thread; any other number is a thread of its own, started on
its first record (as a gloo worker thread is: glibc gives it an arena of its own), each
record served there while the main thread waits. Standalone (no torch, no titan): its heap
starts as small as Python's (``titan_train.estimate.host``)."""

import ctypes
import queue
import struct
import sys
import threading

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

    def serve(key: int, nbytes: int) -> None:
        pointer = held.pop(key, None)
        if pointer is not None:
            free(pointer)
        if nbytes > 0:
            pointer = ctypes.c_void_p()
            memalign(ctypes.byref(pointer), 64, nbytes)
            held[key] = pointer

    workers: dict[int, queue.Queue] = {}
    done: queue.Queue = queue.Queue()

    def work(inbox: queue.Queue) -> None:
        while (record := inbox.get()) is not None:
            serve(*record)
            done.put(None)

    start = libc.mallinfo2()
    high = 0
    for key, nbytes, thread in struct.iter_unpack("<qqq", data):
        if thread == 0:
            serve(key, nbytes)
        else:
            if thread not in workers:
                workers[thread] = queue.Queue()
                threading.Thread(target=work, args=(workers[thread],), daemon=True).start()
            workers[thread].put((key, nbytes))
            done.get()
        if nbytes > 0:
            info = libc.mallinfo2()
            high = max(high, info.arena + info.hblkhd)
    for inbox in workers.values():
        inbox.put(None)
    print(max(0, high - start.arena - start.hblkhd))


if __name__ == "__main__":
    main()
