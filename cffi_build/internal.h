/* Declarations shared between the C core's translation units; not part of the cffi surface. */
#ifndef AIB_INTERNAL_H
#define AIB_INTERNAL_H
#include <stdarg.h>
#include <stdatomic.h>
#include <time.h>
#include "bridge.h"

/* Sets err (when non-NULL) and returns code. printf-style message. */
int aib_fail(aib_error *err, int code, const char *field, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

extern atomic_llong aib_node_counter;

/* Length in bytes of an ArrowSchema metadata blob (int32 count, then int32-prefixed keys/values),
 * read from trusted in-process memory. 0 for NULL. */
size_t aib_metadata_length(const char *metadata);

/* The owner owns a decoded message and frees it when it dies (see aib_owner_attach_decoded). */
void aib_decoded_release_internal(aib_decoded *d);


/* Where an imported message's regions start in this process, and on which device: what a struct
 * rebuilt from the owner's decode needs besides it (aib_owner_set_view). */
typedef struct aib_view {
  const uint64_t *bases;
  size_t n_bases;
  int32_t device_type;
  int64_t device_id;
  uint64_t storage[];
} aib_view;
const aib_view *aib_owner_view(aib_owner *owner);
/* Integers on the wire are little-endian whatever the host's byte order (wire_*.c, channel.c, serve.c,
 * remembered.c). */
/* CLOCK_MONOTONIC in nanoseconds (time.monotonic()'s clock on Linux): the one clock of the core's
 * deadlines (channel.c), lingers (remembered.c) and spins (board.c). */
static inline int64_t aib_monotonic_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void aib_store_u32le(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint32_t aib_load_u32le(const uint8_t *p) {
  return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline void aib_store_u64le(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint64_t aib_load_u64le(const uint8_t *p) {
  return (uint64_t)aib_load_u32le(p) | ((uint64_t)aib_load_u32le(p + 4) << 32);
}

/* FNV-1a over bytes (8 at a time), for the core's hash tables (remembered.c, serve.c). */
uint64_t aib_hash_bytes(const uint8_t *p, size_t n);

/* A 1-D DLPack managed tensor over data that holds a reference on owner; its deleter drops it.
 * NULL when out of memory. py_capsules.c wraps it in a "dltensor" capsule. */
DLManagedTensor *aib_dlpack_new(aib_owner *owner, uint64_t data, int32_t device_type, int32_t device_id,
                                uint8_t code, uint8_t bits, int64_t length);
/* The same in the versioned ABI (DLPack 1.x, "dltensor_versioned" capsules); flags are
 * AIB_DLPACK_FLAG_* (READ_ONLY for memory the consumer must not write). */
DLManagedTensorVersioned *aib_dlpack_versioned_new(aib_owner *owner, uint64_t data, int32_t device_type,
                                                   int32_t device_id, uint8_t code, uint8_t bits, int64_t length,
                                                   uint64_t flags);

/* One top-level column of an imported batch, as a plain array sees it (columns.c). */
typedef struct aib_column_fact {
  const char *name; /* in the decode (not NUL-terminated: name_len bytes), valid while it lives */
  size_t name_len;
  int numeric;        /* index of its type in columns.c's numeric table (int8..float64), -1: none */
  int64_t length;     /* rows */
  int64_t null_count; /* -1: unknown, or the rows themselves have nulls */
  uint64_t data;      /* address of the first value in this process; 0 when there is none (no rows) */
} aib_column_fact;
/* The columns of batch `batch` of a decode (a struct root's children, else the root alone), with
 * the regions' bases in this process: AIB_E_STATE for a batch out of range or a column's region not
 * mapped, AIB_E_LIMIT when there are more than capacity columns (*n_out is then 0). */
/* Whether the root is a struct (a record batch: its children are the columns), and how many columns. */
int aib_decoded_is_record_batch(const aib_decoded *d);
size_t aib_decoded_column_count(const aib_decoded *d);
int aib_decoded_columns(const aib_decoded *d, int64_t batch, const uint64_t *bases, size_t n_bases,
                        aib_column_fact *out, size_t capacity, size_t *n_out, aib_error *err);
/* The DLPack type (code, bits) of a numeric index from aib_decoded_columns; 0 when there is none. */
int aib_numeric_dlpack_type(int numeric, uint8_t *code, uint8_t *bits);

/* The driver's cuEventQuery as set by aib_cuda_set_driver (cuda_batch.c), or 0. */
uintptr_t aib_cuda_event_query(void);
/* The driver's cuPointerGetAttributes as set by aib_cuda_set_driver, or 0 (cuda_export.c). */
uintptr_t aib_cuda_pointer_get_attributes(void);

/* The owner takes decoded over and frees it with release when it dies (AIB_E_STATE when it holds
 * one already). wire_decode.c's aib_owner_attach_decoded passes the decoder's release, so that owner.c,
 * below the decoder, never calls into it. */
int aib_owner_hold_decoded(aib_owner *owner, aib_decoded *decoded, void (*release)(aib_decoded *));
/* A capture owner's producer schema and device arrays (n returned); *schema NULL for other owners. */
int64_t aib_owner_capture(aib_owner *owner, const struct ArrowSchema **schema, struct ArrowDeviceArray ***arrays);

/* Sets the reaper token of an owner nobody else references yet. */
void aib_owner_set_token(aib_owner *owner, uint64_t token);

int aib_layout_is_validity(const aib_layout *layout, int64_t i);

/* Everything a served stream needs to produce batch i. */
typedef int (*aib_batch_maker)(void *ctx, int64_t index, struct ArrowArray *out, aib_error *err);

#endif
