/* The imported data's sync_event is handed out only while the producer's work is still pending.
 *
 * The C Device interface lets sync_event be NULL when no synchronisation is needed. A consumer
 * that finds an event waits on it (cudaStreamWaitEvent through its library: a call from Python into
 * the CUDA runtime on every get), yet in the steady state — data published once,
 * got again and again — the producer's event completed long ago. So every struct handed to a
 * consumer asks the driver first (cuEventQuery on a completed event: one driver call from C, which
 * returns at once) and carries the event only if the query does not say "complete". Any answer other than
 * CUDA_SUCCESS keeps the event, so an error (no context, a forked child, a driver that refuses)
 * costs the consumer a wait, never correctness.
 *
 * This is sound for the bridge's own imported events only: the producer re-records a pooled event
 * only after every lease on the export ended (lifetime.md), and every struct here is built under a
 * lease, so "complete" cannot refer to a later recording. Events of captured data belong to other
 * libraries and are passed through unchanged by the callers.
 *
 * The query function is the driver table's (cuda_batch.c), set when cuda/_driver.py loads the
 * driver; until then (and in a fork child) nothing is queried. */
#define _GNU_SOURCE
#include <stdatomic.h>

#include "internal.h"

/* CUresult cuEventQuery(CUevent hEvent) */
typedef int (*event_query_fn)(void *event);

static atomic_ullong events_pending, events_complete;

void *aib_sync_event_if_pending(int32_t device_type, void *sync_event) {
  if (sync_event == NULL) return NULL;
  uintptr_t fn = aib_cuda_event_query();
  /* The spec's CUDA sync_event is a pointer to a CUevent; other device types mean other things. */
  if (fn == 0 || device_type != ARROW_DEVICE_CUDA) return sync_event;
  void *event = *(void **)sync_event;
  if (event != NULL && ((event_query_fn)fn)(event) == 0) {
    atomic_fetch_add_explicit(&events_complete, 1, memory_order_relaxed);
    return NULL;
  }
  atomic_fetch_add_explicit(&events_pending, 1, memory_order_relaxed);
  return sync_event;
}

void aib_sync_event_stats(uint64_t *pending, uint64_t *complete) {
  *pending = atomic_load(&events_pending);
  *complete = atomic_load(&events_complete);
}
