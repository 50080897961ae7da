/* replay TRACE all|aligned: serve a trace.c recording's allocations again, in order, in this
 * fresh process, with glibc's thresholds as titan-train sets them (mmap below 1 GiB off, no
 * trim), and print how far the heap grew at most (MiB, mallinfo2: all arenas and mappings).
 * "aligned" replays the aligned allocations alone (c10's tensor blocks: posix_memalign).
 * The first record's thread is served from this one; every other traced thread (gloo's
 * workers, OMP's) from a thread of its own, so from an arena of its own, as in the run. */
#define _GNU_SOURCE
#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  uint64_t seq, ptr, size, old;
  uint32_t tid, op;
} record_t;

/* The traced address -> the replayed block (open addressing; 1 marks a freed slot). */
#define SLOTS (1u << 24)
static uint64_t *keys;
static void **blocks;
static uint64_t slot(uint64_t key) { key ^= key >> 33, key *= 0xff51afd7ed558ccdULL, key ^= key >> 33; return key & (SLOTS - 1); }
static void put(uint64_t key, void *block) {
  uint64_t i = slot(key);
  while (keys[i] > 1 && keys[i] != key) i = (i + 1) & (SLOTS - 1);
  keys[i] = key, blocks[i] = block;
}
static void *take(uint64_t key) {
  for (uint64_t i = slot(key); keys[i]; i = (i + 1) & (SLOTS - 1))
    if (keys[i] == key) return keys[i] = 1, blocks[i];
  return NULL;
}
static int by_seq(const void *a, const void *b) {
  uint64_t x = ((const record_t *)a)->seq, y = ((const record_t *)b)->seq;
  return (x > y) - (x < y);
}

static int aligned_only;

static void serve(record_t *r) {
  size_t size = r->size ? r->size : 1;
  void *block;
  if (r->op == 2) {
    free(take(r->ptr));  /* a block from before the trace began: not ours, nothing */
    return;
  }
  if (aligned_only && r->op != 4) return;
  if (r->op == 4) {
    if (posix_memalign(&block, 64, size)) block = NULL;
  } else if (r->op == 3) {
    void *old = r->old ? take(r->old) : NULL;
    block = r->old && !old ? malloc(size) : realloc(old, size);
  } else {
    block = malloc(size);
  }
  put(r->ptr, block);
}

/* A traced thread's stand-in: serves one record at a time while the main loop waits. */
typedef struct {
  uint32_t tid;
  record_t *job;
  pthread_mutex_t lock;
  pthread_cond_t changed;
} worker_t;
#define MAX_WORKERS 256
static worker_t workers[MAX_WORKERS];
static int nworkers;

static void *work(void *arg) {
  worker_t *w = arg;
  pthread_mutex_lock(&w->lock);
  for (;;) {
    while (!w->job) pthread_cond_wait(&w->changed, &w->lock);
    serve(w->job);
    w->job = NULL;
    pthread_cond_broadcast(&w->changed);
  }
  return NULL;
}

static void serve_on(uint32_t tid, record_t *r) {
  worker_t *w = NULL;
  for (int i = 0; i < nworkers && !w; i++)
    if (workers[i].tid == tid) w = &workers[i];
  if (!w) {
    if (nworkers == MAX_WORKERS) return serve(r);
    w = &workers[nworkers++];
    w->tid = tid;
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->changed, NULL);
    pthread_t thread;
    pthread_create(&thread, NULL, work, w);
  }
  pthread_mutex_lock(&w->lock);
  w->job = r;
  pthread_cond_broadcast(&w->changed);
  while (w->job) pthread_cond_wait(&w->changed, &w->lock);
  pthread_mutex_unlock(&w->lock);
}

int main(int argc, char **argv) {
  if (argc != 3) return fprintf(stderr, "usage: replay TRACE all|aligned\n"), 2;
  aligned_only = strcmp(argv[2], "aligned") == 0;
  if (!mallopt(M_MMAP_THRESHOLD, 1 << 30)) mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 0x7fffffff);
  FILE *f = fopen(argv[1], "rb");
  if (!f) return perror(argv[1]), 1;
  fseek(f, 0, SEEK_END);
  long n = ftell(f) / (long)sizeof(record_t);
  fseek(f, 0, SEEK_SET);
  record_t *records = malloc(n * sizeof(record_t));
  if (fread(records, sizeof(record_t), n, f) != (size_t)n) return fprintf(stderr, "short read\n"), 1;
  fclose(f);
  qsort(records, n, sizeof(record_t), by_seq);
  keys = calloc(SLOTS, sizeof(uint64_t)), blocks = calloc(SLOTS, sizeof(void *));
  struct mallinfo2 start = mallinfo2();
  size_t high = start.arena + start.hblkhd;
  for (long i = 0; i < n; i++) {
    record_t *r = &records[i];
    if (r->tid == records[0].tid) serve(r);
    else serve_on(r->tid, r);
    if (r->op == 2 || (aligned_only && r->op != 4)) continue;
    struct mallinfo2 now = mallinfo2();
    if (now.arena + now.hblkhd > high) high = now.arena + now.hblkhd;
  }
  printf("%.1f\n", (high - start.arena - start.hblkhd) / 1048576.0);
  return 0;
}
