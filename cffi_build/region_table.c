/* What this process has open of other processes' CUDA memory: the region table.
 *
 * A message the session has not seen before goes to Python (decode, open each region, rebuild),
 * with Python objects and calls per region. But producers that allocate new arrays every step
 * mostly carve them out of blocks shared before (CuPy's pool, PyTorch's caching allocator, the
 * bridge's slab allocator), so the new message names legacy IPC handles or kept pool slabs this
 * process has open already.
 * aib_import_new imports such a message in C: decode and validate (the same checks as Python's
 * path), look every handle up here, build the lease's owner.
 * Anything else (a handle, event or device not here, other region kinds, descriptors) returns NULL
 * and the caller takes the Python path, which reports errors properly.
 *
 * This table is the one record of these facts; Python asks it (cuda/opener.py, events.py,
 * devices.py) and keeps no copy: the legacy handles and kept slabs held open beyond their last
 * array, each with the owner that keeps it open (one reference held here), in a least-recently-used
 * order per kind that the caller's bound trims on put (a C-side import counts as a use too); every
 * IPC event opened here, by handle and device; every GPU UUID resolved to an ordinal. One table per
 * process, like the handles. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define N_BUCKETS 1024 /* entries: the opener's LRUs (256 handles, 256 kept slabs), events and GPUs */
#define N_KINDS (AIB_REGION_KEY_READER_LEGACY + 1)

typedef struct region_entry {
  uint64_t hash;
  uint32_t kind;
  uint32_t key_len;
  uint8_t key[AIB_REGION_KEY_MAX];
  uint64_t value;
  aib_owner *owner; /* one reference, or NULL */
  struct region_entry *next;
  struct region_entry *older, *newer; /* the kind's least-recently-used order */
} region_entry;

static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
/* Messages imported here, and the open handles (legacy, kept slabs) they used (cuda_stats()). */
static atomic_ullong imports_done, handles_found;
static region_entry *buckets[N_BUCKETS];
static region_entry *oldest[N_KINDS], *newest[N_KINDS];
static size_t kind_count[N_KINDS];
static size_t table_count;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

/* A child of fork cannot use its parent's CUDA state: it starts with an empty table (the entries
 * are leaked, not released: their owners' callbacks act on the parent's handles). */
static void table_after_fork_child(void) {
  pthread_mutex_init(&table_lock, NULL);
  memset(buckets, 0, sizeof(buckets));
  memset(oldest, 0, sizeof(oldest));
  memset(newest, 0, sizeof(newest));
  memset(kind_count, 0, sizeof(kind_count));
  table_count = 0;
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, table_after_fork_child); }

static int valid_kind(uint32_t kind) { return kind >= 1 && kind < N_KINDS; }

static uint64_t key_hash(uint32_t kind, const uint8_t *key, size_t len) {
  return aib_hash_bytes(key, len) ^ ((uint64_t)kind * 0x9E3779B97F4A7C15ull);
}

static region_entry **find(uint32_t kind, const uint8_t *key, size_t len, uint64_t hash) {
  region_entry **slot = &buckets[hash & (N_BUCKETS - 1)];
  while (*slot != NULL && !((*slot)->hash == hash && (*slot)->kind == kind && (*slot)->key_len == len &&
                            memcmp((*slot)->key, key, len) == 0))
    slot = &(*slot)->next;
  return slot;
}

static void lru_unlink(region_entry *e) {
  if (e->older != NULL) e->older->newer = e->newer;
  else oldest[e->kind] = e->newer;
  if (e->newer != NULL) e->newer->older = e->older;
  else newest[e->kind] = e->older;
  e->older = e->newer = NULL;
}

static void lru_push_newest(region_entry *e) {
  e->older = newest[e->kind];
  e->newer = NULL;
  if (newest[e->kind] != NULL) newest[e->kind]->newer = e;
  else oldest[e->kind] = e;
  newest[e->kind] = e;
}

static void mark_used(region_entry *e) {
  if (newest[e->kind] != e) {
    lru_unlink(e);
    lru_push_newest(e);
  }
}

/* Under table_lock: take e out of the table (the caller unrefs its owner and frees it after). */
static void unlink_locked(region_entry *e) {
  region_entry **slot = find(e->kind, e->key, e->key_len, e->hash);
  if (*slot == e) *slot = e->next;
  lru_unlink(e);
  kind_count[e->kind]--;
  table_count--;
  e->next = NULL;
}

/* Outside table_lock: an owner's end may run anything its release does. */
static void release_entries(region_entry *list) {
  while (list != NULL) {
    region_entry *next = list->next;
    aib_owner_unref(list->owner);
    free(list);
    list = next;
  }
}

int aib_regions_put(uint32_t kind, const uint8_t *key, size_t key_len, uint64_t value, aib_owner *owner,
                    size_t limit) {
  if (!valid_kind(kind)) return AIB_E_STATE;
  if (key_len == 0 || key_len > AIB_REGION_KEY_MAX) return AIB_E_LIMIT;
  pthread_once(&fork_once, register_fork_handler);
  region_entry *e = malloc(sizeof(*e));
  if (e == NULL) return AIB_E_NOMEM;
  e->hash = key_hash(kind, key, key_len);
  e->kind = kind;
  e->key_len = (uint32_t)key_len;
  memcpy(e->key, key, key_len);
  e->value = value;
  e->owner = owner;
  if (owner != NULL) aib_owner_ref(owner);
  region_entry *released = NULL;
  pthread_mutex_lock(&table_lock);
  region_entry *previous = *find(kind, key, key_len, e->hash);
  if (previous != NULL) {
    unlink_locked(previous);
    released = previous;
  }
  region_entry **slot = find(kind, key, key_len, e->hash);
  e->next = *slot;
  *slot = e;
  lru_push_newest(e);
  kind_count[kind]++;
  table_count++;
  while (limit != 0 && kind_count[kind] > limit) {
    region_entry *out = oldest[kind];
    unlink_locked(out);
    out->next = released;
    released = out;
  }
  pthread_mutex_unlock(&table_lock);
  release_entries(released);
  return AIB_OK;
}

int aib_regions_find(uint32_t kind, const uint8_t *key, size_t key_len, uint64_t *value, aib_owner **owner) {
  if (!valid_kind(kind) || key_len == 0 || key_len > AIB_REGION_KEY_MAX) return 0;
  uint64_t hash = key_hash(kind, key, key_len);
  pthread_mutex_lock(&table_lock);
  region_entry *e = *find(kind, key, key_len, hash);
  if (e != NULL) {
    mark_used(e);
    *value = e->value;
    if (owner != NULL) {
      *owner = e->owner;
      if (e->owner != NULL) aib_owner_ref(e->owner);
    }
  }
  pthread_mutex_unlock(&table_lock);
  return e != NULL;
}

int aib_regions_remove(uint32_t kind, const uint8_t *key, size_t key_len) {
  if (!valid_kind(kind) || key_len == 0 || key_len > AIB_REGION_KEY_MAX) return 1;
  uint64_t hash = key_hash(kind, key, key_len);
  pthread_mutex_lock(&table_lock);
  region_entry *e = *find(kind, key, key_len, hash);
  if (e != NULL) unlink_locked(e);
  pthread_mutex_unlock(&table_lock);
  if (e == NULL) return 1;
  release_entries(e);
  return 0;
}

int aib_regions_take_oldest(uint32_t kind, uint8_t *key_out, size_t *key_len_out, uint64_t *value_out) {
  if (!valid_kind(kind)) return 0;
  pthread_mutex_lock(&table_lock);
  region_entry *e = oldest[kind];
  if (e != NULL) unlink_locked(e);
  pthread_mutex_unlock(&table_lock);
  if (e == NULL) return 0;
  memcpy(key_out, e->key, e->key_len);
  *key_len_out = e->key_len;
  *value_out = e->value;
  release_entries(e);
  return 1;
}

size_t aib_regions_list(uint32_t kind, uint8_t *keys_out, size_t key_len, size_t max) {
  if (!valid_kind(kind)) return 0;
  size_t n = 0;
  pthread_mutex_lock(&table_lock);
  for (region_entry *e = oldest[kind]; e != NULL; e = e->newer) {
    if (e->key_len != key_len) continue;
    if (n < max) memcpy(keys_out + n * key_len, e->key, key_len);
    n++;
  }
  pthread_mutex_unlock(&table_lock);
  return n;
}

int aib_regions_key_of(uint32_t kind, uint64_t value, uint8_t *key_out, size_t *key_len_out) {
  if (!valid_kind(kind)) return 0;
  int found = 0;
  pthread_mutex_lock(&table_lock);
  for (region_entry *e = oldest[kind]; e != NULL && !found; e = e->newer) {
    if (e->value != value) continue;
    memcpy(key_out, e->key, e->key_len);
    *key_len_out = e->key_len;
    found = 1;
  }
  pthread_mutex_unlock(&table_lock);
  return found;
}

void aib_regions_stats(uint64_t *imports, uint64_t *handles) {
  *imports = atomic_load(&imports_done);
  *handles = atomic_load(&handles_found);
}

size_t aib_regions_count(void) {
  pthread_mutex_lock(&table_lock);
  size_t n = table_count;
  pthread_mutex_unlock(&table_lock);
  return n;
}

size_t aib_regions_count_kind(uint32_t kind) {
  if (!valid_kind(kind)) return 0;
  pthread_mutex_lock(&table_lock);
  size_t n = kind_count[kind];
  pthread_mutex_unlock(&table_lock);
  return n;
}

/* Under table_lock: the entry's value (now the most recently used of its kind), and a reference on
 * its owner for the caller when asked. */
static int lookup(uint32_t kind, const uint8_t *key, size_t len, uint64_t *value, aib_owner **owner) {
  region_entry *e = *find(kind, key, len, key_hash(kind, key, len));
  if (e == NULL) return 0;
  mark_used(e);
  *value = e->value;
  if (owner != NULL) {
    *owner = e->owner;
    if (e->owner != NULL) aib_owner_ref(e->owner);
  }
  return 1;
}

aib_owner *aib_import_new(const uint8_t *message, size_t length, uint32_t n_fds, uint64_t token,
                          aib_owner *keeper) {
  if (n_fds != 0) return NULL;
  /* The device type is the body's first varint (wire-format.md, section 3): a host message (or one
   * encoded oddly) goes to the caller's path without a decode spent on it here. */
  if (length <= 16 || message[16] != ARROW_DEVICE_CUDA) return NULL;
  pthread_mutex_lock(&table_lock);
  int empty = table_count == 0;
  pthread_mutex_unlock(&table_lock);
  if (empty) return NULL; /* a process without CUDA imports: no decode spent on host messages */
  aib_decoded *decoded = NULL;
  aib_error err;
  if (aib_decode(message, length, 0, 0, &decoded, &err) != AIB_OK) return NULL;
  const aib_device_info *device = aib_decoded_device(decoded);
  size_t n = aib_decoded_region_count(decoded);
  const aib_region *regions = aib_decoded_regions(decoded);
  if (device->device_type != ARROW_DEVICE_CUDA || n > AIB_MAX_NEW_REGIONS) {
    aib_decoded_free(decoded);
    return NULL;
  }
  uint64_t bases[AIB_MAX_NEW_REGIONS > 0 ? AIB_MAX_NEW_REGIONS : 1];
  aib_owner *held[AIB_MAX_NEW_REGIONS > 0 ? AIB_MAX_NEW_REGIONS : 1];
  size_t n_held = 0;
  uint64_t ordinal = 0, event = 0;
  pthread_mutex_lock(&table_lock);
  int found = lookup(AIB_REGION_KEY_DEVICE, device->identity, device->identity_len, &ordinal, NULL);
  if (found && device->sync_len > 0) {
    /* An opened event is keyed by its handle and the device it was opened on (aib_regions_event_key). */
    uint8_t event_key[AIB_REGION_KEY_MAX];
    size_t event_key_len = aib_regions_event_key(device->sync, device->sync_len, (int64_t)ordinal, event_key);
    found = event_key_len != 0 && lookup(AIB_REGION_KEY_EVENT, event_key, event_key_len, &event, NULL);
  }
  for (size_t i = 0; found && i < n; i++) {
    uint32_t key_kind;
    if (regions[i].kind == AIB_REGION_KIND_CUDA_LEGACY && regions[i].handle_len == 64) {
      key_kind = AIB_REGION_KEY_LEGACY;
    } else if (regions[i].kind == AIB_REGION_KIND_CUDA_POOL && regions[i].handle_len == 88 &&
               (regions[i].flags & AIB_REGION_FLAG_KEPT)) {
      key_kind = AIB_REGION_KEY_POOL; /* a kept slab imported here: held like a legacy handle */
    } else {
      found = 0;
      break;
    }
    aib_owner *owner = NULL;
    found = lookup(key_kind, regions[i].handle, regions[i].handle_len, &bases[i], &owner);
    if (found && owner == NULL) found = 0; /* a handle is only ever put with what keeps it open */
    if (owner != NULL) held[n_held++] = owner;
  }
  pthread_mutex_unlock(&table_lock);
  aib_owner *owner = NULL;
  if (found) {
    /* Token set only once the owner is complete: one that fails dies quietly (see remembered.c). */
    owner = aib_owner_new(0);
    if (owner != NULL && aib_owner_attach_decoded(owner, decoded) != AIB_OK) {
      aib_owner_unref(owner);
      owner = NULL;
    } else if (owner != NULL) {
      decoded = NULL; /* the owner's now */
    }
    int ok = owner != NULL && aib_owner_add_dependency(owner, keeper) == AIB_OK;
    for (size_t i = 0; ok && i < n_held; i++) ok = aib_owner_add_dependency(owner, held[i]) == AIB_OK;
    ok = ok && aib_owner_set_view(owner, bases, n, ARROW_DEVICE_CUDA, (int64_t)ordinal) == AIB_OK;
    if (ok) {
      *aib_owner_slot(owner) = event;
      aib_owner_set_token(owner, token);
      atomic_fetch_add(&imports_done, 1);
      atomic_fetch_add(&handles_found, n);
    } else if (owner != NULL) {
      aib_owner_unref(owner);
      owner = NULL;
    }
  }
  for (size_t i = 0; i < n_held; i++) aib_owner_unref(held[i]);
  if (decoded != NULL) aib_decoded_free(decoded);
  return owner;
}

size_t aib_regions_event_key(const uint8_t *handle, size_t handle_len, int64_t device, uint8_t *key_out) {
  if (handle_len == 0 || handle_len + 8 > AIB_REGION_KEY_MAX) return 0;
  memcpy(key_out, handle, handle_len);
  aib_store_u64le(key_out + handle_len, (uint64_t)device);
  return handle_len + 8;
}
