/* An LD_PRELOAD library that records every malloc, calloc, realloc, aligned allocation and
 * free between trace_start(path) and trace_stop(), for estimate_accuracy.py --replay-real.
 *
 * Hand-written because neither glibc (its mtrace() hooks left libc in 2.34) nor torch sees
 * the runtime's small C++ allocations; heaptrack would, but it is not a pip package.
 * Each record is 40 bytes: sequence number, address, bytes, the old address (realloc),
 * thread id, operation (1 malloc/calloc, 2 free, 3 realloc, 4 aligned). Threads buffer
 * their records and append them under a lock; the sequence number restores the order. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);

typedef struct {
  uint64_t seq, ptr, size, old;
  uint32_t tid, op;
} record_t;

#define BUFFERED 4096
#define MAX_THREADS 1024
static __thread record_t buffer[BUFFERED];
static __thread int buffered, busy, registered;
static record_t *buffers[MAX_THREADS];
static int *counts[MAX_THREADS];
static int threads;
static volatile int enabled;
static int fd = -1;
static uint64_t next_seq;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void append(record_t *records, int n) {
  if (n > 0 && fd >= 0 && write(fd, records, sizeof(record_t) * n) < 0) enabled = 0;
}

static void record(uint32_t op, void *ptr, size_t size, void *old) {
  if (!enabled || busy) return;
  busy = 1;  /* the lock and the write below may allocate: not recorded */
  if (!registered && threads < MAX_THREADS) {
    pthread_mutex_lock(&lock);
    buffers[threads] = buffer;
    counts[threads++] = &buffered;
    pthread_mutex_unlock(&lock);
    registered = 1;
  }
  record_t *r = &buffer[buffered++];
  r->seq = __atomic_fetch_add(&next_seq, 1, __ATOMIC_SEQ_CST);
  r->ptr = (uint64_t)ptr, r->size = size, r->old = (uint64_t)old, r->op = op;
  r->tid = (uint32_t)syscall(SYS_gettid);
  if (buffered == BUFFERED) {
    pthread_mutex_lock(&lock);
    append(buffer, buffered);
    pthread_mutex_unlock(&lock);
    buffered = 0;
  }
  busy = 0;
}

void trace_start(const char *path) {
  fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  enabled = fd >= 0;
}

void trace_stop(void) {
  enabled = 0;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < threads; i++) append(buffers[i], *counts[i]), *counts[i] = 0;
  pthread_mutex_unlock(&lock);
  close(fd);
  fd = -1;
}

void *malloc(size_t n) { void *p = __libc_malloc(n); record(1, p, n, 0); return p; }
void *calloc(size_t n, size_t size) { void *p = __libc_calloc(n, size); record(1, p, n * size, 0); return p; }
void *realloc(void *old, size_t n) { void *p = __libc_realloc(old, n); record(3, p, n, old); return p; }
void *memalign(size_t align, size_t n) { void *p = __libc_memalign(align, n); record(4, p, n, 0); return p; }
void *aligned_alloc(size_t align, size_t n) { return memalign(align, n); }
int posix_memalign(void **out, size_t align, size_t n) {
  void *p = __libc_memalign(align, n);
  if (!p) return ENOMEM;
  record(4, p, n, 0);
  *out = p;
  return 0;
}
void free(void *p) {
  if (p) record(2, p, 0, 0);
  __libc_free(p);
}
