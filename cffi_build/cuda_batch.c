/* The CUDA driver functions the core calls, and the loops that call them without Python in between.
 *
 * The core is built without CUDA headers or libraries (CUDA loads lazily, in cuda/_driver.py); the
 * driver functions arrive once, as a table of addresses resolved there (aib_cuda_set_driver), and
 * every C caller takes them from here. Only what a consumer repeats per buffer of a message lives
 * here: on the producer the attribute queries of a message's buffers and the export of its IPC-pool
 * pointers, on the consumer the import of those pointers and their frees — each a short driver
 * call, which a Python loop around it would outweigh — plus the event query of sync_event.c
 * and the producer's per-version record of a publication's shared event (aib_cuda_record_after). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "internal.h"

#define CUDA_ERROR_NOT_INITIALIZED 3

static _Atomic(uintptr_t) event_query, pointer_get_attributes, mem_pool_export_pointer, mem_pool_import_pointer,
    mem_free, ctx_get_current, ctx_push_current, ctx_pop_current, stream_wait_event, event_record;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

/* A forked child cannot use its parent's CUDA state: it forgets the driver. */
static void driver_after_fork_child(void) {
  atomic_store(&event_query, 0);
  atomic_store(&pointer_get_attributes, 0);
  atomic_store(&mem_pool_export_pointer, 0);
  atomic_store(&mem_pool_import_pointer, 0);
  atomic_store(&mem_free, 0);
  atomic_store(&ctx_get_current, 0);
  atomic_store(&ctx_push_current, 0);
  atomic_store(&ctx_pop_current, 0);
  atomic_store(&stream_wait_event, 0);
  atomic_store(&event_record, 0);
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, driver_after_fork_child); }

void aib_cuda_set_driver(const aib_cuda_driver *driver) {
  pthread_once(&fork_once, register_fork_handler);
  atomic_store(&event_query, driver->event_query);
  atomic_store(&pointer_get_attributes, driver->pointer_get_attributes);
  atomic_store(&mem_pool_export_pointer, driver->mem_pool_export_pointer);
  atomic_store(&mem_pool_import_pointer, driver->mem_pool_import_pointer);
  atomic_store(&mem_free, driver->mem_free);
  atomic_store(&ctx_get_current, driver->ctx_get_current);
  atomic_store(&ctx_push_current, driver->ctx_push_current);
  atomic_store(&ctx_pop_current, driver->ctx_pop_current);
  atomic_store(&stream_wait_event, driver->stream_wait_event);
  atomic_store(&event_record, driver->event_record);
}

uintptr_t aib_cuda_event_query(void) { return atomic_load_explicit(&event_query, memory_order_acquire); }

uintptr_t aib_cuda_pointer_get_attributes(void) {
  return atomic_load_explicit(&pointer_get_attributes, memory_order_acquire);
}

/* CUresult cuMemPoolImportPointer(CUdeviceptr *ptr_out, CUmemoryPool pool, CUmemPoolPtrExportData *data) */
typedef int (*pool_import_fn)(uint64_t *ptr_out, void *pool, void *share_data);

int aib_cuda_import_pool_pointers(uintptr_t pool, const uint8_t *export_data, size_t n, uint64_t *out,
                                  size_t *done) {
  pool_import_fn fn = (pool_import_fn)atomic_load(&mem_pool_import_pointer);
  *done = 0;
  if (fn == NULL) return CUDA_ERROR_NOT_INITIALIZED;
  uint8_t share[64]; /* CUmemPoolPtrExportData: 64 opaque bytes */
  for (size_t i = 0; i < n; i++) {
    memcpy(share, export_data + 64 * i, sizeof(share));
    int rc = fn(&out[i], (void *)pool, share);
    if (rc != 0) {
      *done = i;
      return rc;
    }
  }
  *done = n;
  return 0;
}

/* CUresult cuMemFree_v2(CUdeviceptr ptr) */
typedef int (*mem_free_fn)(uint64_t ptr);

/* Frees every pointer, also after a failure (each is its own allocation); returns the first error. */
int aib_cuda_free_pointers(const uint64_t *pointers, size_t n) {
  mem_free_fn fn = (mem_free_fn)atomic_load(&mem_free);
  if (fn == NULL) return n == 0 ? 0 : CUDA_ERROR_NOT_INITIALIZED;
  int first = 0;
  for (size_t i = 0; i < n; i++) {
    int rc = fn(pointers[i]);
    if (rc != 0 && first == 0) first = rc;
  }
  return first;
}

/* CUresult cuMemPoolExportPointer(CUmemPoolPtrExportData *out, CUdeviceptr ptr) */
typedef int (*pool_export_fn)(void *share_out, uint64_t ptr);

int aib_cuda_export_pool_pointers(const uint64_t *pointers, size_t n, uint8_t *out, size_t *done) {
  pool_export_fn fn = (pool_export_fn)atomic_load(&mem_pool_export_pointer);
  *done = 0;
  if (fn == NULL) return CUDA_ERROR_NOT_INITIALIZED;
  for (size_t i = 0; i < n; i++) {
    int rc = fn(out + 64 * i, pointers[i]);
    if (rc != 0) {
      *done = i;
      return rc;
    }
  }
  *done = n;
  return 0;
}

/* CUresult cuCtxGetCurrent(CUcontext *), cuCtxPushCurrent_v2(CUcontext), cuCtxPopCurrent_v2(CUcontext *),
 * cuStreamWaitEvent(CUstream, CUevent, unsigned int), cuEventRecord(CUevent, CUstream) */
typedef int (*ctx_get_fn)(void **ctx);
typedef int (*ctx_push_fn)(void *ctx);
typedef int (*stream_wait_fn)(void *stream, void *event, unsigned flags);
typedef int (*event_record_fn)(void *event, void *stream);

static int record_failure(int call, int rc) { return (call << 16) | (rc & 0xFFFF); }

/* A publisher's shared event, re-recorded each version (cuda/shared_event.py): one C call for what
 * took a context check, a wait and a record from Python, each a driver call through cffi. */
int aib_cuda_record_after(uintptr_t context, uintptr_t after, uintptr_t event) {
  ctx_get_fn get = (ctx_get_fn)atomic_load(&ctx_get_current);
  ctx_push_fn push = (ctx_push_fn)atomic_load(&ctx_push_current);
  ctx_get_fn pop = (ctx_get_fn)atomic_load(&ctx_pop_current);
  stream_wait_fn wait = (stream_wait_fn)atomic_load(&stream_wait_event);
  event_record_fn record = (event_record_fn)atomic_load(&event_record);
  if (get == NULL || push == NULL || pop == NULL || wait == NULL || record == NULL) return CUDA_ERROR_NOT_INITIALIZED;
  void *current = NULL;
  int rc = get(&current);
  if (rc != 0) return record_failure(AIB_CUDA_RECORD_CALL_GET_CURRENT, rc);
  int pushed = (uintptr_t)current != context;
  if (pushed && (rc = push((void *)context)) != 0) return record_failure(AIB_CUDA_RECORD_CALL_PUSH, rc);
  int result = 0;
  if (after != 0 && (rc = wait(NULL, (void *)after, 0)) != 0)
    result = record_failure(AIB_CUDA_RECORD_CALL_WAIT, rc);
  else if ((rc = record((void *)event, NULL)) != 0)
    result = record_failure(AIB_CUDA_RECORD_CALL_RECORD, rc);
  if (pushed) {
    void *popped = NULL;
    rc = pop(&popped);
    if (rc != 0 && result == 0) result = record_failure(AIB_CUDA_RECORD_CALL_POP, rc);
  }
  return result;
}
