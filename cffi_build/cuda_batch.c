/* Driver calls made in a loop without Python in between.
 *
 * The core is built without CUDA headers or libraries (CUDA loads lazily, in cuda/_driver.py); the
 * driver function arrives as an address resolved there. Only what a consumer repeats per buffer of
 * a message lives here: on the producer the attribute queries of a message's buffers and the export
 * of its IPC-pool pointers, on the consumer the import of those pointers and their frees — each a
 * driver call of ~1 µs around which a Python loop cost several times more. */
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

/* CUresult cuPointerGetAttributes(unsigned n, CUpointer_attribute *attributes, void **data, CUdeviceptr ptr) */
typedef int (*get_attributes_fn)(unsigned n, const int *attributes, void **data, uint64_t ptr);

int aib_cuda_describe_buffers(uintptr_t get_attributes, const int *attributes, unsigned n_attributes,
                              unsigned base_slot, unsigned size_slot, const uint64_t *addresses,
                              const uint64_t *lengths, size_t n, uint64_t *infos, uint32_t *allocation_of,
                              size_t *n_infos) {
  get_attributes_fn fn = (get_attributes_fn)get_attributes;
  void *data[AIB_MAX_POINTER_ATTRIBUTES];
  if (n_attributes > AIB_MAX_POINTER_ATTRIBUTES || base_slot >= n_attributes || size_slot >= n_attributes) {
    *n_infos = 0;
    return -1;
  }
  size_t count = 0;
  uint64_t base = 0, size = 0;
  for (size_t i = 0; i < n; i++) {
    uint64_t address = addresses[i];
    /* Inside the previous buffer's allocation: no query (written to avoid overflow). */
    int inside = count > 0 && address >= base && address - base <= size && lengths[i] <= size - (address - base);
    if (!inside) {
      uint64_t *slots = infos + count * n_attributes;
      memset(slots, 0, n_attributes * sizeof(uint64_t));
      for (unsigned k = 0; k < n_attributes; k++) data[k] = slots + k;
      int rc = fn(n_attributes, attributes, data, address);
      if (rc != 0) {
        *n_infos = count;
        return rc;
      }
      base = slots[base_slot];
      size = slots[size_slot];
      count++;
    }
    allocation_of[i] = (uint32_t)(count - 1);
  }
  *n_infos = count;
  return 0;
}

/* CUresult cuMemPoolExportPointer(CUmemPoolPtrExportData *out, CUdeviceptr ptr) */
typedef int (*pool_export_fn)(void *share_out, uint64_t ptr);

int aib_cuda_export_pool_pointers(uintptr_t export_fn, const uint64_t *pointers, size_t n, uint8_t *out,
                                  size_t *done) {
  pool_export_fn fn = (pool_export_fn)export_fn;
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
