/* The CUDA half of the C core's interface: what this process has open (the region table), the
 * driver functions the core calls, the producer's fast path for fresh device data and the sync events
 * handed out while pending. It uses bridge.h's types and is included at its end (include bridge.h,
 * not this file); cffi's cdef reads it after bridge.h (build_bridge.py), under the same rules: no
 * macros with arguments, no inline code. */
#ifndef AIB_BRIDGE_CUDA_H
#define AIB_BRIDGE_CUDA_H

/* ---------- what this process has open: the region table (region_table.c) ---------------------
 * The one record of it, which aib_session_get reads and Python asks (it keeps no copy). Keys: a
 * legacy IPC handle (64 bytes; value: its base here; owner: what keeps it open, one reference held
 * by the table), a kept pool slab's handle (88 bytes; the same), an opened IPC event (the key
 * aib_regions_event_key makes of its handle and device; value: the CUevent), a GPU UUID (value: its
 * ordinal here). Each kind keeps its entries in least-recently-used order (find and a C-side
 * import are uses). put replaces the key's entry, then lets go of the kind's least recently used
 * entries while it holds more than limit (0: no bound); remove returns 1 when absent; find returns
 * 1 when present, with a reference on the owner for the caller when owner is not NULL (it may be
 * NULL: events, GPUs); take_oldest takes the kind's least recently used entry out (0: none left);
 * list copies the keys of key_len bytes of a kind, least recently used first, up to max, and
 * returns how many there are; key_of finds the key of a kind's entry with that value. An entry
 * let go of releases its owner reference outside the table's lock. */
#define AIB_REGION_KEY_LEGACY 1
#define AIB_REGION_KEY_EVENT 2
#define AIB_REGION_KEY_DEVICE 3
#define AIB_REGION_KEY_POOL 4 /* a kept IPC-pool slab's 88-byte handle -> its imported pointer */
/* A legacy handle opened again in another GPU's context, to be read from there (cross_gpu.py):
 * the 64-byte handle, then the reader's ordinal (4 bytes, little-endian) -> the pointer in that
 * context. A kind of its own, so that the C get paths (kind LEGACY) never hand it to an import. */
#define AIB_REGION_KEY_READER_LEGACY 5
#define AIB_REGION_KEY_MAX 128
#define AIB_MAX_NEW_REGIONS 256
int aib_regions_put(uint32_t kind, const uint8_t *key, size_t key_len, uint64_t value, aib_owner *owner,
                    size_t limit);
int aib_regions_find(uint32_t kind, const uint8_t *key, size_t key_len, uint64_t *value, aib_owner **owner);
int aib_regions_remove(uint32_t kind, const uint8_t *key, size_t key_len);
int aib_regions_take_oldest(uint32_t kind, uint8_t *key_out, size_t *key_len_out, uint64_t *value_out);
size_t aib_regions_list(uint32_t kind, uint8_t *keys_out, size_t key_len, size_t max);
int aib_regions_key_of(uint32_t kind, uint64_t value, uint8_t *key_out, size_t *key_len_out);
size_t aib_regions_count(void);
size_t aib_regions_count_kind(uint32_t kind);
/* The event key: the handle's bytes, then the device ordinal (8 bytes, little-endian); its length,
 * 0 when the handle is empty or too long (key_out holds AIB_REGION_KEY_MAX bytes). */
size_t aib_regions_event_key(const uint8_t *handle, size_t handle_len, int64_t device, uint8_t *key_out);
/* How many messages aib_import_new imported, and how many open handles (legacy or kept pool) they
 * used. */
void aib_regions_stats(uint64_t *imports, uint64_t *handles);
/* The lease owner (token set, view and sync slot filled) for a CUDA message whose device, event
 * and regions (legacy handles, kept pool slabs) are in the table, or NULL: the caller's slow path. */
aib_owner *aib_import_new(const uint8_t *message, size_t length, uint32_t n_fds, uint64_t token,
                          aib_owner *keeper);
/* An owner's decoded message (NULL when none), and its view: the bases (n returned; valid while
 * the owner lives) and the device id. */
aib_decoded *aib_owner_decoded(aib_owner *owner);
size_t aib_owner_view_bases(aib_owner *owner, const uint64_t **bases, int64_t *device_id);
/* ---------- the driver functions the core calls (cuda_batch.c) ---------------------------------
 * The core is built without CUDA; cuda/_driver.py resolves these in libcuda when it loads the driver
 * and hands them over once, as addresses (0: not available). A forked child forgets them (CUDA state
 * does not survive fork): the loops below then fail with CUDA_ERROR_NOT_INITIALIZED (3) and sync
 * events are handed out without asking. */
typedef struct aib_cuda_driver {
  uintptr_t event_query;             /* cuEventQuery */
  uintptr_t pointer_get_attributes;  /* cuPointerGetAttributes */
  uintptr_t mem_pool_export_pointer; /* cuMemPoolExportPointer */
  uintptr_t mem_pool_import_pointer; /* cuMemPoolImportPointer */
  uintptr_t mem_free;                /* cuMemFree_v2 */
  uintptr_t ctx_get_current;         /* cuCtxGetCurrent */
  uintptr_t ctx_push_current;        /* cuCtxPushCurrent_v2 */
  uintptr_t ctx_pop_current;         /* cuCtxPopCurrent_v2 */
  uintptr_t stream_wait_event;       /* cuStreamWaitEvent */
  uintptr_t event_record;            /* cuEventRecord */
} aib_cuda_driver;
void aib_cuda_set_driver(const aib_cuda_driver *driver);
/* On the legacy default stream of context (a CUcontext): cuStreamWaitEvent for after (a CUevent; 0:
 * none), then cuEventRecord of event, with context made current for the two calls when another one
 * is (pushed, then popped: the caller's current context is current again after). Returns 0, or
 * (AIB_CUDA_RECORD_CALL_* << 16) | CUresult of the first call that failed; the context pushed is
 * popped after any failure. CUDA_ERROR_NOT_INITIALIZED (call NONE) without the driver's functions. */
#define AIB_CUDA_RECORD_CALL_NONE 0
#define AIB_CUDA_RECORD_CALL_GET_CURRENT 1
#define AIB_CUDA_RECORD_CALL_PUSH 2
#define AIB_CUDA_RECORD_CALL_WAIT 3
#define AIB_CUDA_RECORD_CALL_RECORD 4
#define AIB_CUDA_RECORD_CALL_POP 5
int aib_cuda_record_after(uintptr_t context, uintptr_t after, uintptr_t event);
/* Driver loops: calls cuMemPoolImportPointer on pool for n 64-byte export records in order, the
 * current context being the caller's. Returns 0, or the first failing CUresult with *done the
 * number imported before it (their pointers are in out: the caller frees them). */
int aib_cuda_import_pool_pointers(uintptr_t pool, const uint8_t *export_data, size_t n, uint64_t *out,
                                  size_t *done);
/* Calls cuMemFree_v2 for each pointer, all of them even after a failure; returns 0 or the first
 * failing CUresult. */
int aib_cuda_free_pointers(const uint64_t *pointers, size_t n);
/* Calls cuMemPoolExportPointer for each pointer, writing 64 bytes each to out. Returns 0, or the
 * first failing CUresult with *done the number exported before it. */
int aib_cuda_export_pool_pointers(const uint64_t *pointers, size_t n, uint8_t *out, size_t *done);
/* ---------- the producer's fast path for fresh device data (cuda_export.c, py_columns.c) ---------
 * One 1-D numeric column without nulls: `length` values of format `code` (an index into
 * "c s i l C S I L e f g", i.e. int8..int64, uint8..uint64, float16/32/64) at device address `data`,
 * and the stream its producer announced (0: none). */
typedef struct aib_cuda_column {
  uint64_t data;
  int64_t length;
  int64_t stream;
  uint32_t code;
  uint32_t reserved;
} aib_cuda_column;
/* Installs read_cuda_columns on the Python module module_name (py_columns.c); 0 or -1. */
int aib_py_install_columns(const char *module_name);
/* Installs DecodedState, ImportState and RememberedState on the Python module module_name
 * (py_state.c): the base types whose slots hold what a get makes, which C fills by offset; 0 or -1.
 * Before aib_py_install_local_get. */
int aib_py_install_state(const char *module_name);
/* Installs LocalGetter on the Python module module_name (py_local_get.c): a session's local re-gets
 * (aib_session_get_local) with the imported object built in C; 0 or -1. */
int aib_py_install_local_get(const char *module_name);
/* aib_columns_build: the schema and array (no device wrapper) of n columns of one length: a struct
 * "+s" record batch with children named names[i] when as_batch, else one plain array (n == 1, names
 * unused). One allocation per tree; the structs own no data (the caller keeps it alive). */
int aib_columns_build(size_t n, const char *const *names, const aib_cuda_column *columns, int as_batch,
                      struct ArrowSchema *schema_out, struct ArrowArray *array_out, aib_error *err);
/* The one device ordinal of the columns' memory (*device_out), one cuPointerGetAttributes each (the
 * caller's context current). Returns 0; -2 when they live on several devices (*failed the first
 * column not on column 0's device, its device in *other_out); or, with *failed the first column
 * unknown to the driver or in pinned host memory, -1; or the CUresult of a query that failed. */
int aib_cuda_devices_of(const aib_cuda_column *columns, size_t n, int32_t *device_out, int32_t *other_out,
                        size_t *failed);
/* The producer's table of regions it made, keyed by CUDA buffer id (never reused in a process). */
typedef struct aib_export_regions aib_export_regions;
aib_export_regions *aib_export_regions_new(size_t capacity);
void aib_export_regions_free(aib_export_regions *t);
void aib_export_regions_clear(aib_export_regions *t);
/* Remembers region for the allocation buffer_id on device (replacing an entry); a full table is
 * cleared first. AIB_E_FORMAT for buffer id 0 or an over-long handle. */
int aib_export_regions_put(aib_export_regions *t, uint64_t buffer_id, int32_t device, const aib_region *region);
void aib_export_regions_stats(aib_export_regions *t, uint64_t *entries, uint64_t *hits, uint64_t *misses);
/* The placement of d's unplaced buffers: one walk over them, one attribute query per allocation. An
 * allocation's region is the one the caller made for this message (made[k] for buffer id made_ids[k],
 * n_made of them; both may be NULL when n_made is 0) or else the table's (t NULL: none; its pool
 * regions only when pool_regions_allowed), and only for device memory of `device` that is not managed. Returns 0, or -1 when max_regions <
 * the buffer slots (regions_out holds max_regions regions, missing_out 3 * max_regions words) or
 * memory runs out. When every allocation has its region: the slots are placed, regions_out holds the
 * *n_regions regions in the order of their allocations' addresses, *n_buffers the buffers placed,
 * *n_missing 0. Otherwise nothing is placed and missing_out holds *n_missing triples: the address of an
 * allocation's first unplaced buffer, the allocation's base and size (0 0: the driver could not say);
 * the caller makes their regions (or raises) and calls again. */
int aib_cuda_place(aib_export_regions *t, aib_described *d, int32_t device, int pool_regions_allowed,
                   const uint64_t *made_ids, const aib_region *made, size_t n_made, aib_region *regions_out,
                   uint64_t *missing_out, size_t max_regions, size_t *n_regions, size_t *n_buffers,
                   size_t *n_missing);
/* ---------- sync events handed out only while pending (sync_event.c) -----------------------------
 * For the bridge's own imported data: sync_event (a pointer to a CUevent, as the C Device interface
 * has it) unless the driver says its recording completed, then NULL. Unchanged when no query
 * function is set, for other device types, or when the query fails. Counts both outcomes. */
void *aib_sync_event_if_pending(int32_t device_type, void *sync_event);
void aib_sync_event_stats(uint64_t *pending, uint64_t *complete);

#endif
