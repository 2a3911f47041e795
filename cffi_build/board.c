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
 * that keeps colliding gives up and the session asks the publisher instead.
 *
 * A session waiting for a slot to change (get_next) sleeps on a futex on the low 32 bits of the
 * slot's seq, which every write changes; every write wakes those sleepers (docs/protocol.md, feature
 * "board_wake"). With nobody asleep the wake is one cheap system call (a few hundred ns), so the
 * writer does not need to know of waiters: a read-only page could not tell it anyway. */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

typedef struct board_slot {
  _Atomic uint64_t seq;
  _Atomic uint64_t serial; /* 0: no entry */
  _Atomic uint64_t version;
  uint64_t reserved;
} board_slot;

_Static_assert(sizeof(board_slot) == AIB_BOARD_SLOT_SIZE, "the board's slot size is part of the protocol");

/* The futex word of a slot: the half of seq that holds its low 32 bits (they change on every write;
 * a waiter that saw seq sleeps only while they still read the same). */
static uint32_t *seq_word(const board_slot *s) {
  uint32_t *halves = (uint32_t *)(uintptr_t)&s->seq;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  return halves + 1;
#else
  return halves;
#endif
}

/* Shared futexes (no FUTEX_PRIVATE_FLAG): writer and waiters are different processes mapping one file. */
static void wake_slot(const board_slot *s) { syscall(SYS_futex, seq_word(s), FUTEX_WAKE, INT_MAX, NULL, NULL, 0); }

void aib_board_write(void *board, uint32_t slot, uint64_t serial, uint64_t version) {
  board_slot *s = (board_slot *)board + slot;
  uint64_t seq = atomic_load_explicit(&s->seq, memory_order_relaxed);
  atomic_store_explicit(&s->seq, seq + 1, memory_order_relaxed);
  atomic_thread_fence(memory_order_release); /* odd before the fields change */
  atomic_store_explicit(&s->serial, serial, memory_order_relaxed);
  atomic_store_explicit(&s->version, version, memory_order_relaxed);
  atomic_store_explicit(&s->seq, seq + 2, memory_order_release); /* the fields before even */
  wake_slot(s);
}

/* Tries before a read gives up: a writer holds a slot odd for a few stores, so collisions end at
 * once unless the publisher died mid-write (then the round trip reports it). */
#define READ_TRIES 64

int aib_board_peek(const void *board, uint32_t slot, uint64_t *seq, uint64_t *serial, uint64_t *version) {
  board_slot *s = (board_slot *)board + slot; /* read only: atomic loads do not write */
  for (int i = 0; i < READ_TRIES; i++) {
    uint64_t before = atomic_load_explicit(&s->seq, memory_order_acquire);
    if (before & 1) continue;
    uint64_t got_serial = atomic_load_explicit(&s->serial, memory_order_relaxed);
    uint64_t got_version = atomic_load_explicit(&s->version, memory_order_relaxed);
    atomic_thread_fence(memory_order_acquire); /* the fields before seq again */
    if (atomic_load_explicit(&s->seq, memory_order_relaxed) == before) {
      *seq = before;
      *serial = got_serial;
      *version = got_version;
      return 1;
    }
  }
  return 0;
}

int aib_board_read(const void *board, uint32_t slot, uint64_t *serial, uint64_t *version) {
  uint64_t seq;
  return aib_board_peek(board, slot, &seq, serial, version);
}

int aib_board_wait(const void *board, uint32_t slot, uint64_t seen_seq, int64_t timeout_ns) {
  const board_slot *s = (const board_slot *)board + slot;
  if (timeout_ns < 0) timeout_ns = 0;
  struct timespec limit = {.tv_sec = (time_t)(timeout_ns / 1000000000), .tv_nsec = (long)(timeout_ns % 1000000000)};
  /* Returns at once when the word differs from what the caller saw (a write came in between). */
  long rc = syscall(SYS_futex, seq_word(s), FUTEX_WAIT, (uint32_t)seen_seq, &limit, NULL, 0);
  return rc != 0 && errno == ETIMEDOUT;
}

/* A pause between polls: lets a sibling hyperthread run and spares the memory bus. */
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

int aib_board_spin(const void *board, uint32_t slot, uint64_t seen_seq, int64_t spin_ns, const int *stop) {
  board_slot *s = (board_slot *)board + slot;
  int64_t end = aib_monotonic_ns() + (spin_ns > 0 ? spin_ns : 0);
  do {
    for (int i = 0; i < 64; i++) { /* the clock read every 64 polls: it costs more than a poll */
      if (atomic_load_explicit(&s->seq, memory_order_acquire) != seen_seq) return 1;
      cpu_relax();
    }
    if (__atomic_load_n(stop, __ATOMIC_RELAXED)) return 1; /* the board is closing: look again */
  } while (aib_monotonic_ns() < end);
  return 0;
}

void aib_board_wake(const void *board, uint32_t slot) { wake_slot((const board_slot *)board + slot); }
