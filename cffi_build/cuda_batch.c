/* Driver calls made in a loop without Python in between.
 *
 * The core is built without CUDA headers or libraries (CUDA loads lazily, in memory/cuda.py); the
 * driver function arrives as an address resolved there. Only what a consumer repeats per buffer of
 * a message lives here: today the import of IPC-pool pointers, where the Python loop around the
 * driver's ~1.5 µs call used to cost more than the call. */
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
