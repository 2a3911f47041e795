/* The publisher's hot path in C: published entries, per-connection leases, and the serve loop that
 * answers GET, RELEASE and PING frames without the GIL (see channel.c for why C).
 *
 * An entry holds the encoded message, the region descriptors to attach (borrowed from the Python
 * export record) and a keeper owner. The table holds one reference while the name is published and
 * every lease one more; when the last goes, the keeper is unreferenced, its token reaches the reaper
 * and Python closes the export record (only then are the descriptors closed). Frames the loop does
 * not handle (HELLO, LIST, a GET for an unknown name, anything malformed) go back to Python, which
 * owns the protocol's rare paths and its error reporting. Each entry carries a version, the table's
 * publish counter when it was put, so a name's versions only grow (also across remove and put);
 * a held wait for a newer version (frame WAIT, producer/publisher.py and producer/watch.py) is answered from another
 * thread with aib_server_conn_lease_newer, under the connection's mutex. With a version board
 * (board.c), each published name holds a slot on it showing its entry's serial (the version it was
 * put at) and current version, written under the table's mutex; a session that mapped the board is
 * answered with BOARD_ITEM, which names the slot and serial (remembered.c reads them). */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define FRAME_GET 5
#define FRAME_ITEM 6
#define FRAME_RELEASE 7
#define FRAME_PING 9
#define FRAME_PONG 10
#define FRAME_VERSIONED_ITEM 21
#define FRAME_BOARD_ITEM 26
#define MAX_PING 64
#define MAX_NAME 4096 /* transport/protocol.py's MAX_NAME */

/* The most payload a session sends in each request kind (transport/protocol.py, docs/protocol.md "Frame
 * kinds"). A server connection's channel refuses a frame announcing more from its header, before any
 * of its payload is read: every request then fits the channel's 64 KiB buffer, which bounds what one
 * connection can make the publisher hold, and a client announcing 64 MiB is told at once instead of
 * being read. Kinds not listed (answers, reserved, unknown ones) carry nothing. */
static const uint32_t REQUEST_LIMITS[] = {
    [1] = 2,                    /* HELLO: u16 protocol version */
    [3] = 0,                    /* LIST */
    [FRAME_GET] = MAX_NAME,     /* the name */
    [FRAME_RELEASE] = 8,        /* u64 lease id */
    [FRAME_PING] = MAX_PING,    /* echoed */
    [11] = 24,                  /* POOL_FD: an IPC pool's identity */
    [13] = 4 + MAX_NAME,        /* SUBSCRIBE: u32 window, the stream's name */
    [17] = 4096 * 8,            /* RELEASE_MANY: up to 4096 u64 lease ids */
    [20] = 12 + MAX_NAME,       /* WAIT: u64 after, u32 timeout, the name */
    [24] = 0,                   /* BOARD_FD */
};
/* Before the handshake only HELLO is valid: every other frame is refused anyway, so none is read. */
static const uint32_t HELLO_LIMITS[] = {[1] = 2};
#define N_LIMITS(table) ((uint32_t)(sizeof(table) / sizeof((table)[0])))

uint32_t aib_request_limit(uint32_t kind, int welcomed) {
  if (welcomed) return kind < N_LIMITS(REQUEST_LIMITS) ? REQUEST_LIMITS[kind] : 0;
  return kind < N_LIMITS(HELLO_LIMITS) ? HELLO_LIMITS[kind] : 0;
}

typedef struct entry {
  atomic_llong refs;
  int *fds; /* one allocation holding fds, name and message */
  size_t name_len;
  uint8_t *name;
  uint8_t *message;
  size_t message_len;
  uint32_t n_fds;
  /* the table's publish counter when this entry was put or last renewed (aib_pubtable_renew; never
   * reused): atomic, as a renewal changes it while connections read it without the table's mutex */
  _Atomic uint64_t version;
  /* the version it was put at: the board's serial for it (a renewal keeps it) */
  uint64_t serial;
  /* its name's board slot when it was put (AIB_BOARD_NO_SLOT: none); an entry replaced under the
   * same name keeps the value, but only the current entry's name owns the slot */
  uint32_t slot;
  aib_owner *keeper;
  struct entry *next; /* hash chain */
} entry;

struct aib_pubtable {
  atomic_llong refs;
  pthread_mutex_t mu;
  entry **buckets;
  size_t n_buckets, count;
  uint64_t versions; /* publishes so far (under mu): the last entry's version */
  atomic_llong leases;
  /* Descriptors sent in answers that their peers may not have read yet, all connections together
   * (each connection's count is refreshed when it next sends descriptors; see fds_unread). */
  atomic_llong fds_unread;
  /* The version board (board.c), written under mu; NULL: none. free_slots: a stack of the slots no
   * published name holds. */
  void *board;
  uint32_t n_slots, n_free;
  uint32_t *free_slots;
};

static void entry_unref(entry *e) {
  if (e == NULL || atomic_fetch_sub_explicit(&e->refs, 1, memory_order_acq_rel) != 1) return;
  aib_owner *keeper = e->keeper;
  free(e->fds);
  free(e);
  aib_owner_unref(keeper);
}

aib_pubtable *aib_pubtable_new(void) {
  aib_pubtable *t = calloc(1, sizeof(*t));
  if (t == NULL) return NULL;
  t->n_buckets = 64;
  t->buckets = calloc(t->n_buckets, sizeof(entry *));
  if (t->buckets == NULL) {
    free(t);
    return NULL;
  }
  pthread_mutex_init(&t->mu, NULL);
  atomic_init(&t->refs, 1);
  return t;
}

/* Under mu: the name holding slot is gone; its slot reads empty and is free again. */
static void release_slot(aib_pubtable *t, uint32_t slot) {
  if (t->board == NULL || slot >= t->n_slots) return;
  aib_board_write(t->board, slot, 0, 0);
  t->free_slots[t->n_free++] = slot;
}

void aib_pubtable_set_board(aib_pubtable *t, void *board, uint32_t n_slots) {
  uint32_t *free_slots = NULL;
  if (board != NULL && n_slots > 0) {
    free_slots = malloc((size_t)n_slots * sizeof(uint32_t));
    if (free_slots == NULL) board = NULL; /* no board: every get is a round trip, as without one */
  }
  pthread_mutex_lock(&t->mu);
  free(t->free_slots);
  t->free_slots = free_slots;
  t->board = board;
  t->n_slots = board != NULL ? n_slots : 0;
  t->n_free = 0;
  /* Slots are handed out from the top of the stack: slot 0 first. Names published before keep no
   * slot (the caller sets the board first). */
  for (uint32_t i = t->n_slots; i > 0; i--) t->free_slots[t->n_free++] = i - 1;
  pthread_mutex_unlock(&t->mu);
}

void aib_pubtable_clear(aib_pubtable *t) {
  pthread_mutex_lock(&t->mu);
  entry *dead = NULL;
  for (size_t b = 0; b < t->n_buckets; b++) {
    entry *e = t->buckets[b];
    while (e != NULL) {
      entry *next = e->next;
      release_slot(t, e->slot);
      e->next = dead;
      dead = e;
      e = next;
    }
    t->buckets[b] = NULL;
  }
  t->count = 0;
  pthread_mutex_unlock(&t->mu);
  while (dead != NULL) { /* keepers die outside the lock: their reaper push takes another */
    entry *next = dead->next;
    entry_unref(dead);
    dead = next;
  }
}

void aib_pubtable_unref(aib_pubtable *t) {
  if (t == NULL || atomic_fetch_sub_explicit(&t->refs, 1, memory_order_acq_rel) != 1) return;
  t->board = NULL; /* the publisher that owned the page may have unmapped it: nothing writes it now */
  aib_pubtable_clear(t);
  pthread_mutex_destroy(&t->mu);
  free(t->free_slots);
  free(t->buckets);
  free(t);
}

int64_t aib_pubtable_leases(const aib_pubtable *t) { return atomic_load(&((aib_pubtable *)t)->leases); }

static entry **find_slot(aib_pubtable *t, const uint8_t *name, size_t len) {
  entry **slot = &t->buckets[aib_hash_bytes(name, len) & (t->n_buckets - 1)];
  while (*slot != NULL && !((*slot)->name_len == len && memcmp((*slot)->name, name, len) == 0))
    slot = &(*slot)->next;
  return slot;
}

static void grow(aib_pubtable *t) {
  size_t n = t->n_buckets * 2;
  entry **fresh = calloc(n, sizeof(entry *));
  if (fresh == NULL) return; /* longer chains, still correct */
  for (size_t b = 0; b < t->n_buckets; b++) {
    entry *e = t->buckets[b];
    while (e != NULL) {
      entry *next = e->next;
      size_t i = aib_hash_bytes(e->name, e->name_len) & (n - 1);
      e->next = fresh[i];
      fresh[i] = e;
      e = next;
    }
  }
  free(t->buckets);
  t->buckets = fresh;
  t->n_buckets = n;
}

int aib_pubtable_put(aib_pubtable *t, const uint8_t *name, size_t name_len, const uint8_t *message,
                     size_t message_len, const int *fds, uint32_t n_fds, aib_owner *keeper, aib_error *err) {
  if (name_len == 0 || n_fds > AIB_MAX_FDS)
    return aib_fail(err, AIB_E_STATE, "name", "", "empty name or more than %d descriptors", AIB_MAX_FDS);
  entry *e = calloc(1, sizeof(*e));
  uint8_t *block = malloc(n_fds * sizeof(int) + name_len + message_len + 1);
  if (e == NULL || block == NULL) {
    free(e);
    free(block);
    return aib_fail(err, AIB_E_NOMEM, "", "", "no memory for a published entry");
  }
  atomic_init(&e->refs, 1);
  /* fds first: malloc's alignment then holds for the int array */
  e->fds = (int *)(void *)block;
  memcpy(e->fds, fds, n_fds * sizeof(int));
  e->name = block + n_fds * sizeof(int);
  memcpy(e->name, name, name_len);
  e->name_len = name_len;
  e->message = e->name + name_len;
  memcpy(e->message, message, message_len);
  e->message_len = message_len;
  e->n_fds = n_fds;
  aib_owner_ref(keeper);
  e->keeper = keeper;
  pthread_mutex_lock(&t->mu);
  e->serial = ++t->versions;
  atomic_store(&e->version, e->serial);
  entry **slot = find_slot(t, name, name_len);
  entry *previous = *slot;
  if (previous != NULL) {
    e->slot = previous->slot; /* the name keeps its slot (or takes one freed since) */
    if (e->slot == AIB_BOARD_NO_SLOT && t->n_free > 0) e->slot = t->free_slots[--t->n_free];
    e->next = previous->next;
    *slot = e;
  } else {
    e->slot = t->n_free > 0 ? t->free_slots[--t->n_free] : AIB_BOARD_NO_SLOT;
    *slot = e;
    if (++t->count > t->n_buckets) grow(t);
  }
  if (t->board != NULL && e->slot < t->n_slots) aib_board_write(t->board, e->slot, e->serial, e->serial);
  pthread_mutex_unlock(&t->mu);
  entry_unref(previous); /* leases on the replaced object keep it */
  return AIB_OK;
}

int aib_pubtable_remove(aib_pubtable *t, const uint8_t *name, size_t name_len) {
  pthread_mutex_lock(&t->mu);
  entry **slot = find_slot(t, name, name_len);
  entry *e = *slot;
  if (e != NULL) {
    *slot = e->next;
    t->count--;
    release_slot(t, e->slot);
  }
  pthread_mutex_unlock(&t->mu);
  if (e == NULL) return 1;
  entry_unref(e);
  return 0;
}

uint64_t aib_pubtable_version(aib_pubtable *t, const uint8_t *name, size_t name_len) {
  pthread_mutex_lock(&t->mu);
  entry *e = *find_slot(t, name, name_len);
  uint64_t version = e != NULL ? atomic_load(&e->version) : 0;
  pthread_mutex_unlock(&t->mu);
  return version;
}

/* A new version of the entry published as name, with the same message, fds and keeper: what a
 * producer that updated the data in place publishes (producer/publisher.py, the in-place fast path). Leases
 * on the entry stay as they are; answers from now on carry the new version. 0 when absent. */
uint64_t aib_pubtable_renew(aib_pubtable *t, const uint8_t *name, size_t name_len) {
  pthread_mutex_lock(&t->mu);
  entry *e = *find_slot(t, name, name_len);
  uint64_t version = 0;
  if (e != NULL) {
    version = ++t->versions;
    atomic_store(&e->version, version);
    if (t->board != NULL && e->slot < t->n_slots) aib_board_write(t->board, e->slot, e->serial, version);
  }
  pthread_mutex_unlock(&t->mu);
  return version;
}

static entry *take(aib_pubtable *t, const uint8_t *name, size_t name_len) {
  pthread_mutex_lock(&t->mu);
  entry *e = *find_slot(t, name, name_len);
  if (e != NULL) atomic_fetch_add(&e->refs, 1);
  pthread_mutex_unlock(&t->mu);
  return e;
}

/* ---------- one connection's leases: open addressing, lease id -> entry ----------------------- */
struct aib_server_conn {
  aib_pubtable *table; /* one reference */
  aib_channel *ch;     /* borrowed */
  /* Held while a frame is handled (never across the wait for one): the lease table and the sends of
   * aib_serve against aib_server_conn_lease_newer / _send from other threads (a held wait answered
   * when a name is published). */
  pthread_mutex_t mu;
  uint64_t next_lease;
  uint64_t *keys; /* 0 = empty */
  entry **values;
  size_t cap, count;
  int welcomed;         /* until Python says hello was answered, every frame goes back to it */
  int retired;          /* let go while idle (aib_server_conn_retire): it leases nothing any more */
  int board;            /* the session mapped the board: GETs are answered with BOARD_ITEM */
  int64_t max_leases;   /* < 0: no limit */
  int64_t max_unread_fds;
  int64_t send_timeout_ms; /* a peer that does not read an answer for this long is dropped */
  /* Descriptors in the ITEMs sent since the peer last had nothing unread (SIOCOUTQ 0). The kernel
   * counts descriptors in flight (sent, not yet received) per sending user and fails sendmsg with
   * ETOOMANYREFS past RLIMIT_NOFILE: a peer that sends GETs and never reads would otherwise make
   * every other connection's answers fail. */
  int64_t fds_unread;
};

aib_server_conn *aib_server_conn_new(aib_pubtable *t, aib_channel *ch) {
  aib_server_conn *c = calloc(1, sizeof(*c));
  if (c == NULL) return NULL;
  c->cap = 64;
  c->keys = calloc(c->cap, sizeof(uint64_t));
  c->values = calloc(c->cap, sizeof(entry *));
  if (c->keys == NULL || c->values == NULL) {
    free(c->keys);
    free(c->values);
    free(c);
    return NULL;
  }
  atomic_fetch_add(&t->refs, 1);
  pthread_mutex_init(&c->mu, NULL);
  c->table = t;
  c->ch = ch;
  c->next_lease = 1;
  c->max_leases = -1;
  c->max_unread_fds = -1;
  c->send_timeout_ms = -1;
  aib_channel_limit_kinds(ch, HELLO_LIMITS, N_LIMITS(HELLO_LIMITS), " before HELLO (say HELLO first)");
  return c;
}

void aib_server_conn_configure(aib_server_conn *c, int64_t max_leases, int64_t max_unread_fds,
                               int64_t send_timeout_ms) {
  c->max_leases = max_leases;
  c->max_unread_fds = max_unread_fds;
  c->send_timeout_ms = send_timeout_ms;
}

void aib_server_conn_welcome(aib_server_conn *c) {
  aib_channel_limit_kinds(c->ch, REQUEST_LIMITS, N_LIMITS(REQUEST_LIMITS),
                          " (the publisher's request limits, docs/protocol.md)");
  c->welcomed = 1;
}

void aib_server_conn_use_board(aib_server_conn *c) {
  pthread_mutex_lock(&c->mu);
  c->board = 1;
  pthread_mutex_unlock(&c->mu);
}

static size_t lease_index(uint64_t key, size_t cap) { return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & (cap - 1); }

static int lease_insert(aib_server_conn *c, uint64_t key, entry *value) {
  if ((c->count + 1) * 2 > c->cap) { /* keep the load at most 1/2 */
    size_t cap = c->cap * 2;
    uint64_t *keys = calloc(cap, sizeof(uint64_t));
    entry **values = calloc(cap, sizeof(entry *));
    if (keys == NULL || values == NULL) {
      free(keys);
      free(values);
      return AIB_E_NOMEM;
    }
    for (size_t i = 0; i < c->cap; i++) {
      if (c->keys[i] == 0) continue;
      size_t j = lease_index(c->keys[i], cap);
      while (keys[j] != 0) j = (j + 1) & (cap - 1);
      keys[j] = c->keys[i];
      values[j] = c->values[i];
    }
    free(c->keys);
    free(c->values);
    c->keys = keys;
    c->values = values;
    c->cap = cap;
  }
  size_t i = lease_index(key, c->cap);
  while (c->keys[i] != 0) i = (i + 1) & (c->cap - 1);
  c->keys[i] = key;
  c->values[i] = value;
  c->count++;
  return AIB_OK;
}

/* Removes key; returns its entry or NULL. Backward-shift deletion keeps probe chains intact. */
static entry *lease_remove(aib_server_conn *c, uint64_t key) {
  size_t mask = c->cap - 1;
  size_t i = lease_index(key, c->cap);
  while (c->keys[i] != key) {
    if (c->keys[i] == 0) return NULL;
    i = (i + 1) & mask;
  }
  entry *value = c->values[i];
  size_t hole = i;
  for (size_t j = (i + 1) & mask; c->keys[j] != 0; j = (j + 1) & mask) {
    size_t home = lease_index(c->keys[j], c->cap);
    /* Move j into the hole unless its home lies cyclically in (hole, j]. */
    int stays = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
    if (!stays) {
      c->keys[hole] = c->keys[j];
      c->values[hole] = c->values[j];
      hole = j;
    }
  }
  c->keys[hole] = 0;
  c->values[hole] = NULL;
  c->count--;
  return value;
}

int64_t aib_server_conn_leases(const aib_server_conn *c) { return (int64_t)c->count; }

int aib_server_conn_retire(aib_server_conn *c) {
  /* A connection busy answering (a held wait's answer going out) is not idle. */
  if (pthread_mutex_trylock(&c->mu) != 0) return 0;
  int idle = c->count == 0;
  if (idle) c->retired = 1;
  pthread_mutex_unlock(&c->mu);
  return idle;
}

void aib_server_conn_free(aib_server_conn *c) {
  if (c == NULL) return;
  atomic_fetch_sub(&c->table->fds_unread, c->fds_unread);
  for (size_t i = 0; i < c->cap; i++) {
    if (c->keys[i] == 0) continue;
    atomic_fetch_sub(&c->table->leases, 1);
    entry_unref(c->values[i]);
  }
  free(c->keys);
  free(c->values);
  pthread_mutex_destroy(&c->mu);
  aib_pubtable_unref(c->table);
  free(c);
}

int64_t aib_pubtable_fds_unread(const aib_pubtable *t) { return atomic_load(&((aib_pubtable *)t)->fds_unread); }

/* Half the descriptor limit: what the kernel lets this user have in flight (RLIMIT_NOFILE), with
 * room left for the answers of peers that do read. */
static int64_t fds_unread_budget(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return INT64_MAX;
  return (int64_t)(rl.rlim_cur / 2);
}

/* Whether an ITEM with n descriptors may go out now. A peer that read everything sent to it is
 * always answered (its count starts again at 0); a peer with answers unread is refused once its own
 * unread descriptors, or all connections' together, would pass their limits. One ioctl per ITEM
 * after an ITEM with descriptors; nothing when the count is 0. */
static int may_send_fds(aib_server_conn *c, uint32_t n) {
  if (n == 0 || c->fds_unread == 0) return 1;
  if (aib_channel_peer_unread(c->ch) == 0) {
    atomic_fetch_sub(&c->table->fds_unread, c->fds_unread);
    c->fds_unread = 0;
    return 1;
  }
  if (c->max_unread_fds >= 0 && c->fds_unread + n > c->max_unread_fds) return 0;
  return atomic_load(&c->table->fds_unread) + n <= fds_unread_budget();
}

static void give_back(aib_server_conn *c, uint64_t lease) {
  entry *e = lease_remove(c, lease);
  if (e != NULL) { /* releasing twice is harmless */
    atomic_fetch_sub(&c->table->leases, 1);
    entry_unref(e);
  }
}

/* Leases e (one reference, the caller's, moves into the table) to this connection and sends it:
 * ITEM [lease], VERSIONED_ITEM [lease][version] (kind), or BOARD_ITEM [lease][version][serial][slot
 * u32][0 u32], then the message and its fds. Called holding c->mu. AIB_SERVE_LEASE_LIMIT /
 * AIB_SERVE_UNREAD_LIMIT / AIB_SERVE_FDS_BUSY: nothing leased (and nothing sent). */
static int lease_and_send(aib_server_conn *c, entry *e, uint32_t kind, uint64_t version, int64_t timeout_ms,
                          aib_error *err) {
  if (c->retired) {
    entry_unref(e);
    return aib_fail(err, AIB_E_PEER_CLOSED, "", "", "the connection was closed to make room for another");
  }
  if (c->max_leases >= 0 && (int64_t)c->count >= c->max_leases) {
    entry_unref(e);
    return AIB_SERVE_LEASE_LIMIT;
  }
  if (!may_send_fds(c, e->n_fds)) {
    entry_unref(e);
    return AIB_SERVE_UNREAD_LIMIT;
  }
  uint64_t lease = c->next_lease++;
  if (lease_insert(c, lease, e) != AIB_OK) {
    entry_unref(e);
    return aib_fail(err, AIB_E_NOMEM, "", "", "no memory for a lease");
  }
  atomic_fetch_add(&c->table->leases, 1);
  uint8_t prefix[32];
  size_t prefix_len = kind == FRAME_ITEM ? 8 : kind == FRAME_VERSIONED_ITEM ? 16 : 32;
  aib_store_u64le(prefix, lease);
  aib_store_u64le(prefix + 8, version);
  aib_store_u64le(prefix + 16, e->serial);
  aib_store_u32le(prefix + 24, e->slot);
  aib_store_u32le(prefix + 28, 0);
  uint32_t n_fds = e->n_fds;
  int rc = aib_channel_send(c->ch, kind, prefix, prefix_len, e->message, e->message_len, e->fds, n_fds,
                            timeout_ms, err);
  if (rc == AIB_E_OS && err != NULL && err->errno_value == ETOOMANYREFS) {
    /* sendmsg sent nothing: this answer only fails, and the connection goes on */
    give_back(c, lease);
    return AIB_SERVE_FDS_BUSY;
  }
  if (rc) return rc; /* the lease stays in the table; aib_server_conn_free gives it back */
  c->fds_unread += n_fds;
  atomic_fetch_add(&c->table->fds_unread, n_fds);
  return AIB_OK;
}

/* One frame the loop answers itself (c->mu held); AIB_OK to go on receiving. */
static int serve_one(aib_server_conn *c, aib_frame *out, aib_error *err) {
  if (out->kind == FRAME_RELEASE && out->length == 8) {
    give_back(c, aib_load_u64le(out->payload));
    return AIB_OK;
  }
  if (out->kind == FRAME_PING && out->length <= MAX_PING)
    return aib_channel_send(c->ch, FRAME_PONG, out->payload, (size_t)out->length, NULL, 0, NULL, 0,
                            c->send_timeout_ms, err);
  if (out->kind != FRAME_GET) return AIB_SERVE_FRAME;
  entry *e = take(c->table, out->payload, (size_t)out->length);
  if (e == NULL) return AIB_SERVE_FRAME; /* Python answers NotPublished (or a bad name) */
  if (c->board) return lease_and_send(c, e, FRAME_BOARD_ITEM, atomic_load(&e->version), c->send_timeout_ms, err);
  return lease_and_send(c, e, FRAME_ITEM, 0, c->send_timeout_ms, err);
}

int aib_serve(aib_server_conn *c, int64_t idle_ms, aib_frame *out, aib_error *err) {
  for (;;) {
    int rc = aib_channel_recv_idle(c->ch, idle_ms, out, err);
    if (rc == AIB_E_TIMEOUT) return AIB_SERVE_IDLE; /* nothing of a frame consumed */
    if (rc) return rc;
    /* Sessions never send descriptors: close any that came, on every frame. */
    for (uint32_t i = 0; i < out->n_fds; i++) close(out->fds[i]);
    out->n_fds = 0;
    if (!c->welcomed) return AIB_SERVE_FRAME; /* HELLO first: Python answers or refuses */
    pthread_mutex_lock(&c->mu);
    rc = serve_one(c, out, err);
    pthread_mutex_unlock(&c->mu);
    if (rc) return rc;
  }
}

/* Takes c->mu within timeout_ms (< 0: no limit): the serve loop holds it while it sends an answer,
 * which may wait for a client that does not read; a held wait's answer gives up instead. */
static int lock_within(aib_server_conn *c, int64_t timeout_ms, aib_error *err) {
  if (timeout_ms < 0) return pthread_mutex_lock(&c->mu) == 0 ? AIB_OK : aib_fail(err, AIB_E_STATE, "", "", "lock failed");
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += (time_t)(timeout_ms / 1000);
  until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
  if (until.tv_nsec >= 1000000000L) {
    until.tv_sec++;
    until.tv_nsec -= 1000000000L;
  }
  int rc = pthread_mutex_timedlock(&c->mu, &until);
  if (rc == 0) return AIB_OK;
  return aib_fail(err, AIB_E_TIMEOUT, "", "", "the connection stayed busy answering (a client that does not read)");
}

int aib_server_conn_lease_newer(aib_server_conn *c, const uint8_t *name, size_t name_len, uint64_t after,
                                int64_t timeout_ms, uint64_t *version, aib_error *err) {
  if (lock_within(c, timeout_ms, err)) return AIB_E_TIMEOUT;
  entry *e = take(c->table, name, name_len);
  int rc;
  if (e == NULL) {
    rc = AIB_SERVE_ABSENT;
  } else if ((*version = atomic_load(&e->version)) <= after) {
    entry_unref(e);
    rc = AIB_SERVE_NOT_NEWER;
  } else {
    rc = lease_and_send(c, e, FRAME_VERSIONED_ITEM, *version, timeout_ms, err);
  }
  pthread_mutex_unlock(&c->mu);
  return rc;
}

int aib_server_conn_send(aib_server_conn *c, uint32_t kind, const uint8_t *payload, size_t length,
                         int64_t timeout_ms, aib_error *err) {
  if (lock_within(c, timeout_ms, err)) return AIB_E_TIMEOUT;
  int rc = aib_channel_send(c->ch, kind, payload, length, NULL, 0, NULL, 0, timeout_ms, err);
  pthread_mutex_unlock(&c->mu);
  return rc;
}
