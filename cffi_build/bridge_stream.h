/* ---------- a live stream's consumer (stream_consume.c) -----------------------------------------
 * A subscription's receive state in C: the next sequence expected, each slot's and ring segment's
 * last message with copies of its descriptors, the ring segments this consumer holds, and the
 * counts (received, dropped, repeated, leases got). aib_stream_rx_next receives one frame and, for a
 * BATCH whose message the session remembers, does the whole batch in one call: the header read as
 * hostile input, the stream's own checks, the remembered import under the batch's lease, the ring
 * segment's seals on its first batch and the content check of every ring batch. Anything else goes
 * back to Python (consumer/live_stream.py), which imports a message it has not seen, and handles the
 * end of the stream and errors. Receives run on one thread at a time (the caller's channel receive
 * lock); aib_stream_rx_released runs on any thread. */
typedef struct aib_stream_rx aib_stream_rx;
typedef struct aib_stream_batch {
  uint64_t sequence;
  uint64_t lease_id;
  uint64_t entry_id;       /* AIB_STREAM_BATCH: the remembered message imported (the session's id) */
  aib_owner *owner;        /* AIB_STREAM_BATCH: the lease's owner, one reference: the caller's */
  uintptr_t owner_address; /* the same, as a number */
  uint64_t *sync_slot;     /* the owner's event slot when it holds an event, else NULL */
  uint32_t slot;           /* AIB_STREAM_NO_SLOT: a written batch of no slot */
  uint32_t ring;           /* 1: a segment of the producer's ring */
  /* AIB_STREAM_NEW: the message to import in Python and its descriptors, borrowed (the frame's, or
   * the slot's kept copies when the BATCH repeated its slot); valid until the next call. */
  const uint8_t *message;
  uint64_t message_len;
  const int *fds;
  uint32_t n_fds;
  uint32_t fds_are_frames; /* 1: fds are the frame's (the caller closes them); 0: the slot's kept copies */
} aib_stream_batch;
#define AIB_STREAM_NO_SLOT 4294967295
#define AIB_STREAM_MAX_SLOTS 65536
/* aib_stream_rx_next's answers besides the channel's error codes (the channel is then unusable). */
#define AIB_STREAM_NOTHING 201 /* no frame arrived while looking (spin_ns >= 0) */
#define AIB_STREAM_BATCH 202   /* a batch imported: out filled, the bookkeeping done */
#define AIB_STREAM_NEW 203     /* a batch whose message the session must import: out->message, fds */
#define AIB_STREAM_FRAME 204   /* not a BATCH: the frame is the caller's (its descriptors too) */
#define AIB_STREAM_REFUSED 205 /* this batch refused (err says why; out->lease_id to give back) */
#define AIB_STREAM_BROKEN 206  /* the BATCH broke the stream's protocol (err says how) */
aib_stream_rx *aib_stream_rx_new(uint64_t next_sequence);
/* Closes the slots' kept descriptors. */
void aib_stream_rx_free(aib_stream_rx *s);
/* Forgets every slot's kept message and closes its descriptors (the stream closed). */
void aib_stream_rx_forget_slots(aib_stream_rx *s);
/* The next frame on ch. spin_ns >= 0: only a frame that arrives within spin_ns (looked for without
 * sleeping, the core yielded between looks), else AIB_STREAM_NOTHING; spin_ns < 0: waits up to
 * timeout_ms (< 0: forever). A frame begun is received within timeout_ms. keeper: held by every
 * lease owner made here (the session's lease keeper). check_level: the content check of ring
 * batches (AIB_CHECK_*). */
int aib_stream_rx_next(aib_stream_rx *s, aib_channel *ch, aib_remembered *remembered, uint64_t lease_tokens,
                       aib_owner *keeper, int check_level, int64_t spin_ns, int64_t timeout_ms,
                       aib_stream_batch *out, aib_frame *frame, aib_error *err);
/* A batch of AIB_STREAM_NEW imported in Python: counted and, in a ring segment, held. */
void aib_stream_rx_accept(aib_stream_rx *s, const aib_stream_batch *batch);
/* A batch's lease ended (any thread): its ring segment is no longer held here. */
void aib_stream_rx_released(aib_stream_rx *s, uint64_t lease_id);
/* The counts: received, dropped (gaps in the sequence numbers), repeated (slot repeats), got (leases
 * received), and the last sequence received (-1: none) and the next expected. */
typedef struct aib_stream_counts {
  uint64_t received, dropped, repeated, got, expected;
  int64_t last_sequence;
} aib_stream_counts;
void aib_stream_rx_counts(aib_stream_rx *s, aib_stream_counts *out);
/* The lease owner (token set, holding keeper) for an import of the remembered message these bytes
 * arriving with these descriptors are, the message marked used and *id_out its id; NULL when not
 * remembered (or out of memory). What aib_session_get does for an ITEM, for a stream's BATCH
 * (remembered.c). matched_id: the id of the message these same descriptors matched before (a
 * slot's kept copies), whose files are then not checked again; 0: none. */
aib_owner *aib_remembered_import(aib_remembered *r, const uint8_t *message, size_t length, const int *fds,
                                 uint32_t n_fds, uint64_t matched_id, uint64_t token, aib_owner *keeper,
                                 uint64_t *id_out);
