/* The session's steady state in one C call: GET, ITEM, and the import of a message seen before.
 *
 * A session remembers messages whose regions can stay open (legacy CUDA handles, IPC-pool pointers
 * under a lease the template keeps, host files): the validated decode lives in a template owner,
 * which also holds the opened regions. When the
 * publisher answers a GET with byte-for-byte the same message (the same publication) and, for host
 * regions, descriptors of the same files, nothing needs decoding, validating, mapping or opening
 * again: aib_session_get makes the lease's owner (sharing the template's decode, holding the
 * template) and returns. Identical bytes validated once are valid again, so
 * this skips no check. Everything else (a new message, other files, an ERROR) goes back to Python
 * as the received frame.
 *
 * Python keeps the LRU order and the Python-side objects of each entry; this table mirrors its
 * membership (put on remember, remove on eviction), keyed by the message bytes. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

#define FRAME_GET 5
#define FRAME_ITEM 6

typedef struct cache_entry {
  uint64_t hash;
  uint64_t id;
  uint64_t event;
  aib_owner *template_owner; /* one reference */
  size_t length;
  struct cache_entry *next;
  int any_fds;  /* the descriptors name nothing the message does not (CUDA pool fds): not checked */
  uint32_t n_files;
  aib_file_identity *files; /* n_files, inside this allocation after the message */
  uint8_t message[];        /* length bytes */
} cache_entry;

struct aib_import_cache {
  pthread_mutex_t mu;
  cache_entry **buckets;
  size_t n_buckets, count;
};

aib_import_cache *aib_import_cache_new(void) {
  aib_import_cache *c = calloc(1, sizeof(*c));
  if (c == NULL) return NULL;
  c->n_buckets = 128;
  c->buckets = calloc(c->n_buckets, sizeof(cache_entry *));
  if (c->buckets == NULL) {
    free(c);
    return NULL;
  }
  pthread_mutex_init(&c->mu, NULL);
  return c;
}

void aib_import_cache_free(aib_import_cache *c) {
  if (c == NULL) return;
  for (size_t b = 0; b < c->n_buckets; b++) {
    cache_entry *e = c->buckets[b];
    while (e != NULL) {
      cache_entry *next = e->next;
      aib_owner_unref(e->template_owner);
      free(e);
      e = next;
    }
  }
  pthread_mutex_destroy(&c->mu);
  free(c->buckets);
  free(c);
}

static cache_entry **find(aib_import_cache *c, const uint8_t *message, size_t length, uint64_t hash) {
  cache_entry **slot = &c->buckets[hash & (c->n_buckets - 1)];
  while (*slot != NULL &&
         !((*slot)->hash == hash && (*slot)->length == length && memcmp((*slot)->message, message, length) == 0))
    slot = &(*slot)->next;
  return slot;
}

int aib_import_cache_put(aib_import_cache *c, const uint8_t *message, size_t length, aib_owner *template_owner,
                         uint64_t event, uint64_t id, const aib_file_identity *files, uint32_t n_files,
                         uint32_t fd_policy) {
  if (aib_owner_decoded(template_owner) == NULL) return AIB_E_STATE;
  if (n_files > AIB_MAX_FDS) return AIB_E_LIMIT;
  if (fd_policy != AIB_CACHE_FDS_SAME_FILES && fd_policy != AIB_CACHE_FDS_ANY) return AIB_E_STATE;
  size_t files_at = (sizeof(cache_entry) + length + 7) & ~(size_t)7;
  cache_entry *e = malloc(files_at + n_files * sizeof(aib_file_identity));
  if (e == NULL) return AIB_E_NOMEM;
  e->hash = aib_hash_bytes(message, length);
  e->id = id;
  e->event = event;
  e->length = length;
  e->any_fds = fd_policy == AIB_CACHE_FDS_ANY;
  memcpy(e->message, message, length);
  e->n_files = n_files;
  e->files = (aib_file_identity *)((char *)e + files_at);
  if (n_files) memcpy(e->files, files, n_files * sizeof(aib_file_identity));
  aib_owner_ref(template_owner);
  e->template_owner = template_owner;
  pthread_mutex_lock(&c->mu);
  cache_entry **slot = find(c, message, length, e->hash);
  cache_entry *previous = *slot;
  e->next = previous != NULL ? previous->next : NULL;
  *slot = e;
  if (previous == NULL) c->count++;
  pthread_mutex_unlock(&c->mu);
  if (previous != NULL) {
    aib_owner_unref(previous->template_owner);
    free(previous);
  }
  return AIB_OK;
}

int aib_import_cache_remove(aib_import_cache *c, const uint8_t *message, size_t length) {
  uint64_t hash = aib_hash_bytes(message, length);
  pthread_mutex_lock(&c->mu);
  cache_entry **slot = find(c, message, length, hash);
  cache_entry *e = *slot;
  if (e != NULL) {
    *slot = e->next;
    c->count--;
  }
  pthread_mutex_unlock(&c->mu);
  if (e == NULL) return 1;
  aib_owner_unref(e->template_owner);
  free(e);
  return 0;
}

size_t aib_import_cache_count(const aib_import_cache *c) { return c->count; }

/* Whether the received descriptors are the files the entry's template mapped, in order: identical
 * message bytes say nothing about which file a host region lives in (its identity field is 0), the
 * descriptors do. (st_dev, st_ino) of a file the template still maps cannot name another file. */
static int same_files(const cache_entry *e, const int *fds, uint32_t n_fds) {
  if (e->any_fds) return 1;
  if (e->n_files != n_fds) return 0;
  for (uint32_t i = 0; i < n_fds; i++) {
    struct stat st;
    if (fstat(fds[i], &st) != 0 || !S_ISREG(st.st_mode)) return 0;
    if ((uint64_t)st.st_dev != e->files[i].dev || (uint64_t)st.st_ino != e->files[i].ino) return 0;
  }
  return 1;
}

/* The lease owner for a remembered message, or NULL (not remembered, other files, or out of memory:
 * the caller then takes the slow path, which reports errors properly). */
static aib_owner *import_remembered(aib_import_cache *c, const uint8_t *message, size_t length, const int *fds,
                                    uint32_t n_fds, uint64_t token, aib_owner *keeper, uint64_t *id_out) {
  uint64_t hash = aib_hash_bytes(message, length);
  aib_owner *owner = NULL;
  pthread_mutex_lock(&c->mu);
  cache_entry *e = *find(c, message, length, hash);
  if (e != NULL && !same_files(e, fds, n_fds)) e = NULL;
  if (e != NULL) {
    /* Token set only once the owner is complete: one that fails dies quietly, and the slow path
     * (which gets the same token) is the only one to report the lease's end. */
    owner = aib_owner_new(0);
    if (owner != NULL && (aib_owner_share_decoded(owner, e->template_owner) != AIB_OK ||
                          aib_owner_add_dependency(owner, keeper) != AIB_OK)) {
      aib_owner_unref(owner);
      owner = NULL;
    }
    if (owner != NULL) {
      aib_owner_set_token(owner, token);
      *aib_owner_slot(owner) = e->event;
      *id_out = e->id;
    }
  }
  pthread_mutex_unlock(&c->mu);
  return owner;
}

int aib_session_get(aib_channel *ch, const uint8_t *name, size_t name_len, int64_t timeout_ms,
                    aib_import_cache *cache, uint64_t lease_tokens, aib_owner *keeper, aib_get_result *out,
                    aib_frame *frame, aib_error *err) {
  out->entry_id = 0;
  out->owner = NULL;
  out->owner_address = 0;
  out->sync_slot = NULL;
  int rc = aib_channel_request(ch, FRAME_GET, name, name_len, timeout_ms, frame, err);
  if (rc) return rc;
  if (frame->kind != FRAME_ITEM || frame->length < 8 || cache == NULL || keeper == NULL) return AIB_OK;
  const uint8_t *p = frame->payload;
  uint64_t lease = aib_load_u64le(p);
  /* The lease id rides in the owner's token (no Python registration per get); one that does not
   * fit under the session's token base is left to the caller's path. */
  if (lease == 0 || lease >> AIB_LEASE_ID_BITS) return AIB_OK;
  aib_owner *owner = import_remembered(cache, p + 8, (size_t)frame->length - 8, frame->fds, frame->n_fds,
                                       lease_tokens | lease, keeper, &out->entry_id);
  if (owner == NULL) {
    /* Not remembered: imported here still when every region is open in this process already. */
    owner = aib_import_new(p + 8, (size_t)frame->length - 8, frame->n_fds, lease_tokens | lease, keeper);
    if (owner == NULL) return AIB_OK;
    out->owner = owner;
    out->owner_address = (uintptr_t)owner;
    out->sync_slot = *aib_owner_slot(owner) != 0 ? aib_owner_slot(owner) : NULL;
    return AIB_GET_IMPORTED_NEW;
  }
  /* The template maps these files already: the duplicates that came with the answer go. */
  for (uint32_t i = 0; i < frame->n_fds; i++) close(frame->fds[i]);
  frame->n_fds = 0;
  out->owner = owner;
  out->owner_address = (uintptr_t)owner;
  out->sync_slot = *aib_owner_slot(owner) != 0 ? aib_owner_slot(owner) : NULL;
  return AIB_GET_IMPORTED;
}
