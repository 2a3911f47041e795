/* Driver calls made in a loop without Python in between.
 *
 * The core is built without CUDA headers or libraries (CUDA loads lazily, in memory/cuda.py); the
 * driver function arrives as an address resolved there. Only what a consumer repeats per buffer of
 * a message lives here: the import of IPC-pool pointers and their frees, where the Python loop
 * around the driver's ~1 µs call cost more than the call. */
#include <string.h>

#include "internal.h"

/* CUresult cuMemPoolImportPointer(CUdeviceptr *ptr_out, CUmemoryPool pool, CUmemPoolPtrExportData *data) */
typedef int (*pool_import_fn)(uint64_t *ptr_out, void *pool, void *share_data);

int aib_cuda_import_pool_pointers(uintptr_t import_fn, uintptr_t pool, const uint8_t *export_data, size_t n,
                                  uint64_t *out, size_t *done) {
  pool_import_fn fn = (pool_import_fn)import_fn;
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
int aib_cuda_free_pointers(uintptr_t free_fn, const uint64_t *pointers, size_t n) {
  mem_free_fn fn = (mem_free_fn)free_fn;
  int first = 0;
  for (size_t i = 0; i < n; i++) {
    int rc = fn(pointers[i]);
    if (rc != 0 && first == 0) first = rc;
  }
  return first;
}
