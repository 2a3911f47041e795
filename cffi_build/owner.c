/* Ownership in the C core: owners (reference-counted lifetime records), the reaper queue that tells
 * Python an owner died, struct allocation and moves, and the struct trees
 * the core hands out (shared arrays, copied schemas, served streams).
 *
 * Rules (docs/c-core.md):
 *  - every struct we allocate starts zeroed (release == NULL);
 *  - every node of a tree we build holds its own reference on the owner, so a consumer may move a
 *    child out and release the parent;
 *  - release callbacks never take the GIL and never call into Python: they may run on any thread
 *    (cuDF releases from C++ threads), so the only thing they do besides free() and munmap() is push
 *    a token onto a mutex-protected queue and write one byte to a pipe. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"

#ifndef AIB_VERSION
#error "AIB_VERSION must be defined by the build (build_bridge.py)"
#endif

const char *aib_core_version(void) { return AIB_VERSION; }

int aib_fail(aib_error *err, int code, const char *field, const char *path, const char *fmt, ...) {
  if (err != NULL) {
    err->code = code;
    snprintf(err->field, sizeof(err->field), "%s", field ? field : "");
    snprintf(err->path, sizeof(err->path), "%s", path ? path : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof(err->message), fmt, ap);
    va_end(ap);
  }
  return code;
}

/* ---------- leak accounting --------------------------------------------------------------------- */
static atomic_llong live_owners;
static atomic_llong live_mappings;
atomic_llong aib_node_counter;

int64_t aib_live_owners(void) { return atomic_load(&live_owners); }
int64_t aib_live_nodes(void) { return atomic_load(&aib_node_counter); }
int64_t aib_live_mappings(void) { return atomic_load(&live_mappings); }

/* ---------- reaper queue ------------------------------------------------------------------------ */
static pthread_mutex_t reaper_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t reaper_once = PTHREAD_ONCE_INIT;
static int reaper_pipe[2] = {-1, -1};
static uint64_t *reaper_tokens;
static size_t reaper_len, reaper_cap;

/* In a child of fork: the queue holds the parent's owners' deaths (their callbacks would act on
 * the parent's connections), the lock may have been held by a parent thread, and the pipe is
 * shared with the parent, whose reaper thread would lose its wake-ups to our reads. The child
 * starts with an empty queue, a fresh lock and a pipe of its own. */
static void reaper_after_fork_child(void) {
  pthread_mutex_init(&reaper_lock, NULL);
  reaper_len = 0;
  int fresh[2];
  if (pipe2(fresh, O_CLOEXEC | O_NONBLOCK) != 0) fresh[0] = fresh[1] = -1;
  int old_read = reaper_pipe[0], old_write = reaper_pipe[1];
  reaper_pipe[0] = fresh[0];
  reaper_pipe[1] = fresh[1];
  if (old_read >= 0) close(old_read);
  if (old_write >= 0) close(old_write);
}

static void reaper_init(void) {
  if (pipe2(reaper_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    reaper_pipe[0] = reaper_pipe[1] = -1;
  }
  pthread_atfork(NULL, NULL, reaper_after_fork_child);
}

int aib_reaper_fd(void) {
  pthread_once(&reaper_once, reaper_init);
  return reaper_pipe[0];
}

/* Set by a thread that drains the queue itself right after (ImportedArray.release): its pushes skip
 * the wake-up write, so the reaper thread is not woken to contend for the GIL for nothing. */
static _Thread_local int reaper_quiet;

void aib_reaper_quiet(int on) { reaper_quiet = on; }

static void reaper_push(uint64_t token) {
  pthread_once(&reaper_once, reaper_init);
  pthread_mutex_lock(&reaper_lock);
  if (reaper_len == reaper_cap) {
    size_t cap = reaper_cap ? reaper_cap * 2 : 256;
    uint64_t *grown = realloc(reaper_tokens, cap * sizeof(uint64_t));
    if (grown == NULL) {
      /* Out of memory while reporting a death: the token is lost, which only delays the lease
       * release until the session closes. Nothing here may fail loudly (we are in a release). */
      pthread_mutex_unlock(&reaper_lock);
      return;
    }
    reaper_tokens = grown;
    reaper_cap = cap;
  }
  reaper_tokens[reaper_len++] = token;
  pthread_mutex_unlock(&reaper_lock);
  if (reaper_pipe[1] >= 0 && !reaper_quiet) {
    char byte = 1;
    /* A full pipe is fine: the reader drains every queued token per wake-up. */
    ssize_t ignored = write(reaper_pipe[1], &byte, 1);
    (void)ignored;
  }
}

size_t aib_reaper_drain(uint64_t *tokens_out, size_t max) {
  pthread_once(&reaper_once, reaper_init);
  char sink[256];
  while (reaper_pipe[0] >= 0 && read(reaper_pipe[0], sink, sizeof(sink)) > 0) {
  }
  pthread_mutex_lock(&reaper_lock);
  size_t n = reaper_len < max ? reaper_len : max;
  memcpy(tokens_out, reaper_tokens, n * sizeof(uint64_t));
  memmove(reaper_tokens, reaper_tokens + n, (reaper_len - n) * sizeof(uint64_t));
  reaper_len -= n;
  int more = reaper_len > 0;
  pthread_mutex_unlock(&reaper_lock);
  if (more && reaper_pipe[1] >= 0) {
    char byte = 1;
    ssize_t ignored = write(reaper_pipe[1], &byte, 1);
    (void)ignored;
  }
  return n;
}

static void *release_thread_main(void *arg) {
  struct ArrowArray *a = arg;
  if (a->release != NULL) a->release(a);
  return NULL;
}

int aib_debug_release_on_thread(struct ArrowArray *array) {
  pthread_t thread;
  int rc = pthread_create(&thread, NULL, release_thread_main, array);
  if (rc != 0) return rc;
  return pthread_join(thread, NULL);
}

/* ---------- owners ------------------------------------------------------------------------------ */
struct aib_owner {
  atomic_llong refs;
  uint64_t token;
  void *map_address; /* mapping owners */
  size_t map_length;
  struct ArrowSchema *schema; /* capture owners */
  struct ArrowDeviceArray **arrays;
  int64_t n_arrays;
  aib_decoded *decoded;
  aib_decoded *shared_decoded; /* borrowed from a dependency (aib_owner_share_decoded) */
  void *host_buffer; /* host-buffer owners */
  uint64_t slot;
  aib_owner **deps;
  int n_deps, cap_deps;
  const aib_view *view; /* where the decoded message's regions are here; own_view or a source's */
  aib_view *own_view;
};

static aib_owner *owner_alloc(uint64_t token) {
  aib_owner *o = calloc(1, sizeof(*o));
  if (o == NULL) return NULL;
  atomic_init(&o->refs, 1);
  o->token = token;
  atomic_fetch_add(&live_owners, 1);
  return o;
}

aib_owner *aib_owner_new(uint64_t token) { return owner_alloc(token); }

aib_owner *aib_owner_new_mapping(uint64_t token, int fd, uint64_t file_offset, uint64_t size,
                                 void **address_out, int *errno_out) {
  *address_out = NULL;
  *errno_out = 0;
  if (size == 0 || size > (uint64_t)SIZE_MAX || file_offset > (uint64_t)INT64_MAX) {
    *errno_out = EINVAL;
    return NULL;
  }
  void *address = mmap(NULL, (size_t)size, PROT_READ, MAP_SHARED, fd, (off_t)file_offset);
  if (address == MAP_FAILED) {
    *errno_out = errno;
    return NULL;
  }
  aib_owner *o = owner_alloc(token);
  if (o == NULL) {
    munmap(address, (size_t)size);
    *errno_out = ENOMEM;
    return NULL;
  }
  o->map_address = address;
  o->map_length = (size_t)size;
  atomic_fetch_add(&live_mappings, 1);
  *address_out = address;
  return o;
}

aib_owner *aib_owner_new_capture(uint64_t token, struct ArrowSchema *schema,
                                 struct ArrowDeviceArray **arrays, int64_t n_arrays) {
  aib_owner *o = owner_alloc(token);
  if (o == NULL) return NULL;
  if (n_arrays > 0) {
    o->arrays = calloc((size_t)n_arrays, sizeof(*o->arrays));
    if (o->arrays == NULL) {
      free(o);
      atomic_fetch_sub(&live_owners, 1);
      return NULL;
    }
    memcpy(o->arrays, arrays, (size_t)n_arrays * sizeof(*o->arrays));
  }
  o->schema = schema;
  o->n_arrays = n_arrays;
  return o;
}

aib_owner *aib_owner_new_host_buffer(uint64_t token, uint64_t size, void **address_out) {
  *address_out = NULL;
  if (size > ((uint64_t)1 << 48)) return NULL;
  void *p = NULL;
  if (posix_memalign(&p, 64, size ? (size_t)size : 64) != 0) return NULL;
  aib_owner *o = owner_alloc(token);
  if (o == NULL) {
    free(p);
    return NULL;
  }
  o->host_buffer = p;
  *address_out = p;
  return o;
}

uint64_t *aib_owner_slot(aib_owner *owner) { return &owner->slot; }

int aib_owner_add_dependency(aib_owner *owner, aib_owner *dependency) {
  if (owner->n_deps == owner->cap_deps) {
    int cap = owner->cap_deps ? owner->cap_deps * 2 : 4;
    aib_owner **grown = realloc(owner->deps, (size_t)cap * sizeof(*grown));
    if (grown == NULL) return AIB_E_NOMEM;
    owner->deps = grown;
    owner->cap_deps = cap;
  }
  aib_owner_ref(dependency);
  owner->deps[owner->n_deps++] = dependency;
  return AIB_OK;
}

int aib_owner_copy_dependencies(aib_owner *owner, aib_owner *source, aib_owner *except) {
  for (int i = 0; i < source->n_deps; i++) {
    if (source->deps[i] == except) continue;
    int rc = aib_owner_add_dependency(owner, source->deps[i]);
    if (rc) return rc;
  }
  return AIB_OK;
}

int aib_owner_attach_decoded(aib_owner *owner, aib_decoded *decoded) {
  if (owner->decoded != NULL) return AIB_E_STATE;
  owner->decoded = decoded;
  return AIB_OK;
}

aib_decoded *aib_owner_decoded(aib_owner *owner) {
  return owner->decoded != NULL ? owner->decoded : owner->shared_decoded;
}

int aib_owner_share_decoded(aib_owner *owner, aib_owner *source) {
  aib_decoded *d = aib_owner_decoded(source);
  if (d == NULL || aib_owner_decoded(owner) != NULL) return AIB_E_STATE;
  int rc = aib_owner_add_dependency(owner, source);
  if (rc) return rc;
  owner->shared_decoded = d; /* lives as long as source, which owner now keeps alive */
  owner->view = source->view;  /* likewise */
  return AIB_OK;
}

int aib_owner_set_view(aib_owner *owner, const uint64_t *bases, size_t n_bases, int32_t device_type,
                       int64_t device_id) {
  if (owner->view != NULL) return AIB_E_STATE;
  aib_view *v = malloc(sizeof(*v) + n_bases * sizeof(uint64_t));
  if (v == NULL) return AIB_E_NOMEM;
  if (n_bases) memcpy(v->storage, bases, n_bases * sizeof(uint64_t));
  v->bases = v->storage;
  v->n_bases = n_bases;
  v->device_type = device_type;
  v->device_id = device_id;
  owner->own_view = v;
  owner->view = v;
  return AIB_OK;
}

const aib_view *aib_owner_view(aib_owner *owner) { return owner->view; }

size_t aib_owner_view_bases(aib_owner *owner, const uint64_t **bases, int64_t *device_id) {
  const aib_view *v = owner->view;
  if (v == NULL) {
    *bases = NULL;
    *device_id = -1;
    return 0;
  }
  *bases = v->bases;
  *device_id = v->device_id;
  return v->n_bases;
}

void aib_owner_ref(aib_owner *owner) { atomic_fetch_add_explicit(&owner->refs, 1, memory_order_relaxed); }

int64_t aib_owner_refcount(aib_owner *owner) { return atomic_load(&owner->refs); }
uint64_t aib_owner_token(aib_owner *owner) { return owner->token; }
void aib_owner_set_token(aib_owner *owner, uint64_t token) { owner->token = token; }

void aib_owner_unref(aib_owner *owner) {
  if (owner == NULL) return;
  if (atomic_fetch_sub_explicit(&owner->refs, 1, memory_order_acq_rel) != 1) return;
  /* Last reference: free what this owner keeps alive, then tell Python (token) if it asked. */
  if (owner->map_address != NULL) {
    munmap(owner->map_address, owner->map_length);
    atomic_fetch_sub(&live_mappings, 1);
  }
  for (int64_t i = 0; i < owner->n_arrays; i++) aib_device_array_free(owner->arrays[i]);
  free(owner->arrays);
  aib_schema_free(owner->schema);
  if (owner->decoded != NULL) aib_decoded_release_internal(owner->decoded);
  free(owner->host_buffer);
  free(owner->own_view);
  for (int i = 0; i < owner->n_deps; i++) aib_owner_unref(owner->deps[i]);
  free(owner->deps);
  uint64_t token = owner->token;
  free(owner);
  atomic_fetch_sub(&live_owners, 1);
  if (token != 0) reaper_push(token);
}

/* ---------- allocation and moves ---------------------------------------------------------------- */
struct ArrowSchema *aib_schema_alloc(void) { return calloc(1, sizeof(struct ArrowSchema)); }
struct ArrowArray *aib_array_alloc(void) { return calloc(1, sizeof(struct ArrowArray)); }
struct ArrowDeviceArray *aib_device_array_alloc(void) { return calloc(1, sizeof(struct ArrowDeviceArray)); }
struct ArrowArrayStream *aib_stream_alloc(void) { return calloc(1, sizeof(struct ArrowArrayStream)); }
struct ArrowDeviceArrayStream *aib_device_stream_alloc(void) {
  return calloc(1, sizeof(struct ArrowDeviceArrayStream));
}

void aib_schema_free(struct ArrowSchema *p) {
  if (p == NULL) return;
  if (p->release != NULL) p->release(p);
  free(p);
}
void aib_array_free(struct ArrowArray *p) {
  if (p == NULL) return;
  if (p->release != NULL) p->release(p);
  free(p);
}
void aib_device_array_free(struct ArrowDeviceArray *p) {
  if (p == NULL) return;
  if (p->array.release != NULL) p->array.release(&p->array);
  free(p);
}
void aib_stream_free(struct ArrowArrayStream *p) {
  if (p == NULL) return;
  if (p->release != NULL) p->release(p);
  free(p);
}
void aib_device_stream_free(struct ArrowDeviceArrayStream *p) {
  if (p == NULL) return;
  if (p->release != NULL) p->release(p);
  free(p);
}

#define AIB_MOVE(src, dst, released_field, dst_field)      \
  do {                                                     \
    if ((src)->released_field == NULL) return AIB_E_RELEASED; \
    if ((dst)->dst_field != NULL) return AIB_E_STATE;      \
    memcpy((dst), (src), sizeof(*(dst)));                  \
    (src)->released_field = NULL;                          \
    return AIB_OK;                                         \
  } while (0)

int aib_schema_move(struct ArrowSchema *src, struct ArrowSchema *dst) { AIB_MOVE(src, dst, release, release); }
int aib_array_move(struct ArrowArray *src, struct ArrowArray *dst) { AIB_MOVE(src, dst, release, release); }
int aib_device_array_move(struct ArrowDeviceArray *src, struct ArrowDeviceArray *dst) {
  AIB_MOVE(src, dst, array.release, array.release);
}
int aib_stream_move(struct ArrowArrayStream *src, struct ArrowArrayStream *dst) {
  AIB_MOVE(src, dst, release, release);
}
int aib_device_stream_move(struct ArrowDeviceArrayStream *src, struct ArrowDeviceArrayStream *dst) {
  AIB_MOVE(src, dst, release, release);
}

int aib_array_move_to_device(struct ArrowArray *src, struct ArrowDeviceArray *dst) {
  if (src->release == NULL) return AIB_E_RELEASED;
  if (dst->array.release != NULL) return AIB_E_STATE;
  memset(dst, 0, sizeof(*dst));
  memcpy(&dst->array, src, sizeof(*src));
  src->release = NULL;
  dst->device_type = ARROW_DEVICE_CPU;
  dst->device_id = -1;
  return AIB_OK;
}

/* ---------- schema copies ----------------------------------------------------------------------- */
size_t aib_metadata_length(const char *metadata) {
  if (metadata == NULL) return 0;
  int32_t n;
  memcpy(&n, metadata, 4);
  size_t pos = 4;
  for (int32_t i = 0; i < 2 * n; i++) {
    int32_t len;
    memcpy(&len, metadata + pos, 4);
    pos += 4 + (size_t)len;
  }
  return pos;
}

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
 * allocation instead: wire.c). Allocates the node block and fills the strings; children and
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

int aib_device_stream_from_capture(aib_owner *owner, struct ArrowDeviceArrayStream *out, aib_error *err) {
  if (out->release != NULL) return aib_fail(err, AIB_E_STATE, "", "", "destination stream is not released");
  if (owner->schema == NULL) return aib_fail(err, AIB_E_STATE, "", "", "owner holds no captured data");
  served_stream *s = served_new(owner->schema, owner, err);
  if (s == NULL) return err ? err->code : AIB_E_NOMEM;
  s->arrays = owner->arrays;
  s->n_batches = owner->n_arrays;
  /* A stream has one device: the batches of a captured stream all come from one producer stream. */
  s->device_type = s->n_batches ? s->arrays[0]->device_type : ARROW_DEVICE_CPU;
  s->device_id = s->n_batches ? s->arrays[0]->device_id : -1;
  s->sync_event = s->n_batches ? s->arrays[0]->sync_event : NULL;
  install_device_stream(out, s);
  return AIB_OK;
}

int aib_stream_from_capture(aib_owner *owner, struct ArrowArrayStream *out, aib_error *err) {
  if (out->release != NULL) return aib_fail(err, AIB_E_STATE, "", "", "destination stream is not released");
  if (owner->schema == NULL) return aib_fail(err, AIB_E_STATE, "", "", "owner holds no captured data");
  served_stream *s = served_new(owner->schema, owner, err);
  if (s == NULL) return err ? err->code : AIB_E_NOMEM;
  s->arrays = owner->arrays;
  s->n_batches = owner->n_arrays;
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

/* ---------- DLPack ------------------------------------------------------------------------------ */
typedef struct dlpack_block {
  DLManagedTensor tensor;
  int64_t shape[1];
  aib_owner *owner;
} dlpack_block;

static void dlpack_delete(DLManagedTensor *self) {
  if (self == NULL) return;
  dlpack_block *b = (dlpack_block *)self;
  aib_owner *owner = b->owner;
  free(b);
  aib_owner_unref(owner);
}

DLManagedTensor *aib_dlpack_new(aib_owner *owner, uint64_t data, int32_t device_type, int32_t device_id,
                                uint8_t code, uint8_t bits, int64_t length) {
  dlpack_block *b = calloc(1, sizeof(*b));
  if (b == NULL) return NULL;
  b->shape[0] = length;
  b->owner = owner;
  aib_owner_ref(owner);
  b->tensor.dl_tensor.data = (void *)(uintptr_t)data;
  b->tensor.dl_tensor.device.device_type = device_type;
  b->tensor.dl_tensor.device.device_id = device_id;
  b->tensor.dl_tensor.ndim = 1;
  b->tensor.dl_tensor.dtype.code = code;
  b->tensor.dl_tensor.dtype.bits = bits;
  b->tensor.dl_tensor.dtype.lanes = 1;
  b->tensor.dl_tensor.shape = b->shape;
  b->tensor.dl_tensor.strides = NULL; /* compact row-major */
  b->tensor.manager_ctx = b;
  b->tensor.deleter = dlpack_delete;
  return &b->tensor;
}
