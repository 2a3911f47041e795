/* The struct trees the core hands out over data it does not copy: schema copies, arrays sharing a
 * captured producer's buffers, streams served over captured or imported data, DLPack tensors.
 *
 * Rules (docs/c-core.md):
 *  - every node of a tree we build holds its own reference on the owner, so a consumer may move a
 *    child out and release the parent;
 *  - release callbacks never take the GIL and never call into Python: they may run on any thread
 *    (cuDF releases from C++ threads); they free() and drop owner references, nothing else. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* ---------- schema copies ----------------------------------------------------------------------- */
/* One allocation per schema node: the private block holds child pointers, child structs, the
 * dictionary struct and the node's strings, so release is one free() per node. */
typedef struct schema_block {
  struct ArrowSchema **children;
  struct ArrowSchema *dictionary;
} schema_block;

static void release_schema_node(struct ArrowSchema *s) {
  if (s == NULL || s->release == NULL) return;
  for (int64_t i = 0; i < s->n_children; i++) {
    struct ArrowSchema *c = s->children[i];
    if (c->release != NULL) c->release(c);
  }
  if (s->dictionary != NULL && s->dictionary->release != NULL) s->dictionary->release(s->dictionary);
  free(s->private_data);
  atomic_fetch_sub(&aib_node_counter, 1);
  s->release = NULL;
}

/* Node constructors of the schema copy and the array share (a rebuild makes a whole tree in one
 * allocation instead: wire_rebuild.c). Allocates the node block and fills the strings; children and
 * dictionary are left zeroed for the caller to fill. metadata may be NULL. Returns AIB_E_NOMEM. */
static int schema_node_init(struct ArrowSchema *dst, const char *format, size_t format_len, const char *name,
                            size_t name_len, int has_name, const char *metadata, size_t metadata_len,
                            int64_t flags, int64_t n_children, int has_dictionary) {
  size_t size = sizeof(schema_block) + (size_t)n_children * (sizeof(struct ArrowSchema *) + sizeof(struct ArrowSchema)) +
                (has_dictionary ? sizeof(struct ArrowSchema) : 0) + format_len + 1 + name_len + 1 + metadata_len;
  char *block = calloc(1, size);
  if (block == NULL) return AIB_E_NOMEM;
  schema_block *b = (schema_block *)block;
  char *cursor = block + sizeof(schema_block);
  b->children = (struct ArrowSchema **)cursor;
  cursor += (size_t)n_children * sizeof(struct ArrowSchema *);
  struct ArrowSchema *child_structs = (struct ArrowSchema *)cursor;
  cursor += (size_t)n_children * sizeof(struct ArrowSchema);
  for (int64_t i = 0; i < n_children; i++) b->children[i] = &child_structs[i];
  if (has_dictionary) {
    b->dictionary = (struct ArrowSchema *)cursor;
    cursor += sizeof(struct ArrowSchema);
  }
  char *fmt = cursor;
  memcpy(fmt, format, format_len);
  cursor += format_len + 1;
  char *nm = cursor;
  memcpy(nm, name, name_len);
  cursor += name_len + 1;
  char *md = NULL;
  if (metadata_len > 0) {
    md = cursor;
    memcpy(md, metadata, metadata_len);
  }
  memset(dst, 0, sizeof(*dst));
  dst->format = fmt;
  dst->name = has_name ? nm : NULL;
  dst->metadata = md;
  dst->flags = flags;
  dst->n_children = n_children;
  dst->children = n_children ? b->children : NULL;
  dst->dictionary = b->dictionary;
  dst->private_data = block;
  dst->release = release_schema_node;
  atomic_fetch_add(&aib_node_counter, 1);
  return AIB_OK;
}

static int schema_copy_node(const struct ArrowSchema *src, struct ArrowSchema *dst, int depth, aib_error *err) {
  if (depth > AIB_MAX_DEPTH) return aib_fail(err, AIB_E_LIMIT, "depth", "", "schema nesting deeper than %d", AIB_MAX_DEPTH);
  if (src->release == NULL) return aib_fail(err, AIB_E_RELEASED, "release", "", "schema was already released");
  int rc = schema_node_init(dst, src->format, strlen(src->format), src->name ? src->name : "",
                                src->name ? strlen(src->name) : 0, src->name != NULL, src->metadata,
                                aib_metadata_length(src->metadata), src->flags, src->n_children,
                                src->dictionary != NULL);
  if (rc != AIB_OK) return aib_fail(err, rc, "", "", "out of memory copying a schema");
  for (int64_t i = 0; i < src->n_children; i++) {
    rc = schema_copy_node(src->children[i], dst->children[i], depth + 1, err);
    if (rc != AIB_OK) {
      release_schema_node(dst);
      return rc;
    }
  }
  if (src->dictionary != NULL) {
    rc = schema_copy_node(src->dictionary, dst->dictionary, depth + 1, err);
    if (rc != AIB_OK) {
      release_schema_node(dst);
      return rc;
    }
  }
  return AIB_OK;
}

int aib_schema_copy(const struct ArrowSchema *src, struct ArrowSchema *dst, aib_error *err) {
  if (dst->release != NULL) return aib_fail(err, AIB_E_STATE, "", "", "destination schema is not released");
  return schema_copy_node(src, dst, 0, err);
}

/* ---------- array trees we build ---------------------------------------------------------------- */
typedef struct array_block {
  aib_owner *owner;
} array_block;

static void release_array_node(struct ArrowArray *a) {
  if (a == NULL || a->release == NULL) return;
  for (int64_t i = 0; i < a->n_children; i++) {
    struct ArrowArray *c = a->children[i];
    if (c->release != NULL) c->release(c);
  }
  if (a->dictionary != NULL && a->dictionary->release != NULL) a->dictionary->release(a->dictionary);
  array_block *b = a->private_data;
  aib_owner *owner = b->owner;
  free(b);
  atomic_fetch_sub(&aib_node_counter, 1);
  a->release = NULL;
  aib_owner_unref(owner);
}

/* Allocates one node with room for its buffer pointers, children and dictionary; takes a reference
 * on owner. Buffers are left NULL, children zeroed, for the caller to fill. */
static int array_node_init(struct ArrowArray *dst, aib_owner *owner, int64_t length, int64_t null_count,
                           int64_t offset, int64_t n_buffers, int64_t n_children, int has_dictionary) {
  size_t size = sizeof(array_block) + (size_t)n_buffers * sizeof(void *) +
                (size_t)n_children * (sizeof(struct ArrowArray *) + sizeof(struct ArrowArray)) +
                (has_dictionary ? sizeof(struct ArrowArray) : 0);
  char *block = calloc(1, size);
  if (block == NULL) return AIB_E_NOMEM;
  array_block *b = (array_block *)block;
  char *cursor = block + sizeof(array_block);
  const void **buffers = (const void **)cursor;
  cursor += (size_t)n_buffers * sizeof(void *);
  struct ArrowArray **children = (struct ArrowArray **)cursor;
  cursor += (size_t)n_children * sizeof(struct ArrowArray *);
  struct ArrowArray *child_structs = (struct ArrowArray *)cursor;
  cursor += (size_t)n_children * sizeof(struct ArrowArray);
  for (int64_t i = 0; i < n_children; i++) children[i] = &child_structs[i];
  memset(dst, 0, sizeof(*dst));
  dst->length = length;
  dst->null_count = null_count;
  dst->offset = offset;
  dst->n_buffers = n_buffers;
  dst->n_children = n_children;
  dst->buffers = n_buffers ? buffers : NULL;
  dst->children = n_children ? children : NULL;
  dst->dictionary = has_dictionary ? (struct ArrowArray *)cursor : NULL;
  b->owner = owner;
  aib_owner_ref(owner);
  dst->private_data = block;
  dst->release = release_array_node;
  atomic_fetch_add(&aib_node_counter, 1);
  return AIB_OK;
}

static int array_share_node(const struct ArrowArray *src, aib_owner *owner, struct ArrowArray *dst, int depth,
                            aib_error *err) {
  if (depth > AIB_MAX_DEPTH) return aib_fail(err, AIB_E_LIMIT, "depth", "", "array nesting deeper than %d", AIB_MAX_DEPTH);
  if (src->release == NULL) return aib_fail(err, AIB_E_RELEASED, "release", "", "array was already released");
  int rc = array_node_init(dst, owner, src->length, src->null_count, src->offset, src->n_buffers,
                               src->n_children, src->dictionary != NULL);
  if (rc != AIB_OK) return aib_fail(err, rc, "", "", "out of memory sharing an array");
  for (int64_t i = 0; i < src->n_buffers; i++) dst->buffers[i] = src->buffers[i];
  for (int64_t i = 0; i < src->n_children; i++) {
    rc = array_share_node(src->children[i], owner, dst->children[i], depth + 1, err);
    if (rc != AIB_OK) {
      release_array_node(dst);
      return rc;
    }
  }
  if (src->dictionary != NULL) {
    rc = array_share_node(src->dictionary, owner, dst->dictionary, depth + 1, err);
    if (rc != AIB_OK) {
      release_array_node(dst);
      return rc;
    }
  }
  return AIB_OK;
}

int aib_array_share(const struct ArrowArray *src, aib_owner *owner, struct ArrowArray *dst, aib_error *err) {
  if (dst->release != NULL) return aib_fail(err, AIB_E_STATE, "", "", "destination array is not released");
  return array_share_node(src, owner, dst, 0, err);
}

/* ---------- served streams ---------------------------------------------------------------------- */
typedef struct served_stream {
  struct ArrowSchema schema;
  aib_owner *owner;
  /* batch source: either shared captured arrays or rebuilds from the owner's decoded message */
  struct ArrowDeviceArray **arrays; /* borrowed from the capture owner, which the stream keeps alive */
  uint64_t *bases;
  size_t n_bases;
  int64_t n_batches;
  int64_t next;
  int32_t device_type;
  int64_t device_id;
  void *sync_event;
  aib_error error;
} served_stream;

static int served_make(served_stream *s, struct ArrowArray *out) {
  s->error.code = 0;
  if (s->arrays != NULL) return aib_array_share(&s->arrays[s->next]->array, s->owner, out, &s->error);
  return aib_rebuild_array(aib_owner_decoded(s->owner), s->next, s->bases, s->n_bases, s->owner, out, &s->error);
}

static void served_free(served_stream *s) {
  if (s->schema.release != NULL) s->schema.release(&s->schema);
  free(s->bases);
  aib_owner *owner = s->owner;
  free(s);
  aib_owner_unref(owner);
}

static int errno_for(int code) {
  switch (code) {
    case AIB_E_NOMEM: return ENOMEM;
    case AIB_E_RELEASED:
    case AIB_E_STATE: return EINVAL;
    default: return EIO;
  }
}

static int dstream_get_schema(struct ArrowDeviceArrayStream *st, struct ArrowSchema *out) {
  served_stream *s = st->private_data;
  int rc = aib_schema_copy(&s->schema, out, &s->error);
  return rc == AIB_OK ? 0 : errno_for(rc);
}
static int dstream_get_next(struct ArrowDeviceArrayStream *st, struct ArrowDeviceArray *out) {
  served_stream *s = st->private_data;
  memset(out, 0, sizeof(*out));
  if (s->next >= s->n_batches) return 0; /* end of stream: out->array.release stays NULL */
  int rc = served_make(s, &out->array);
  if (rc != AIB_OK) return errno_for(rc);
  out->device_type = s->device_type;
  out->device_id = s->device_id;
  /* Imported data (no captured arrays): the bridge's own event, handed out only while pending. */
  out->sync_event = s->arrays == NULL ? aib_sync_event_if_pending(s->device_type, s->sync_event) : s->sync_event;
  s->next++;
  return 0;
}
static const char *dstream_last_error(struct ArrowDeviceArrayStream *st) {
  served_stream *s = st->private_data;
  return s->error.code ? s->error.message : NULL;
}
static void dstream_release(struct ArrowDeviceArrayStream *st) {
  if (st == NULL || st->release == NULL) return;
  served_free(st->private_data);
  st->release = NULL;
}

static int stream_get_schema(struct ArrowArrayStream *st, struct ArrowSchema *out) {
  served_stream *s = st->private_data;
  int rc = aib_schema_copy(&s->schema, out, &s->error);
  return rc == AIB_OK ? 0 : errno_for(rc);
}
static int stream_get_next(struct ArrowArrayStream *st, struct ArrowArray *out) {
  served_stream *s = st->private_data;
  memset(out, 0, sizeof(*out));
  if (s->next >= s->n_batches) return 0;
  int rc = served_make(s, out);
  if (rc != AIB_OK) return errno_for(rc);
  s->next++;
  return 0;
}
static const char *stream_last_error(struct ArrowArrayStream *st) {
  served_stream *s = st->private_data;
  return s->error.code ? s->error.message : NULL;
}
static void stream_release(struct ArrowArrayStream *st) {
  if (st == NULL || st->release == NULL) return;
  served_free(st->private_data);
  st->release = NULL;
}

static void install_device_stream(struct ArrowDeviceArrayStream *out, served_stream *s) {
  memset(out, 0, sizeof(*out));
  out->device_type = s->device_type;
  out->get_schema = dstream_get_schema;
  out->get_next = dstream_get_next;
  out->get_last_error = dstream_last_error;
  out->release = dstream_release;
  out->private_data = s;
}

static void install_host_stream(struct ArrowArrayStream *out, served_stream *s) {
  memset(out, 0, sizeof(*out));
  out->get_schema = stream_get_schema;
  out->get_next = stream_get_next;
  out->get_last_error = stream_last_error;
  out->release = stream_release;
  out->private_data = s;
}

static served_stream *served_new(const struct ArrowSchema *schema, aib_owner *owner, aib_error *err) {
  served_stream *s = calloc(1, sizeof(*s));
  if (s == NULL) {
    aib_fail(err, AIB_E_NOMEM, "", "", "out of memory creating a stream");
    return NULL;
  }
  if (aib_schema_copy(schema, &s->schema, err) != AIB_OK) {
    free(s);
    return NULL;
  }
  s->owner = owner;
  aib_owner_ref(owner);
  return s;
}

/* A stream over the batches an owner captured (both stream flavours serve those); NULL with err set. */
static served_stream *served_from_capture(aib_owner *owner, int out_released, aib_error *err) {
  if (!out_released) {
    aib_fail(err, AIB_E_STATE, "", "", "destination stream is not released");
    return NULL;
  }
  const struct ArrowSchema *schema;
  struct ArrowDeviceArray **arrays;
  int64_t n_arrays = aib_owner_capture(owner, &schema, &arrays);
  if (schema == NULL) {
    aib_fail(err, AIB_E_STATE, "", "", "owner holds no captured data");
    return NULL;
  }
  served_stream *s = served_new(schema, owner, err);
  if (s == NULL) return NULL;
  s->arrays = arrays;
  s->n_batches = n_arrays;
  return s;
}

int aib_device_stream_from_capture(aib_owner *owner, struct ArrowDeviceArrayStream *out, aib_error *err) {
  served_stream *s = served_from_capture(owner, out->release == NULL, err);
  if (s == NULL) return err ? err->code : AIB_E_NOMEM;
  /* A stream has one device: the batches of a captured stream all come from one producer stream. */
  s->device_type = s->n_batches ? s->arrays[0]->device_type : ARROW_DEVICE_CPU;
  s->device_id = s->n_batches ? s->arrays[0]->device_id : -1;
  s->sync_event = s->n_batches ? s->arrays[0]->sync_event : NULL;
  install_device_stream(out, s);
  return AIB_OK;
}

int aib_stream_from_capture(aib_owner *owner, struct ArrowArrayStream *out, aib_error *err) {
  served_stream *s = served_from_capture(owner, out->release == NULL, err);
  if (s == NULL) return err ? err->code : AIB_E_NOMEM;
  install_host_stream(out, s);
  return AIB_OK;
}

static served_stream *served_from_decoded(aib_owner *owner, const uint64_t *bases, size_t n_bases, aib_error *err) {
  aib_decoded *d = aib_owner_decoded(owner);
  if (d == NULL) {
    aib_fail(err, AIB_E_STATE, "", "", "owner has no decoded message attached");
    return NULL;
  }
  struct ArrowSchema schema = {0};
  if (aib_rebuild_schema(d, &schema, err) != AIB_OK) return NULL;
  served_stream *s = calloc(1, sizeof(*s));
  uint64_t *copy = calloc(n_bases ? n_bases : 1, sizeof(uint64_t));
  if (s == NULL || copy == NULL) {
    free(s);
    free(copy);
    schema.release(&schema);
    aib_fail(err, AIB_E_NOMEM, "", "", "out of memory creating a stream");
    return NULL;
  }
  memcpy(copy, bases, n_bases * sizeof(uint64_t));
  s->schema = schema;
  s->bases = copy;
  s->n_bases = n_bases;
  s->n_batches = aib_decoded_batch_count(d);
  s->owner = owner;
  aib_owner_ref(owner);
  return s;
}

int aib_device_stream_from_decoded(aib_owner *owner, const uint64_t *region_bases, size_t n_bases,
                                   int32_t device_type, int64_t device_id, void *sync_event,
                                   struct ArrowDeviceArrayStream *out, aib_error *err) {
  if (out->release != NULL) return aib_fail(err, AIB_E_STATE, "", "", "destination stream is not released");
  served_stream *s = served_from_decoded(owner, region_bases, n_bases, err);
  if (s == NULL) return err ? err->code : AIB_E_NOMEM;
  s->device_type = device_type;
  s->device_id = device_id;
  s->sync_event = sync_event;
  install_device_stream(out, s);
  return AIB_OK;
}

int aib_stream_from_decoded(aib_owner *owner, const uint64_t *region_bases, size_t n_bases,
                            struct ArrowArrayStream *out, aib_error *err) {
  if (out->release != NULL) return aib_fail(err, AIB_E_STATE, "", "", "destination stream is not released");
  served_stream *s = served_from_decoded(owner, region_bases, n_bases, err);
  if (s == NULL) return err ? err->code : AIB_E_NOMEM;
  install_host_stream(out, s);
  return AIB_OK;
}

/* ---------- DLPack ------------------------------------------------------------------------------
 * A 1-D tensor over memory the core does not copy, in either ABI: the legacy DLManagedTensor (0.x)
 * or the versioned DLManagedTensorVersioned (1.x). One allocation holds the managed tensor, its
 * shape and the owner reference its deleter drops. */
typedef struct dlpack_block {
  DLManagedTensor tensor;
  int64_t shape[1];
  aib_owner *owner;
} dlpack_block;

typedef struct dlpack_versioned_block {
  DLManagedTensorVersioned tensor;
  int64_t shape[1];
  aib_owner *owner;
} dlpack_versioned_block;

static void dlpack_delete(DLManagedTensor *self) {
  if (self == NULL) return;
  dlpack_block *b = (dlpack_block *)self;
  aib_owner *owner = b->owner;
  free(b);
  aib_owner_unref(owner);
}

static void dlpack_versioned_delete(DLManagedTensorVersioned *self) {
  if (self == NULL) return;
  dlpack_versioned_block *b = (dlpack_versioned_block *)self;
  aib_owner *owner = b->owner;
  free(b);
  aib_owner_unref(owner);
}

static void dlpack_fill(DLTensor *t, int64_t *shape, uint64_t data, int32_t device_type, int32_t device_id,
                        uint8_t code, uint8_t bits, int64_t length) {
  shape[0] = length;
  t->data = (void *)(uintptr_t)data;
  t->device.device_type = device_type;
  t->device.device_id = device_id;
  t->ndim = 1;
  t->dtype.code = code;
  t->dtype.bits = bits;
  t->dtype.lanes = 1;
  t->shape = shape;
  t->strides = NULL; /* compact row-major */
  t->byte_offset = 0;
}

DLManagedTensor *aib_dlpack_new(aib_owner *owner, uint64_t data, int32_t device_type, int32_t device_id,
                                uint8_t code, uint8_t bits, int64_t length) {
  dlpack_block *b = calloc(1, sizeof(*b));
  if (b == NULL) return NULL;
  dlpack_fill(&b->tensor.dl_tensor, b->shape, data, device_type, device_id, code, bits, length);
  b->owner = owner;
  aib_owner_ref(owner);
  b->tensor.manager_ctx = b;
  b->tensor.deleter = dlpack_delete;
  return &b->tensor;
}

DLManagedTensorVersioned *aib_dlpack_versioned_new(aib_owner *owner, uint64_t data, int32_t device_type,
                                                   int32_t device_id, uint8_t code, uint8_t bits, int64_t length,
                                                   uint64_t flags) {
  dlpack_versioned_block *b = calloc(1, sizeof(*b));
  if (b == NULL) return NULL;
  dlpack_fill(&b->tensor.dl_tensor, b->shape, data, device_type, device_id, code, bits, length);
  b->owner = owner;
  aib_owner_ref(owner);
  b->tensor.version.major = AIB_DLPACK_MAJOR;
  b->tensor.version.minor = AIB_DLPACK_MINOR;
  b->tensor.flags = flags;
  b->tensor.manager_ctx = b;
  b->tensor.deleter = dlpack_versioned_delete;
  return &b->tensor;
}
