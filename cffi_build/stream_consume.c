/* A live stream's consumer: each BATCH received and, in the steady state, imported in one call
 * (bridge_stream.h; docs/streams.md, "Consuming").
 *
 * A subscriber's steady state is a BATCH naming a reserved slot or a ring segment whose message it
 * has seen: the frame's header, then the remembered message imported under the batch's lease.
 * Python once spent some thirty microseconds a batch here (a frame object, the header unpacked,
 * dictionaries of slots and held segments, the remembered lookup and the import's objects, the
 * content check's call); this file does it in C over state it owns, and hands Python the lease's
 * owner and the remembered message's id, from which Python's one builder (RememberedMessage.adopt)
 * makes the import. A message not remembered (a slot's or segment's first batch, a written batch of
 * no slot) goes back to Python's import (AIB_STREAM_NEW), which remembers it; so does every frame
 * that is not a BATCH. Nothing here calls Python.
 *
 * Hostile input: the header is checked as stream_frames.py once checked it, with the same messages
 * (a BATCH that breaks the stream's protocol: AIB_STREAM_BROKEN; one batch refused, the stream going
 * on: AIB_STREAM_REFUSED). A ring segment's descriptor must be a memfd sealed against shrinking,
 * growing and writes (checked when it arrives), and every ring batch's contents are checked, since
 * they change with each batch while the message repeats. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

#define FRAME_BATCH 15
#define HEADER_SIZE 24 /* u64 sequence, u64 lease id, u32 slot, u32 flags */
#define FLAG_SLOT_AGAIN 1
#define FLAG_RING 2
#define FLAGS_KNOWN (FLAG_SLOT_AGAIN | FLAG_RING)
#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif
#define RING_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE)

/* A slot's (or segment's) last message and copies of its descriptors, for the BATCHes that repeat
 * it without them. */
typedef struct kept {
  uint8_t *message; /* NULL: none kept */
  size_t length;
  int *fds;
  uint32_t n_fds;
  /* The remembered message these copies last matched (0: none yet): the same descriptors finding
   * the same message again need no fstat (aib_remembered_import's matched_id). */
  uint64_t entry_id;
} kept;

/* The slots of one kind (reserved slots, ring segments), by number; grown as numbers come. */
typedef struct slot_table {
  kept *slots;
  uint64_t *held; /* ring segments: the lease of the batch this consumer holds there (0: none) */
  uint32_t capacity;
} slot_table;

struct aib_stream_rx {
  pthread_mutex_t mu; /* held: released from any thread while the receiving thread reads it */
  slot_table tables[2]; /* [0] reserved slots, [1] ring segments */
  uint32_t n_kept;      /* both tables together, at most AIB_STREAM_MAX_SLOTS */
  uint64_t expected, received, dropped, repeated, got;
  int64_t last_sequence;
};

aib_stream_rx *aib_stream_rx_new(uint64_t next_sequence) {
  aib_stream_rx *s = calloc(1, sizeof(*s));
  if (s == NULL) return NULL;
  pthread_mutex_init(&s->mu, NULL);
  s->expected = next_sequence;
  s->last_sequence = -1;
  return s;
}

static void forget(kept *k) {
  for (uint32_t i = 0; i < k->n_fds; i++) close(k->fds[i]);
  free(k->fds);
  free(k->message);
  memset(k, 0, sizeof(*k));
}

void aib_stream_rx_forget_slots(aib_stream_rx *s) {
  pthread_mutex_lock(&s->mu);
  for (int t = 0; t < 2; t++)
    for (uint32_t i = 0; i < s->tables[t].capacity; i++) forget(&s->tables[t].slots[i]);
  s->n_kept = 0;
  pthread_mutex_unlock(&s->mu);
}

void aib_stream_rx_free(aib_stream_rx *s) {
  if (s == NULL) return;
  aib_stream_rx_forget_slots(s);
  for (int t = 0; t < 2; t++) {
    free(s->tables[t].slots);
    free(s->tables[t].held);
  }
  pthread_mutex_destroy(&s->mu);
  free(s);
}

void aib_stream_rx_counts(aib_stream_rx *s, aib_stream_counts *out) {
  pthread_mutex_lock(&s->mu);
  out->received = s->received;
  out->dropped = s->dropped;
  out->repeated = s->repeated;
  out->got = s->got;
  out->expected = s->expected;
  out->last_sequence = s->last_sequence;
  pthread_mutex_unlock(&s->mu);
}

/* Under mu: room for slot number slot in t; AIB_E_NOMEM when out of memory. */
static int reserve(slot_table *t, uint32_t slot) {
  if (slot < t->capacity) return AIB_OK;
  uint32_t capacity = t->capacity ? t->capacity : 16;
  while (capacity <= slot) capacity *= 2;
  if (capacity > AIB_STREAM_MAX_SLOTS) capacity = AIB_STREAM_MAX_SLOTS;
  kept *slots = realloc(t->slots, capacity * sizeof(kept));
  if (slots == NULL) return AIB_E_NOMEM;
  t->slots = slots;
  uint64_t *held = realloc(t->held, capacity * sizeof(uint64_t));
  if (held == NULL) return AIB_E_NOMEM; /* slots grew already: harmless, capacity stays */
  t->held = held;
  memset(t->slots + t->capacity, 0, (capacity - t->capacity) * sizeof(kept));
  memset(t->held + t->capacity, 0, (capacity - t->capacity) * sizeof(uint64_t));
  t->capacity = capacity;
  return AIB_OK;
}

static uint64_t held_lease(aib_stream_rx *s, uint32_t slot) {
  slot_table *t = &s->tables[1];
  return slot < t->capacity ? t->held[slot] : 0;
}

void aib_stream_rx_released(aib_stream_rx *s, uint64_t lease_id) {
  pthread_mutex_lock(&s->mu);
  slot_table *t = &s->tables[1]; /* a few segments: the ring grows only while none is free */
  for (uint32_t i = 0; i < t->capacity; i++)
    if (t->held[i] == lease_id) {
      t->held[i] = 0;
      break;
    }
  pthread_mutex_unlock(&s->mu);
}

/* Under mu: the batch counted (and its segment held) once it is handed out. */
static void accept_locked(aib_stream_rx *s, const aib_stream_batch *b) {
  if (b->ring && b->slot < s->tables[1].capacity) s->tables[1].held[b->slot] = b->lease_id;
  s->dropped += b->sequence - s->expected;
  s->expected = b->sequence + 1;
  s->last_sequence = (int64_t)b->sequence;
  s->received++;
}

void aib_stream_rx_accept(aib_stream_rx *s, const aib_stream_batch *batch) {
  pthread_mutex_lock(&s->mu);
  accept_locked(s, batch);
  pthread_mutex_unlock(&s->mu);
}

/* Under mu: keep message and copies of fds as slot's last (replacing what it kept). */
static int keep(aib_stream_rx *s, slot_table *t, uint32_t slot, const uint8_t *message, size_t length,
                const int *fds, uint32_t n_fds, aib_error *err) {
  int rc = reserve(t, slot);
  if (rc) return aib_fail(err, rc, "", "", "keeping a slot's message: out of memory");
  kept *k = &t->slots[slot];
  if (k->message == NULL && s->n_kept >= AIB_STREAM_MAX_SLOTS)
    return aib_fail(err, AIB_STREAM_BROKEN, "", "", "more than %d slots on one stream", AIB_STREAM_MAX_SLOTS);
  kept fresh = {malloc(length ? length : 1), length, n_fds ? malloc(n_fds * sizeof(int)) : NULL, 0, 0};
  if (fresh.message == NULL || (n_fds && fresh.fds == NULL)) {
    forget(&fresh);
    return aib_fail(err, AIB_E_NOMEM, "", "", "keeping a slot's message: out of memory");
  }
  memcpy(fresh.message, message, length);
  for (uint32_t i = 0; i < n_fds; i++) {
    int copy = fcntl(fds[i], F_DUPFD_CLOEXEC, 0);
    if (copy < 0) {
      int e = errno;
      forget(&fresh);
      err->errno_value = e;
      return aib_fail(err, AIB_E_OS, "", "", "keeping a slot's descriptors: %s", strerror(e));
    }
    fresh.fds[fresh.n_fds++] = copy;
  }
  if (k->message == NULL) s->n_kept++;
  forget(k);
  *k = fresh;
  return AIB_OK;
}

/* The seals of a ring segment's one descriptor (docs/streams.md): AIB_OK, or a refusal. */
static int check_ring_segment(const aib_frame *frame, aib_error *err) {
  if (frame->n_fds != 1)
    return aib_fail(err, AIB_STREAM_REFUSED, "", "",
                    "a BATCH in the producer's ring carries %u descriptors (one segment)", frame->n_fds);
  int seals = fcntl(frame->fds[0], F_GET_SEALS);
  if (seals < 0)
    return aib_fail(err, AIB_STREAM_REFUSED, "", "",
                    "a ring segment's descriptor has no seals (%s): not a sealed memfd", strerror(errno));
  if ((seals & RING_SEALS) != RING_SEALS)
    return aib_fail(err, AIB_STREAM_REFUSED, "", "",
                    "a ring segment's memfd has seals %#x, not shrink, grow and write (%#x)", (unsigned)seals,
                    (unsigned)RING_SEALS);
  return AIB_OK;
}

static void close_frame_fds(aib_frame *frame) {
  for (uint32_t i = 0; i < frame->n_fds; i++) close(frame->fds[i]);
  frame->n_fds = 0;
}

/* The header, the stream's order and the slot's message (steps 1 to 3 of a BATCH): AIB_OK with
 * out->message and out->fds set, or a refusal / breach (mu held). */
static int read_batch_locked(aib_stream_rx *s, aib_frame *frame, aib_stream_batch *out, uint64_t *matched_id,
                             aib_error *err) {
  const uint8_t *p = frame->payload;
  if (frame->length < HEADER_SIZE)
    return aib_fail(err, AIB_STREAM_BROKEN, "", "", "BATCH payload of %llu bytes (a %d-byte header first)",
                    (unsigned long long)frame->length, HEADER_SIZE);
  uint64_t sequence = aib_load_u64le(p), lease_id = aib_load_u64le(p + 8);
  uint32_t slot = aib_load_u32le(p + 16), flags = aib_load_u32le(p + 20);
  if (flags & ~FLAGS_KNOWN)
    return aib_fail(err, AIB_STREAM_BROKEN, "", "", "BATCH flags %#x (only %#x are defined)", flags, FLAGS_KNOWN);
  if (slot != AIB_STREAM_NO_SLOT && slot >= AIB_STREAM_MAX_SLOTS)
    return aib_fail(err, AIB_STREAM_BROKEN, "", "", "BATCH names slot %u (at most %d)", slot, AIB_STREAM_MAX_SLOTS);
  int again = (flags & FLAG_SLOT_AGAIN) != 0, ring = (flags & FLAG_RING) != 0;
  if (ring && slot == AIB_STREAM_NO_SLOT)
    return aib_fail(err, AIB_STREAM_BROKEN, "", "", "a BATCH in the producer's ring names no segment");
  if (again && (slot == AIB_STREAM_NO_SLOT || frame->length != HEADER_SIZE))
    return aib_fail(err, AIB_STREAM_BROKEN, "", "",
                    "a BATCH repeating its slot names a slot and carries nothing after its header");
  if (!again && frame->length == HEADER_SIZE)
    return aib_fail(err, AIB_STREAM_BROKEN, "", "", "BATCH payload of %d bytes (a header, then a message)",
                    HEADER_SIZE);
  s->got++;
  out->sequence = sequence;
  out->lease_id = lease_id;
  out->slot = slot;
  out->ring = (uint32_t)ring;
  if (lease_id == 0 || lease_id >> AIB_LEASE_ID_BITS)
    return aib_fail(err, AIB_STREAM_BROKEN, "", "", "BATCH lease id %llu out of range", (unsigned long long)lease_id);
  if (sequence < s->expected)
    return aib_fail(err, AIB_STREAM_BROKEN, "", "", "BATCH sequence %llu after %lld: out of order",
                    (unsigned long long)sequence, (long long)s->expected - 1);
  if (ring && held_lease(s, slot))
    /* The producer reuses a segment only after every subscriber released the batch in it: this one
     * still holds it, so the producer would be rewriting memory being read. */
    return aib_fail(err, AIB_STREAM_BROKEN, "", "",
                    "a BATCH reuses ring segment %u while this consumer still holds its last batch (lease %llu)",
                    slot, (unsigned long long)held_lease(s, slot));
  slot_table *t = &s->tables[ring];
  if (again) {
    if (frame->n_fds)
      return aib_fail(err, AIB_STREAM_BROKEN, "", "", "a BATCH repeating its slot carries descriptors");
    kept *k = slot < t->capacity ? &t->slots[slot] : NULL;
    if (k == NULL || k->message == NULL)
      return aib_fail(err, AIB_STREAM_BROKEN, "", "", "a BATCH repeats slot %u, which this subscription never received",
                      slot);
    out->message = k->message;
    out->message_len = k->length;
    out->fds = k->fds;
    out->n_fds = k->n_fds;
    out->fds_are_frames = 0;
    *matched_id = k->entry_id;
    s->repeated++;
    return AIB_OK;
  }
  out->message = p + HEADER_SIZE;
  out->message_len = frame->length - HEADER_SIZE;
  out->fds = frame->fds;
  out->n_fds = frame->n_fds;
  out->fds_are_frames = 1;
  if (ring) {
    int rc = check_ring_segment(frame, err);
    if (rc) return rc;
  }
  if (slot != AIB_STREAM_NO_SLOT) return keep(s, t, slot, out->message, (size_t)out->message_len, frame->fds, frame->n_fds, err);
  return AIB_OK;
}

/* Whether a frame arrives within spin_ns, looked for without sleeping: a frame sent to a process
 * that is awake wakes nobody (see LiveStream._spin). */
static int frame_within(aib_channel *ch, int64_t spin_ns) {
  if (!aib_channel_quiet(ch)) return 1;
  int64_t until = aib_monotonic_ns() + spin_ns;
  while (aib_monotonic_ns() < until) {
    sched_yield(); /* a producer runnable on this core (a busy machine) runs first */
    if (!aib_channel_quiet(ch)) return 1;
  }
  return 0;
}

/* Under mu: a received BATCH read and, when its message is remembered, imported (AIB_STREAM_BATCH,
 * out filled, the batch counted); AIB_STREAM_NEW for Python's import, or a refusal / breach. */
static int import_batch_locked(aib_stream_rx *s, aib_remembered *remembered, uint64_t lease_tokens,
                               aib_owner *keeper, int check_level, aib_stream_batch *out, aib_frame *frame,
                               aib_error *err) {
  uint64_t matched_id = 0;
  int rc = read_batch_locked(s, frame, out, &matched_id, err);
  if (rc == AIB_STREAM_BROKEN || rc == AIB_STREAM_REFUSED) return rc;
  if (rc) { /* the system refused the slot's descriptors (or memory): this batch's lease goes back */
    err->code = rc;
    return AIB_STREAM_REFUSED;
  }
  uint64_t token = lease_tokens | out->lease_id;
  aib_owner *owner = remembered == NULL ? NULL
                                        : aib_remembered_import(remembered, out->message, (size_t)out->message_len,
                                                                out->fds, out->n_fds, matched_id, token, keeper,
                                                                &out->entry_id);
  if (owner == NULL) return AIB_STREAM_NEW; /* the frame's descriptors are the caller's to close */
  if (out->ring && check_level != AIB_CHECK_NONE) {
    /* A segment's contents are new with every batch while its message (the layout) repeats, so the
     * remembered message's check covered the layout only: the contents are checked here, read in
     * place. A segment is host memory: a message naming device memory in one is refused (its
     * contents cannot be read here). */
    const aib_view *view = aib_owner_view(owner);
    static const uint64_t no_bases[1] = {0};
    if (view == NULL || view->device_type != ARROW_DEVICE_CPU)
      rc = aib_fail(err, AIB_E_WIRE, "", "", "a BATCH in the producer's ring describes device memory");
    else
      rc = aib_check_content(aib_owner_decoded(owner), view->n_bases ? view->bases : no_bases, view->n_bases,
                             check_level, NULL, NULL, err);
    if (rc) {
      aib_owner_set_token(owner, 0); /* dies quietly: the caller gives the lease back */
      aib_owner_unref(owner);
      err->code = rc;
      return AIB_STREAM_REFUSED;
    }
  }
  out->owner = owner;
  out->owner_address = (uintptr_t)owner;
  out->sync_slot = *aib_owner_slot(owner) != 0 ? aib_owner_slot(owner) : NULL;
  slot_table *t = &s->tables[out->ring];
  if (out->slot < t->capacity && t->slots[out->slot].message != NULL) t->slots[out->slot].entry_id = out->entry_id;
  accept_locked(s, out);
  return AIB_STREAM_BATCH;
}

int aib_stream_rx_next(aib_stream_rx *s, aib_channel *ch, aib_remembered *remembered, uint64_t lease_tokens,
                       aib_owner *keeper, int check_level, int64_t spin_ns, int64_t timeout_ms,
                       aib_stream_batch *out, aib_frame *frame, aib_error *err) {
  memset(out, 0, sizeof(*out));
  out->slot = AIB_STREAM_NO_SLOT;
  frame->n_fds = 0;
  if (spin_ns >= 0 && !frame_within(ch, spin_ns)) return AIB_STREAM_NOTHING;
  int rc = aib_channel_recv(ch, timeout_ms, frame, err);
  if (rc) return rc;
  if (frame->kind != FRAME_BATCH) return AIB_STREAM_FRAME;
  /* mu is held to the end: the slot's kept message and descriptors this batch uses stay as they are
   * while it is imported (a close on another thread forgets them under mu). */
  pthread_mutex_lock(&s->mu);
  rc = import_batch_locked(s, remembered, lease_tokens, keeper, check_level, out, frame, err);
  pthread_mutex_unlock(&s->mu);
  if (rc != AIB_STREAM_NEW) close_frame_fds(frame); /* the template maps these files already */
  return rc;
}
