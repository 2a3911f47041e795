/* The version board (docs/protocol.md, "The version board"): a page of shared memory on which a
 * publisher keeps, for each published name, the serial of the entry published under it (the version
 * it was put at, unique within the publisher) and its current version (which an in-place renewal
 * raises). Sessions map it read-only: a session that holds a standing lease on a remembered message
 * re-gets its name without a round trip while the board still shows that entry's serial
 * (remembered.c), and a round trip otherwise.
 *
 * One writer, the publisher's table under its mutex (serve.c); readers in other processes. Each
 * slot is a sequence lock: the writer makes seq odd, writes, makes it even again; a reader takes a
 * read only when seq was the same even number before and after it. The fields are lock-free 64-bit
 * atomics, so the same code is right across processes. A reader never waits for a writer: a read
 * that keeps colliding gives up and the session asks the publisher instead. */
#include <stdatomic.h>
#include <stdlib.h>

#include "internal.h"

typedef struct board_slot {
  _Atomic uint64_t seq;
  _Atomic uint64_t serial; /* 0: no entry */
  _Atomic uint64_t version;
  uint64_t reserved;
} board_slot;

_Static_assert(sizeof(board_slot) == AIB_BOARD_SLOT_SIZE, "the board's slot size is part of the protocol");

void aib_board_write(void *board, uint32_t slot, uint64_t serial, uint64_t version) {
  board_slot *s = (board_slot *)board + slot;
  uint64_t seq = atomic_load_explicit(&s->seq, memory_order_relaxed);
  atomic_store_explicit(&s->seq, seq + 1, memory_order_relaxed);
  atomic_thread_fence(memory_order_release); /* odd before the fields change */
  atomic_store_explicit(&s->serial, serial, memory_order_relaxed);
  atomic_store_explicit(&s->version, version, memory_order_relaxed);
  atomic_store_explicit(&s->seq, seq + 2, memory_order_release); /* the fields before even */
}

/* Tries before a read gives up: a writer holds a slot odd for a few stores, so collisions end at
 * once unless the publisher died mid-write (then the round trip reports it). */
#define READ_TRIES 64

int aib_board_read(const void *board, uint32_t slot, uint64_t *serial, uint64_t *version) {
  board_slot *s = (board_slot *)board + slot; /* read only: atomic loads do not write */
  for (int i = 0; i < READ_TRIES; i++) {
    uint64_t before = atomic_load_explicit(&s->seq, memory_order_acquire);
    if (before & 1) continue;
    uint64_t got_serial = atomic_load_explicit(&s->serial, memory_order_relaxed);
    uint64_t got_version = atomic_load_explicit(&s->version, memory_order_relaxed);
    atomic_thread_fence(memory_order_acquire); /* the fields before seq again */
    if (atomic_load_explicit(&s->seq, memory_order_relaxed) == before) {
      *serial = got_serial;
      *version = got_version;
      return 1;
    }
  }
  return 0;
}
