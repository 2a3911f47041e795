/* The session's remembered messages (docs/lifetime.md 5a), and its steady state in one C call:
 * GET, ITEM and the import of a message remembered.
 *
 * A session remembers messages whose regions can stay open (legacy CUDA handles, IPC-pool pointers
 * under a lease the template keeps, host files): the validated decode lives in a template owner,
 * which also holds the opened regions. When the publisher answers a GET with byte-for-byte the same
 * message (the same publication) and, for host regions, descriptors of the same files, nothing needs
 * decoding, validating, mapping or opening again: aib_session_get makes the lease's owner (sharing
 * the template's decode, holding the template) and returns. Identical bytes validated once are valid
 * again, so this skips no check. Everything else (a new message, other files, an ERROR) goes back to
 * Python as the received frame.
 *
 * This set is the one record of what is remembered: lookup by message bytes, one message per name,
 * the least-recently-used bound and the kept leases' last use all live here, so that the C get path
 * and Python read the same facts. Python (consumer/remembered.py) decides what to remember and keeps only
 * the Python objects of each message, by the id put returns. A message this set lets go (replaced,
 * evicted, forgotten, expired) waits in a list until Python takes its id
 * (aib_remembered_take_forgotten) and closes its template. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define FRAME_GET 5
#define FRAME_ITEM 6
#define FRAME_BOARD_ITEM 26
#define BOARD_PREFIX 32 /* lease, version, serial, slot, 0 */
#define MIN_BUCKETS 64
#define FIRST_BUCKETS_MAX 4096    /* a large limit starts here; the table grows with what it holds */
#define BUCKETS_MAX ((size_t)1 << 24)

typedef struct entry {
  uint64_t hash, name_hash;
  uint64_t id;
  uint64_t event;
  aib_owner *template_owner; /* one reference */
  struct entry *next;        /* in its message bucket; in the forgotten list once forgotten */
  struct entry *name_next;   /* in its name bucket, when named */
  struct entry *older, *newer; /* the LRU order */
  double last_used;          /* CLOCK_MONOTONIC seconds, for a kept lease (lingers) */
  int lingers;               /* the template holds a kept lease, given back after linger seconds unused */
  /* The standing lease (a BOARD_ITEM answer's lease owner, one reference) on the publisher's entry of
   * serial board_serial, in board slot board_slot: gets of the name import from it without a round
   * trip while the board shows that serial; given back linger seconds after its last use, or with
   * the message. NULL: none. */
  aib_owner *standing;
  uint64_t board_serial;
  uint32_t board_slot;
  double standing_used;
  int any_fds;  /* the descriptors name nothing the message does not (CUDA pool fds): not checked */
  int named;
  uint32_t n_files;
  uint32_t name_len;
  size_t length;
  aib_file_identity *files; /* n_files, inside this allocation after the message */
  uint8_t *name;            /* name_len bytes, inside this allocation after the files */
  uint8_t message[];        /* length bytes */
} entry;

struct aib_remembered {
  pthread_mutex_t mu;
  entry **buckets, **name_buckets; /* n_buckets each, a power of two */
  size_t n_buckets, count, limit;
  uint64_t next_id;
  entry *oldest, *newest;
  entry *forgotten; /* let go of, waiting for take_forgotten (linked through next) */
};

static double monotonic_now(void) { return (double)aib_monotonic_ns() * 1e-9; } /* seconds, as Python's */

static size_t buckets_for(size_t limit) {
  size_t n = MIN_BUCKETS;
  while (n < limit && n < FIRST_BUCKETS_MAX) n <<= 1;
  return n;
}

aib_remembered *aib_remembered_new(size_t limit) {
  aib_remembered *r = calloc(1, sizeof(*r));
  if (r == NULL) return NULL;
  r->n_buckets = buckets_for(limit);
  r->buckets = calloc(r->n_buckets, sizeof(entry *));
  r->name_buckets = calloc(r->n_buckets, sizeof(entry *));
  if (r->buckets == NULL || r->name_buckets == NULL) {
    free(r->buckets);
    free(r->name_buckets);
    free(r);
    return NULL;
  }
  r->limit = limit;
  r->next_id = 1;
  pthread_mutex_init(&r->mu, NULL);
  return r;
}

static void free_entry(entry *e) {
  aib_owner_unref(e->standing);
  aib_owner_unref(e->template_owner);
  free(e);
}

void aib_remembered_free(aib_remembered *r) {
  if (r == NULL) return;
  for (entry *e = r->oldest; e != NULL;) {
    entry *newer = e->newer;
    free_entry(e);
    e = newer;
  }
  for (entry *e = r->forgotten; e != NULL;) {
    entry *next = e->next;
    free_entry(e);
    e = next;
  }
  pthread_mutex_destroy(&r->mu);
  free(r->buckets);
  free(r->name_buckets);
  free(r);
}

static entry **find(aib_remembered *r, const uint8_t *message, size_t length, uint64_t hash) {
  entry **slot = &r->buckets[hash & (r->n_buckets - 1)];
  while (*slot != NULL &&
         !((*slot)->hash == hash && (*slot)->length == length && memcmp((*slot)->message, message, length) == 0))
    slot = &(*slot)->next;
  return slot;
}

static entry **find_name(aib_remembered *r, const uint8_t *name, size_t name_len, uint64_t hash) {
  entry **slot = &r->name_buckets[hash & (r->n_buckets - 1)];
  while (*slot != NULL && !((*slot)->name_hash == hash && (*slot)->name_len == name_len &&
                            memcmp((*slot)->name, name, name_len) == 0))
    slot = &(*slot)->name_next;
  return slot;
}

static void lru_unlink(aib_remembered *r, entry *e) {
  if (e->older != NULL) e->older->newer = e->newer;
  else r->oldest = e->newer;
  if (e->newer != NULL) e->newer->older = e->older;
  else r->newest = e->older;
  e->older = e->newer = NULL;
}

static void lru_push_newest(aib_remembered *r, entry *e) {
  e->older = r->newest;
  e->newer = NULL;
  if (r->newest != NULL) r->newest->newer = e;
  else r->oldest = e;
  r->newest = e;
}

/* A get used e: it becomes the most recently used, and a kept lease's linger starts again. */
static void mark_used(aib_remembered *r, entry *e) {
  if (r->newest != e) {
    lru_unlink(r, e);
    lru_push_newest(r, e);
  }
  if (e->lingers) e->last_used = monotonic_now();
}

/* Under mu: take e out of the set onto the forgotten list (Python closes its template). */
static void forget_locked(aib_remembered *r, entry *e) {
  entry **slot = find(r, e->message, e->length, e->hash);
  if (*slot == e) *slot = e->next;
  if (e->named) {
    entry **named = find_name(r, e->name, e->name_len, e->name_hash);
    if (*named == e) *named = e->name_next;
  }
  lru_unlink(r, e);
  r->count--;
  e->next = r->forgotten;
  r->forgotten = e;
}

static void evict_over_limit_locked(aib_remembered *r) {
  while (r->count > r->limit && r->oldest != NULL) forget_locked(r, r->oldest);
}

/* Under mu: more buckets once the set outgrows them (the limit was raised). */
static void grow_locked(aib_remembered *r) {
  if (r->count <= r->n_buckets || r->n_buckets >= BUCKETS_MAX) return;
  size_t n = r->n_buckets * 2;
  entry **buckets = calloc(n, sizeof(entry *));
  entry **name_buckets = calloc(n, sizeof(entry *));
  if (buckets == NULL || name_buckets == NULL) { /* longer chains, still correct */
    free(buckets);
    free(name_buckets);
    return;
  }
  for (entry *e = r->oldest; e != NULL; e = e->newer) {
    e->next = buckets[e->hash & (n - 1)];
    buckets[e->hash & (n - 1)] = e;
    if (e->named) {
      e->name_next = name_buckets[e->name_hash & (n - 1)];
      name_buckets[e->name_hash & (n - 1)] = e;
    }
  }
  free(r->buckets);
  free(r->name_buckets);
  r->buckets = buckets;
  r->name_buckets = name_buckets;
  r->n_buckets = n;
}

void aib_remembered_set_limit(aib_remembered *r, size_t limit) {
  pthread_mutex_lock(&r->mu);
  r->limit = limit;
  evict_over_limit_locked(r);
  pthread_mutex_unlock(&r->mu);
}

size_t aib_remembered_limit(aib_remembered *r) {
  pthread_mutex_lock(&r->mu);
  size_t n = r->limit;
  pthread_mutex_unlock(&r->mu);
  return n;
}

size_t aib_remembered_count(aib_remembered *r) {
  pthread_mutex_lock(&r->mu);
  size_t n = r->count;
  pthread_mutex_unlock(&r->mu);
  return n;
}

int aib_remembered_put(aib_remembered *r, const uint8_t *message, size_t length, aib_owner *template_owner,
                       uint64_t event, const aib_file_identity *files, uint32_t n_files, uint32_t fd_policy,
                       const uint8_t *name, size_t name_len, int lingers, uint64_t *id_out) {
  *id_out = 0;
  if (aib_owner_decoded(template_owner) == NULL) return AIB_E_STATE;
  if (n_files > AIB_MAX_FDS || name_len > UINT32_MAX) return AIB_E_LIMIT;
  if (fd_policy != AIB_REMEMBERED_SAME_FILES && fd_policy != AIB_REMEMBERED_ANY_FDS) return AIB_E_STATE;
  size_t files_at = (sizeof(entry) + length + 7) & ~(size_t)7;
  size_t name_at = files_at + n_files * sizeof(aib_file_identity);
  entry *e = malloc(name_at + name_len);
  if (e == NULL) return AIB_E_NOMEM;
  memset(e, 0, sizeof(*e));
  e->hash = aib_hash_bytes(message, length);
  e->event = event;
  e->length = length;
  e->any_fds = fd_policy == AIB_REMEMBERED_ANY_FDS;
  e->lingers = lingers != 0;
  memcpy(e->message, message, length);
  e->n_files = n_files;
  e->files = (aib_file_identity *)((char *)e + files_at);
  if (n_files) memcpy(e->files, files, n_files * sizeof(aib_file_identity));
  e->named = name != NULL;
  e->name_len = (uint32_t)name_len;
  e->name = (uint8_t *)e + name_at;
  if (name_len) memcpy(e->name, name, name_len);
  if (e->named) e->name_hash = aib_hash_bytes(name, name_len);
  aib_owner_ref(template_owner);
  e->template_owner = template_owner;
  pthread_mutex_lock(&r->mu);
  e->id = r->next_id++;
  if (r->limit == 0) { /* remembers nothing: the caller closes its template */
    pthread_mutex_unlock(&r->mu);
    free_entry(e);
    return AIB_OK;
  }
  if (e->lingers) e->last_used = monotonic_now();
  entry *previous = *find(r, message, length, e->hash);
  if (previous != NULL) forget_locked(r, previous); /* two threads remembered the same message */
  if (e->named) {
    /* A name keeps one remembered message, the one it was last got with: a name republished with
     * other data does not pin the old regions until eviction. */
    entry *replaced = *find_name(r, e->name, e->name_len, e->name_hash);
    if (replaced != NULL) forget_locked(r, replaced);
    entry **named = find_name(r, e->name, e->name_len, e->name_hash);
    e->name_next = *named;
    *named = e;
  }
  entry **slot = find(r, message, length, e->hash);
  e->next = *slot;
  *slot = e;
  lru_push_newest(r, e);
  r->count++;
  evict_over_limit_locked(r);
  grow_locked(r);
  *id_out = e->id;
  pthread_mutex_unlock(&r->mu);
  return AIB_OK;
}

/* Whether the received descriptors are the files the entry's template mapped, in order: identical
 * message bytes say nothing about which file a host region lives in (its identity field is 0), the
 * descriptors do. (st_dev, st_ino) of a file the template still maps cannot name another file. */
static int same_files(const entry *e, const int *fds, uint32_t n_fds) {
  if (e->any_fds) return 1;
  if (e->n_files != n_fds) return 0;
  for (uint32_t i = 0; i < n_fds; i++) {
    struct stat st;
    if (fstat(fds[i], &st) != 0 || !S_ISREG(st.st_mode)) return 0;
    if ((uint64_t)st.st_dev != e->files[i].dev || (uint64_t)st.st_ino != e->files[i].ino) return 0;
  }
  return 1;
}

uint64_t aib_remembered_find(aib_remembered *r, const uint8_t *message, size_t length, const int *fds,
                             uint32_t n_fds, uint64_t *event_out) {
  uint64_t hash = aib_hash_bytes(message, length);
  uint64_t id = 0;
  pthread_mutex_lock(&r->mu);
  entry *e = *find(r, message, length, hash);
  if (e != NULL && same_files(e, fds, n_fds)) {
    mark_used(r, e);
    id = e->id;
    *event_out = e->event;
  }
  pthread_mutex_unlock(&r->mu);
  return id;
}

size_t aib_remembered_forget_name(aib_remembered *r, const uint8_t *name, size_t name_len, const uint8_t *unless,
                                  size_t unless_len) {
  uint64_t hash = aib_hash_bytes(name, name_len);
  size_t n = 0;
  pthread_mutex_lock(&r->mu);
  entry *e = *find_name(r, name, name_len, hash);
  if (e != NULL && !(unless != NULL && e->length == unless_len && memcmp(e->message, unless, unless_len) == 0)) {
    forget_locked(r, e);
    n = 1;
  }
  pthread_mutex_unlock(&r->mu);
  return n;
}

size_t aib_remembered_forget_all(aib_remembered *r) {
  pthread_mutex_lock(&r->mu);
  size_t n = r->count;
  while (r->oldest != NULL) forget_locked(r, r->oldest);
  pthread_mutex_unlock(&r->mu);
  return n;
}

double aib_remembered_expire(aib_remembered *r, double now, double linger) {
  double next = -1.0;
  pthread_mutex_lock(&r->mu);
  size_t n_expired = 0; /* standing leases to give back */
  aib_owner *expired_list[64];
  for (entry *e = r->oldest; e != NULL;) {
    entry *newer = e->newer;
    if (e->lingers) {
      if (now - e->last_used >= linger) {
        forget_locked(r, e);
        e = newer;
        continue;
      }
      if (next < 0 || e->last_used + linger < next) next = e->last_used + linger;
    }
    if (e->standing != NULL) {
      if (now - e->standing_used >= linger && n_expired < sizeof(expired_list) / sizeof(expired_list[0])) {
        expired_list[n_expired++] = e->standing; /* the message stays remembered */
        e->standing = NULL;
      } else {
        /* not yet, or more than the list holds this round: asked again at once */
        double due = n_expired == sizeof(expired_list) / sizeof(expired_list[0]) ? now : e->standing_used + linger;
        if (next < 0 || due < next) next = due;
      }
    }
    e = newer;
  }
  pthread_mutex_unlock(&r->mu);
  /* Outside the lock: the last reference sends the lease's RELEASE through the reaper. */
  for (size_t i = 0; i < n_expired; i++) aib_owner_unref(expired_list[i]);
  return next;
}

uint64_t aib_remembered_take_forgotten(aib_remembered *r) {
  pthread_mutex_lock(&r->mu);
  entry *e = r->forgotten;
  if (e != NULL) r->forgotten = e->next;
  pthread_mutex_unlock(&r->mu);
  if (e == NULL) return 0;
  uint64_t id = e->id;
  free_entry(e);
  return id;
}

/* What a BOARD_ITEM answer says beside the lease: the entry's serial and its name's board slot. */
typedef struct board_answer {
  int present;
  uint64_t serial;
  uint32_t slot;
} board_answer;

/* Under mu: a new owner for an import of e's message (sharing its template's decode, its sync
 * slot filled, e marked used) that holds holds; NULL when out of memory. Its token is the caller's. */
static aib_owner *import_owner(aib_remembered *r, entry *e, aib_owner *holds) {
  aib_owner *owner = aib_owner_new(0);
  if (owner != NULL && (aib_owner_share_decoded(owner, e->template_owner) != AIB_OK ||
                        aib_owner_add_dependency(owner, holds) != AIB_OK)) {
    aib_owner_unref(owner);
    return NULL;
  }
  if (owner != NULL) {
    *aib_owner_slot(owner) = e->event;
    mark_used(r, e);
  }
  return owner;
}

/* The lease owner for a remembered message, or NULL (not remembered, other files, or out of memory:
 * the caller then takes the slow path, which reports errors properly). With a board answer whose
 * slot is on the board, for a named message with no standing lease on that serial, the lease becomes
 * the message's standing lease instead (*standing_out = 1): an owner of its own holding the token,
 * on which the import's owner depends; a standing lease on an older serial (the same bytes published
 * again) is given back then. */
static aib_owner *import_remembered(aib_remembered *r, const uint8_t *message, size_t length, const int *fds,
                                    uint32_t n_fds, uint64_t matched_id, uint64_t token, aib_owner *keeper,
                                    const board_answer *board, uint32_t board_slots, uint64_t *id_out,
                                    int *standing_out) {
  uint64_t hash = aib_hash_bytes(message, length);
  aib_owner *owner = NULL, *replaced = NULL;
  pthread_mutex_lock(&r->mu);
  entry *e = *find(r, message, length, hash);
  /* matched_id: the entry these very descriptors matched before (ids are never reused, and an
   * entry's files never change), so its files need no fstat again. */
  if (e != NULL && (matched_id == 0 || e->id != matched_id) && !same_files(e, fds, n_fds)) e = NULL;
  if (e != NULL) {
    /* Named messages only: a local get finds the message by its name. */
    int stand = board->present && board->slot < board_slots && e->named &&
                (e->standing == NULL || e->board_serial != board->serial);
    /* A message that keeps a lease already (IPC-pool data, kept by its template) needs no second
     * one: its template, which holds that lease, stands for it. */
    int kept = stand && e->lingers;
    aib_owner *standing = NULL;
    if (kept) {
      aib_owner_ref(e->template_owner);
      standing = e->template_owner;
    } else if (stand) {
      standing = aib_owner_new(0);
      if (standing != NULL && aib_owner_add_dependency(standing, keeper) != AIB_OK) {
        aib_owner_unref(standing);
        standing = NULL;
      }
      if (standing == NULL) stand = 0; /* out of memory: an ordinary lease */
    }
    /* Token set only once the owners are complete: one that fails dies quietly, and the slow path
     * (which gets the same token) is the only one to report the lease's end. */
    owner = import_owner(r, e, stand && !kept ? standing : keeper);
    if (owner != NULL) {
      *id_out = e->id;
      if (stand) {
        if (kept) aib_owner_set_token(owner, token); /* this get's lease is the import's own */
        else aib_owner_set_token(standing, token);
        replaced = e->standing;
        e->standing = standing; /* the set's reference; the import holds its own */
        e->board_serial = board->serial;
        e->board_slot = board->slot;
        e->standing_used = monotonic_now();
        standing = NULL;
        *standing_out = 1;
      } else {
        aib_owner_set_token(owner, token);
      }
    }
    aib_owner_unref(standing); /* NULL when it stands; a failed import's dies quietly (no token yet) */
  }
  pthread_mutex_unlock(&r->mu);
  aib_owner_unref(replaced); /* NULL-safe; outside the lock, as its RELEASE goes through the reaper */
  return owner;
}

aib_owner *aib_remembered_import(aib_remembered *r, const uint8_t *message, size_t length, const int *fds,
                                 uint32_t n_fds, uint64_t matched_id, uint64_t token, aib_owner *keeper,
                                 uint64_t *id_out) {
  const board_answer none = {0, 0, 0};
  int standing = 0;
  return import_remembered(r, message, length, fds, n_fds, matched_id, token, keeper, &none, 0, id_out, &standing);
}

/* A get of name without a round trip: its remembered message holds a standing lease whose serial
 * the board still shows. The import's owner shares the template's decode and holds the standing
 * lease (token 0: its end releases nothing by itself). NULL when the get must ask the publisher. */
static aib_owner *import_local(aib_remembered *r, const void *board, uint32_t board_slots, const uint8_t *name,
                               size_t name_len, uint64_t *id_out, uint64_t *version_out) {
  uint64_t hash = aib_hash_bytes(name, name_len);
  aib_owner *owner = NULL;
  pthread_mutex_lock(&r->mu);
  entry *e = *find_name(r, name, name_len, hash);
  uint64_t serial = 0, version = 0;
  if (e != NULL && e->standing != NULL && e->board_slot < board_slots &&
      aib_board_read(board, e->board_slot, &serial, &version) && serial == e->board_serial && serial != 0) {
    owner = import_owner(r, e, e->standing);
    if (owner != NULL) {
      *id_out = e->id;
      *version_out = version;
      e->standing_used = monotonic_now();
    }
  }
  pthread_mutex_unlock(&r->mu);
  return owner;
}

int aib_remembered_board_place(aib_remembered *r, const uint8_t *name, size_t name_len, uint32_t *slot,
                               uint64_t *serial) {
  uint64_t hash = aib_hash_bytes(name, name_len);
  pthread_mutex_lock(&r->mu);
  entry *e = *find_name(r, name, name_len, hash);
  int found = e != NULL && e->standing != NULL;
  if (found) {
    *slot = e->board_slot;
    *serial = e->board_serial;
  }
  pthread_mutex_unlock(&r->mu);
  return found;
}

static void fill(aib_get_result *out, aib_owner *owner) {
  out->owner = owner;
  out->owner_address = (uintptr_t)owner;
  out->sync_slot = *aib_owner_slot(owner) != 0 ? aib_owner_slot(owner) : NULL;
}

int aib_session_get_local(aib_channel *ch, aib_remembered *remembered, const void *board, uint32_t board_slots,
                          const uint8_t *name, size_t name_len, aib_get_result *out) {
  out->entry_id = 0;
  out->owner = NULL;
  out->owner_address = 0;
  out->sync_slot = NULL;
  out->version = 0;
  out->flags = 0;
  /* Anything unread on the channel (an error the publisher sent, its end) is the request path's. */
  if (board == NULL || remembered == NULL || !aib_channel_quiet(ch)) return AIB_OK;
  aib_owner *owner = import_local(remembered, board, board_slots, name, name_len, &out->entry_id, &out->version);
  if (owner == NULL) return AIB_OK;
  fill(out, owner);
  out->flags = AIB_GET_LOCAL;
  return AIB_GET_IMPORTED;
}

int aib_session_get(aib_channel *ch, const uint8_t *name, size_t name_len, int64_t timeout_ms,
                    aib_remembered *remembered, uint64_t lease_tokens, aib_owner *keeper,
                    const void *board, uint32_t board_slots, aib_get_result *out, aib_frame *frame,
                    aib_error *err) {
  if (aib_session_get_local(ch, remembered, board, board_slots, name, name_len, out) == AIB_GET_IMPORTED)
    return AIB_GET_IMPORTED;
  int rc = aib_channel_request(ch, FRAME_GET, name, name_len, timeout_ms, frame, err);
  if (rc) return rc;
  if (remembered == NULL || keeper == NULL) return AIB_OK;
  board_answer answer = {0, 0, 0};
  size_t prefix;
  if (frame->kind == FRAME_ITEM && frame->length >= 8) {
    prefix = 8;
  } else if (frame->kind == FRAME_BOARD_ITEM && frame->length >= BOARD_PREFIX) {
    prefix = BOARD_PREFIX;
    answer.present = 1;
    answer.serial = aib_load_u64le(frame->payload + 16);
    answer.slot = aib_load_u32le(frame->payload + 24);
    /* A slot past the board (or the board's "none") is never read; Python checks the rest. */
    if (answer.slot >= board_slots || answer.serial == 0 || aib_load_u32le(frame->payload + 28) != 0)
      answer.present = 0;
    out->version = aib_load_u64le(frame->payload + 8);
  } else {
    return AIB_OK;
  }
  const uint8_t *p = frame->payload;
  uint64_t lease = aib_load_u64le(p);
  /* The lease id rides in the owner's token (no Python registration per get); one that does not
   * fit under the session's token base is left to the caller's path. */
  if (lease == 0 || lease >> AIB_LEASE_ID_BITS) return AIB_OK;
  const uint8_t *message = p + prefix;
  size_t length = (size_t)frame->length - prefix;
  int standing = 0;
  aib_owner *owner = import_remembered(remembered, message, length, frame->fds, frame->n_fds, 0, lease_tokens | lease,
                                       keeper, &answer, board != NULL ? board_slots : 0, &out->entry_id, &standing);
  if (owner == NULL) {
    /* Not remembered: imported here still when every region is open in this process already. */
    owner = aib_import_new(message, length, frame->n_fds, lease_tokens | lease, keeper);
    if (owner == NULL) return AIB_OK;
    fill(out, owner);
    return AIB_GET_IMPORTED_NEW;
  }
  /* The template maps these files already: the duplicates that came with the answer go. */
  for (uint32_t i = 0; i < frame->n_fds; i++) close(frame->fds[i]);
  frame->n_fds = 0;
  fill(out, owner);
  out->flags = standing ? AIB_GET_STANDING : 0;
  return AIB_GET_IMPORTED;
}
