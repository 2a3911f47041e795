/* Ownership in the C core: owners (reference-counted lifetime records), the reaper queue that tells
 * Python an owner died, and the allocation and moves of the C Data Interface structs. The struct
 * trees handed out over owned data are struct_trees.c's, capsules py_capsules.c's.
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
/* Wake-up bytes written to the pipe and not read yet, counted after each write: a drain reads the
 * pipe only when some were (a release on a quiet thread, the common case, wrote none, so its drain
 * makes no system call). Counted after the write, so a drain that sees the count finds the byte. */
static atomic_long reaper_pipe_bytes;


/* In a child of fork: the queue holds the parent's owners' deaths (their callbacks would act on
 * the parent's connections), the lock may have been held by a parent thread, and the pipe is
 * shared with the parent, whose reaper thread would lose its wake-ups to our reads. The child
 * starts with an empty queue, a fresh lock and a pipe of its own. */
static void reaper_after_fork_child(void) {
  pthread_mutex_init(&reaper_lock, NULL);
  reaper_len = 0;
  atomic_store(&reaper_pipe_bytes, 0); /* the child's pipe is a fresh, empty one */
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

static void reaper_wake(void) {
  char byte = 1;
  /* A full pipe is fine: the reader drains every queued token per wake-up. */
  if (write(reaper_pipe[1], &byte, 1) == 1) atomic_fetch_add(&reaper_pipe_bytes, 1);
}

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
  if (reaper_pipe[1] >= 0 && !reaper_quiet) reaper_wake();
}

size_t aib_reaper_drain(uint64_t *tokens_out, size_t max) {
  pthread_once(&reaper_once, reaper_init);
  char sink[256];
  if (atomic_exchange(&reaper_pipe_bytes, 0) > 0)
    while (reaper_pipe[0] >= 0 && read(reaper_pipe[0], sink, sizeof(sink)) > 0) {
    }
  pthread_mutex_lock(&reaper_lock);
  size_t n = reaper_len < max ? reaper_len : max;
  memcpy(tokens_out, reaper_tokens, n * sizeof(uint64_t));
  memmove(reaper_tokens, reaper_tokens + n, (reaper_len - n) * sizeof(uint64_t));
  reaper_len -= n;
  int more = reaper_len > 0;
  pthread_mutex_unlock(&reaper_lock);
  if (more && reaper_pipe[1] >= 0) reaper_wake();
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
  aib_decoded *decoded; /* owned: freed with release_decoded (the decoder's, wire_decode.c) */
  void (*release_decoded)(aib_decoded *);
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

int aib_owner_hold_decoded(aib_owner *owner, aib_decoded *decoded, void (*release)(aib_decoded *)) {
  if (owner->decoded != NULL) return AIB_E_STATE;
  owner->decoded = decoded;
  owner->release_decoded = release;
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

int aib_owner_share_decoded_only(aib_owner *owner, aib_owner *source) {
  int rc = aib_owner_share_decoded(owner, source);
  if (rc == AIB_OK) owner->view = NULL; /* its own comes with aib_owner_set_view */
  return rc;
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

int64_t aib_owner_capture(aib_owner *owner, const struct ArrowSchema **schema, struct ArrowDeviceArray ***arrays) {
  *schema = owner->schema;
  *arrays = owner->arrays;
  return owner->n_arrays;
}

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
  if (owner->decoded != NULL) owner->release_decoded(owner->decoded);
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
