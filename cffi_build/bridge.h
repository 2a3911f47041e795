/* Public interface of the arrow_ipc_bridge C core.
 *
 * Read by the C compiler and by cffi's cdef (build_bridge.py strips lines starting with '#', except
 * '#define NAME <integer>' which cdef understands). Keep declarations cdef-friendly: no macros with
 * arguments, no inline code. See docs/c-core.md for the ownership model. */
#ifndef AIB_BRIDGE_H
#define AIB_BRIDGE_H
#include <stddef.h>
#include <stdint.h>
#include "arrow_c_abi.h"

/* ---------- version ---------------------------------------------------------------------------- */
const char *aib_core_version(void);     /* compiled-in package version; _ffi.py refuses a mismatch */
uint32_t aib_wire_version(void);        /* (major << 16) | minor of the wire format this core speaks */

/* ---------- errors ----------------------------------------------------------------------------- */
#define AIB_OK 0
#define AIB_E_WIRE 1          /* malformed or inconsistent message */
#define AIB_E_FORMAT 2        /* format string not understood, or a struct breaks its layout */
#define AIB_E_NOMEM 3
#define AIB_E_RELEASED 4      /* struct already released / moved */
/* AIB_E_LIMIT: describe/encode met a count or size over a documented limit (also the encoder's
 * "output buffer too small" answer). The decoder reports malformed and over-limit messages alike as
 * AIB_E_WIRE, except nesting depth and schema node count (AIB_E_LIMIT); Python maps both to
 * ProtocolError. */
#define AIB_E_LIMIT 5
#define AIB_E_STATE 6         /* call out of order (e.g. batch before schema) */
#define AIB_E_OS 7            /* a system call failed; errno_value says which */
#define AIB_E_PEER_CLOSED 8   /* the peer closed the connection (EOF at a frame boundary, reset) */
#define AIB_E_TIMEOUT 9       /* a wait went past its deadline */
#define AIB_E_PROTOCOL 10     /* the peer broke the framing (bad header, EOF mid-frame, fd count) */

typedef struct aib_error {
  int code;
  int errno_value;
  char field[64];       /* the offending field, e.g. "buffers[1].length" */
  char path[256];       /* node path, e.g. "batch0/root/child2/dictionary" */
  char message[320];
} aib_error;

/* ---------- owners: reference-counted lifetime records ------------------------------------------
 * Every struct tree the core builds holds one reference per node on an owner. Owners may hold
 * references on other owners (an import lease holds its region mappings). aib_owner_unref is safe
 * from any thread without the GIL. When an owner with a non-zero token dies, the token is queued and
 * one byte is written to the reaper pipe; Python drains the queue (see runtime/reaper.py for why). */
typedef struct aib_owner aib_owner;
typedef struct aib_decoded aib_decoded;

aib_owner *aib_owner_new(uint64_t token);
/* Maps [file_offset, file_offset + size) of fd read-only and shared; munmaps when the owner dies.
 * Returns NULL with *errno_out set on failure. file_offset must be page aligned. */
aib_owner *aib_owner_new_mapping(uint64_t token, int fd, uint64_t file_offset, uint64_t size,
                                 void **address_out, int *errno_out);
/* Takes ownership of a schema and n device arrays (moved in by the caller; the pointers themselves
 * are freed too). Releases them when the owner dies: this is how a producer's data stays alive. */
aib_owner *aib_owner_new_capture(uint64_t token, struct ArrowSchema *schema,
                                 struct ArrowDeviceArray **arrays, int64_t n_arrays);
/* An owner holding `size` bytes of host memory (64-byte aligned, uninitialised), freed when it
 * dies: the target of device-to-host copies whose structs must keep it alive. NULL on failure. */
aib_owner *aib_owner_new_host_buffer(uint64_t token, uint64_t size, void **address_out);
int aib_owner_add_dependency(aib_owner *owner, aib_owner *dependency);
/* Makes owner hold every dependency of source but `except` (NULL: all): what keeps source's
 * regions open keeps them open for owner too. On failure owner may hold some of them. */
int aib_owner_copy_dependencies(aib_owner *owner, aib_owner *source, aib_owner *except);
/* An 8-byte slot inside the owner, valid while the owner lives: rebuilt device arrays point their
 * sync_event here (the spec wants a pointer to the CUevent, which must outlive every struct). */
uint64_t *aib_owner_slot(aib_owner *owner);
/* The owner takes the decoded message and frees it when it dies, so anything holding the owner
 * (a served stream, an imported array's structs) can keep rebuilding from it. */
int aib_owner_attach_decoded(aib_owner *owner, aib_decoded *decoded);
/* The owner keeps source alive and uses source's decoded message as its own (an identical message
 * imported again shares the first decode). AIB_E_STATE when source has none or owner has one. */
int aib_owner_share_decoded(aib_owner *owner, aib_owner *source);
/* The same, without source's view: owner names the message's regions at bases of its own
 * (aib_owner_set_view), e.g. an import of the same message mapped in another GPU's context. */
int aib_owner_share_decoded_only(aib_owner *owner, aib_owner *source);
/* Records where the owner's decoded message has its regions in this process (bases copied) and on
 * which device, so that structs can be rebuilt from the owner alone (aib_py_capsules_function);
 * owners sharing its decode share this too. AIB_E_STATE when it has one already. */
int aib_owner_set_view(aib_owner *owner, const uint64_t *bases, size_t n_bases, int32_t device_type,
                       int64_t device_id);
void aib_owner_ref(aib_owner *owner);
void aib_owner_unref(aib_owner *owner);
int64_t aib_owner_refcount(aib_owner *owner);
uint64_t aib_owner_token(aib_owner *owner);

int aib_reaper_fd(void);                                   /* read end of the wake-up pipe */
size_t aib_reaper_drain(uint64_t *tokens_out, size_t max); /* pops up to max dead-owner tokens */
/* on != 0: owners dying on this thread queue their tokens without waking the reaper thread; the
 * caller drains the queue itself when it sets it back to 0. */
void aib_reaper_quiet(int on);

/* Leak accounting for tests: live owners, live struct nodes built by the core, live mappings. */
int64_t aib_live_owners(void);
int64_t aib_live_nodes(void);
int64_t aib_live_mappings(void);

/* Test hook: calls array->release on a new pthread (no Python thread state, no GIL) and joins it.
 * Returns 0, or an errno value when the thread could not start. */
int aib_debug_release_on_thread(struct ArrowArray *array);

/* ---------- struct allocation, moves, capsules ------------------------------------------------- */
struct ArrowSchema *aib_schema_alloc(void);                /* zeroed: release == NULL */
struct ArrowArray *aib_array_alloc(void);
struct ArrowDeviceArray *aib_device_array_alloc(void);
struct ArrowArrayStream *aib_stream_alloc(void);
struct ArrowDeviceArrayStream *aib_device_stream_alloc(void);
/* free: calls release when it is non-NULL, then frees the allocation. NULL is ignored. */
void aib_schema_free(struct ArrowSchema *p);
void aib_array_free(struct ArrowArray *p);
void aib_device_array_free(struct ArrowDeviceArray *p);
void aib_stream_free(struct ArrowArrayStream *p);
void aib_device_stream_free(struct ArrowDeviceArrayStream *p);

/* Moves: dst must be released (release == NULL); src is marked released. AIB_E_RELEASED when src
 * was already released, AIB_E_STATE when dst still holds data. */
int aib_schema_move(struct ArrowSchema *src, struct ArrowSchema *dst);
int aib_array_move(struct ArrowArray *src, struct ArrowArray *dst);
int aib_device_array_move(struct ArrowDeviceArray *src, struct ArrowDeviceArray *dst);
int aib_stream_move(struct ArrowArrayStream *src, struct ArrowArrayStream *dst);
int aib_device_stream_move(struct ArrowDeviceArrayStream *src, struct ArrowDeviceArrayStream *dst);
/* Wraps a host ArrowArray as a CPU ArrowDeviceArray (moves the array). */
int aib_array_move_to_device(struct ArrowArray *src, struct ArrowDeviceArray *dst);

#define AIB_CAPSULE_SCHEMA 0
#define AIB_CAPSULE_ARRAY 1
#define AIB_CAPSULE_DEVICE_ARRAY 2
#define AIB_CAPSULE_STREAM 3
#define AIB_CAPSULE_DEVICE_STREAM 4
const char *aib_capsule_name(int kind);          /* static storage, e.g. "arrow_device_array" */

/* Every capsule is made, read and destroyed in py_capsules.c, through builtin function objects that
 * take and return Python objects (cffi cannot). aib_py_install, called once with the name of an
 * imported module (arrow_ipc_bridge._ffi), sets them on it as attributes:
 *   new_struct_capsule(kind)     -> (capsule owning a zeroed struct of kind AIB_CAPSULE_*, its address)
 *   capsule_address[kind](obj)   -> the struct's address when obj is a capsule of kind, else 0
 *   capsule_name(obj)            -> the name a capsule carries (bytes), None for anything else
 *   device_array_capsules(message, owner address)
 *                                -> (schema, device array) capsules of the owner's batch 0, or None
 *                                   when the owner cannot build them; ClosedError when message
 *                                   (the Decoded holding the owner) is closed
 *   array_capsules(message, owner address) -> (schema, array) capsules, likewise
 *   dlpack_capsule(owner address, data, device type, device id, code, bits, length)
 *                                -> a "dltensor" capsule over a 1-D tensor holding a reference on owner
 * Returns 0, or -1 after reporting the Python error as unraisable (out of memory, no such module). */
int aib_py_install(const char *module_name);

/* Deep copy of a schema tree into dst (dst gets its own release). */
int aib_schema_copy(const struct ArrowSchema *src, struct ArrowSchema *dst, aib_error *err);
/* A new struct tree with the same buffer pointers as src; every node holds a reference on owner. */
int aib_array_share(const struct ArrowArray *src, aib_owner *owner, struct ArrowArray *dst,
                    aib_error *err);

/* Streams over the data of a capture owner (aib_owner_new_capture): get_schema hands out schema
 * copies, get_next fresh shares of each batch, then end-of-stream. The stream holds a reference on
 * the owner. The device stream takes device type, id and sync event from the first batch. */
int aib_device_stream_from_capture(aib_owner *owner, struct ArrowDeviceArrayStream *out, aib_error *err);
int aib_stream_from_capture(aib_owner *owner, struct ArrowArrayStream *out, aib_error *err);

/* ---------- DLPack ("dltensor" and "dltensor_versioned" capsules) for zero-copy column views -----
 * The DLPack 0.8 and 1.0 ABIs, enough for a 1-D contiguous tensor. The managed tensor holds a reference on
 * the owner of the memory; its deleter drops it. */
typedef struct DLDevice {
  int32_t device_type; /* kDLCPU = 1, kDLCUDA = 2 */
  int32_t device_id;
} DLDevice;

typedef struct DLDataType {
  uint8_t code; /* kDLInt = 0, kDLUInt = 1, kDLFloat = 2 */
  uint8_t bits;
  uint16_t lanes;
} DLDataType;

typedef struct DLTensor {
  void *data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t *shape;
  int64_t *strides;
  uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

/* DLPack 1.x: the versioned managed tensor ("dltensor_versioned" capsules), which carries the ABI
 * version and flags; we set READ_ONLY for host memory (the consumer's mappings are read-only). */
#define AIB_DLPACK_MAJOR 1
#define AIB_DLPACK_MINOR 0
#define AIB_DLPACK_FLAG_READ_ONLY 1
typedef struct DLPackVersion {
  uint32_t major;
  uint32_t minor;
} DLPackVersion;

typedef struct DLManagedTensorVersioned {
  DLPackVersion version;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensorVersioned *self);
  uint64_t flags;
  DLTensor dl_tensor;
} DLManagedTensorVersioned;


/* ---------- layout rules ----------------------------------------------------------------------- */
#define AIB_KIND_NULL 1
#define AIB_KIND_BOOL 2
#define AIB_KIND_FIXED 3          /* ints, floats, decimals, temporal, fixed-size binary */
#define AIB_KIND_BINARY 4         /* z, u */
#define AIB_KIND_LARGE_BINARY 5   /* Z, U */
#define AIB_KIND_VIEW 6           /* vz, vu */
#define AIB_KIND_LIST 7           /* +l */
#define AIB_KIND_LARGE_LIST 8     /* +L */
#define AIB_KIND_LIST_VIEW 9      /* +vl */
#define AIB_KIND_LARGE_LIST_VIEW 10 /* +vL */
#define AIB_KIND_FIXED_LIST 11    /* +w:N */
#define AIB_KIND_STRUCT 12        /* +s */
#define AIB_KIND_MAP 13           /* +m */
#define AIB_KIND_DENSE_UNION 14   /* +ud:... */
#define AIB_KIND_SPARSE_UNION 15  /* +us:... */
#define AIB_KIND_RUN_END 16       /* +r */

#define AIB_MAX_UNION_TYPES 128

typedef struct aib_layout {
  int kind;
  int n_buffers;          /* fixed buffers; a view adds its variadic buffers before the sizes buffer */
  int n_children;         /* required children; -1 = any (struct) */
  int64_t bit_width;      /* element width of the data buffer (FIXED, BOOL = 1) */
  int64_t fixed_size;     /* FIXED_LIST list size */
  int is_integer;         /* usable as a dictionary index or run-end type */
  int n_type_ids;         /* unions */
  int8_t type_ids[128];
} aib_layout;

/* Parses an Arrow format string. AIB_E_FORMAT with a message when it is not understood. */
int aib_layout_parse(const char *format, size_t format_len, aib_layout *out, aib_error *err);

/* Minimum byte size of each buffer for an array of this layout with length and offset, without
 * reading any buffer content. For sizes that depend on data (the data buffer of binary types,
 * variadic buffers) the minimum is 0. n_buffers must fit the layout. */
int aib_layout_min_sizes(const aib_layout *layout, int64_t length, int64_t offset, int64_t n_buffers,
                         int64_t *sizes_out, aib_error *err);

/* ---------- describe + encode (producer) ------------------------------------------------------- */
/* One buffer of the described tree. The core fills address and length; the region assigner fills
 * region (AIB_REGION_NULL, AIB_REGION_EMPTY, or AIB_REGION_FIRST + index) and offset. */
#define AIB_REGION_NULL 0
#define AIB_REGION_EMPTY 1
#define AIB_REGION_FIRST 2

typedef struct aib_buffer_slot {
  uint64_t address;
  uint64_t length;
  uint64_t region;
  uint64_t offset;
} aib_buffer_slot;

/* A length the core could not read because the memory is not host-readable (device memory): the
 * caller reads `width` bytes (a little-endian signed integer; negative is invalid) at `address`
 * and stores the value into slot `slot`'s length via aib_described_set_length. */
typedef struct aib_pending_read {
  uint64_t slot;
  uint64_t address;
  uint32_t width;
  uint32_t reserved;
} aib_pending_read;

typedef struct aib_region {
  uint32_t kind;          /* AIB_REGION_KIND_* */
  uint32_t flags;
  uint64_t size;          /* bytes addressable from the region's base */
  uint64_t file_offset;   /* host regions: where the mapping starts in the file */
  uint64_t identity;      /* producer-side allocation identity (CUDA buffer id, inode, ...) */
  int64_t fd_index;       /* index into the out-of-band fds, -1 when none */
  uint32_t handle_len;
  uint8_t handle[128];
} aib_region;

#define AIB_REGION_KIND_PROCESS 1     /* same-process address space: base 0; never accepted from a peer */
#define AIB_REGION_KIND_HOST_FD 2     /* a shared file (memfd, /dev/shm) mapped read-only */
#define AIB_REGION_KIND_CUDA_LEGACY 3 /* cuIpcGetMemHandle handle (64 bytes) */
#define AIB_REGION_KIND_CUDA_POOL 4   /* IPC mempool: pool fd + 64-byte pointer export data */
#define AIB_REGION_KIND_CUDA_VMM 5    /* cuMem POSIX fd of one VMM allocation */
#define AIB_REGION_KIND_MAX 5
/* Region flag: a CUDA pool allocation the producer never frees while its process lives (a slab). */
#define AIB_REGION_FLAG_KEPT 4

#define AIB_MESSAGE_ARRAY 1     /* exactly one batch, imported as an array */
#define AIB_MESSAGE_STREAM 2    /* zero or more batches, imported as a stream */

typedef struct aib_described aib_described;

aib_described *aib_describe_new(void);
void aib_described_free(aib_described *d);
/* The schema is read once; its strings are copied, so the caller's schema may go away after. */
int aib_describe_schema(aib_described *d, const struct ArrowSchema *schema, aib_error *err);
/* Adds one batch. host_readable: the buffers may be read here (CPU memory) to find the lengths of
 * variable-size data; otherwise pending reads are recorded. */
int aib_describe_batch(aib_described *d, const struct ArrowArray *array, int host_readable,
                       aib_error *err);
size_t aib_described_buffer_count(const aib_described *d);
aib_buffer_slot *aib_described_buffers(aib_described *d);
size_t aib_described_pending_count(const aib_described *d);
const aib_pending_read *aib_described_pending(const aib_described *d);
int aib_described_set_length(aib_described *d, uint64_t slot, uint64_t length, aib_error *err);
/* Places every unplaced slot in region `region_index` at offset (address - base): the same-process
 * fast path (one PROCESS region, base 0) and single-allocation exports. */
void aib_described_place_all(aib_described *d, uint64_t region_index, uint64_t base);
size_t aib_described_node_count(const aib_described *d);   /* schema nodes */
int64_t aib_described_batch_count(const aib_described *d);

typedef struct aib_device_info {
  int32_t device_type;       /* ARROW_DEVICE_* */
  uint32_t identity_len;     /* 16 for a CUDA UUID, 0 for the CPU */
  uint8_t identity[64];
  uint32_t sync_len;         /* 64 for a CUDA IPC event handle, 0 when none */
  uint8_t sync[128];
} aib_device_info;

/* Encodes into out (capacity out_cap). Returns AIB_OK and *out_len, or AIB_E_LIMIT with *out_len
 * set to the size needed when out_cap is too small (call again with a bigger buffer). Region
 * indexes in the slots must be below n_regions; n_fds bounds the regions' fd_index. */
int aib_encode(const aib_described *d, uint32_t message_kind, const aib_device_info *device,
               const aib_region *regions, size_t n_regions, uint32_t n_fds, uint8_t *out,
               size_t out_cap, size_t *out_len, aib_error *err);

/* A live stream's ring (producer/stream_ring.py): what a writer's placements share, and one
 * segment (a host region of the writer's own). The writer fills limit, align, device, out and
 * out_cap; every call sets out_len, needed, changed and err. */
typedef struct aib_ring {
  uint64_t limit;             /* the most bytes of buffers a batch in the ring may take */
  uint64_t align;             /* each buffer's alignment, a power of two */
  aib_device_info device;     /* the messages' device (the CPU) */
  uint8_t *out;               /* the encoded message (the caller's buffer of out_cap bytes) */
  size_t out_cap;
  size_t out_len;             /* the message's size (the size needed after AIB_E_LIMIT) */
  uint64_t needed;            /* the bytes the batch's buffers take from the segment's start */
  int changed;                /* the message differs from the segment's last one */
  aib_error err;
} aib_ring;
typedef struct aib_ring_segment {
  uint64_t base;              /* the region's address here */
  uint64_t start;             /* where its first buffer goes */
  uint64_t capacity;          /* the region's size */
  aib_region region;          /* the message's one region (fd 0) */
  const uint8_t *message;     /* the last message placed in it (the caller's, read only), or NULL */
  size_t message_len;
} aib_ring_segment;
/* A small host batch copied into a ring segment: describes the schema and array at schema_address
 * and array_address (an ArrowDeviceArray's when device_array is non-zero), copies every buffer that
 * is not null or empty to base + start + ... (each at a multiple of align), places it in region 0
 * and encodes the message into ring->out; ring->changed says whether it differs from
 * segment->message. segment NULL: only measures (ring->needed). AIB_E_LIMIT with nothing copied
 * when needed is over limit (not a small batch; UINT64_MAX: a device array not on the CPU) or over
 * capacity - start (too little room); AIB_E_LIMIT after the copy when out_len (the size needed) is
 * over out_cap: call again. AIB_E_RELEASED when either struct was released. */
int aib_ring_place(aib_ring *ring, const aib_ring_segment *segment, uintptr_t schema_address,
                   uintptr_t array_address, int device_array);

/* ---------- decode + validate + rebuild (consumer) --------------------------------------------- */
#define AIB_MAX_MESSAGE_BYTES 67108864
#define AIB_MAX_DEPTH 64
#define AIB_MAX_SCHEMA_NODES 65536
#define AIB_MAX_BATCHES 65536
#define AIB_MAX_ARRAY_NODES 1048576
#define AIB_MAX_BUFFERS 4194304
#define AIB_MAX_REGIONS 65536
#define AIB_MAX_FORMAT_BYTES 4096
#define AIB_MAX_NAME_BYTES 65536
#define AIB_MAX_METADATA_BYTES 1048576
#define AIB_MAX_HANDLE_BYTES 128
#define AIB_MAX_FDS 253

/* Decodes and validates the whole message (every limit, format, arity, buffer bound). On failure
 * returns AIB_E_WIRE/AIB_E_LIMIT/AIB_E_FORMAT with field and path set, and *out stays NULL. */
/* Decode option: accept same-process regions, only for messages this process encoded itself
 * (the in-process fast path). */
#define AIB_DECODE_ALLOW_PROCESS_REGIONS 1
int aib_decode(const uint8_t *message, size_t length, uint32_t n_fds, uint32_t options, aib_decoded **out,
               aib_error *err);
void aib_decoded_free(aib_decoded *d);
uint32_t aib_decoded_message_kind(const aib_decoded *d);
uint32_t aib_decoded_minor_version(const aib_decoded *d);
int64_t aib_decoded_batch_count(const aib_decoded *d);
size_t aib_decoded_region_count(const aib_decoded *d);
const aib_region *aib_decoded_regions(const aib_decoded *d);
const aib_device_info *aib_decoded_device(const aib_decoded *d);
size_t aib_decoded_node_count(const aib_decoded *d);
size_t aib_decoded_buffer_count(const aib_decoded *d);
/* Every buffer reference of every batch (address is 0; region, offset, length as decoded). */
const aib_buffer_slot *aib_decoded_buffers(const aib_decoded *d);

/* A fresh schema tree (own strings). */
int aib_rebuild_schema(const aib_decoded *d, struct ArrowSchema *out, aib_error *err);
/* A fresh array tree for batch `batch`: buffer = region_bases[region] + offset; every node holds a
 * reference on owner. Regions whose base is 0 must not be referenced (AIB_E_STATE otherwise). */
int aib_rebuild_array(const aib_decoded *d, int64_t batch, const uint64_t *region_bases,
                      size_t n_bases, aib_owner *owner, struct ArrowArray *out, aib_error *err);
/* Both at once for __arrow_c_device_array__: the schema, batch `batch` and the device fields.
 * On failure neither is left filled. */
int aib_rebuild_device_array(const aib_decoded *d, int64_t batch, const uint64_t *region_bases, size_t n_bases,
                             aib_owner *owner, int32_t device_type, int64_t device_id, void *sync_event,
                             struct ArrowSchema *schema_out, struct ArrowDeviceArray *out, aib_error *err);

/* Streams over the batches of the decoded message attached to owner (aib_owner_attach_decoded).
 * region_bases are copied. The device stream stamps device_type, device_id and sync_event on every
 * batch; the host stream is for CPU data only. */
int aib_device_stream_from_decoded(aib_owner *owner, const uint64_t *region_bases, size_t n_bases,
                                   int32_t device_type, int64_t device_id, void *sync_event,
                                   struct ArrowDeviceArrayStream *out, aib_error *err);
int aib_stream_from_decoded(aib_owner *owner, const uint64_t *region_bases, size_t n_bases,
                            struct ArrowArrayStream *out, aib_error *err);

/* ---------- content checks (content_check.c) ----------------------------------------------------
 * aib_decode proves every buffer lies inside its region; this proves that the values a reader
 * follows from one buffer into another (offsets, views, dictionary indices, union type ids and
 * offsets, run ends) stay inside what they index. Run after the regions are mapped (region_bases
 * as for aib_rebuild_array), before the import is handed out. docs/wire-format.md, "Content
 * checks", says what each level guarantees. read == NULL: the bases are host addresses read
 * directly; otherwise read(ctx, address, dst, n) copies n bytes at address to dst and returns 0
 * (device memory). A failure is AIB_E_WIRE with the node path, the buffer (field "buffers[i]")
 * and the bad value; AIB_E_STATE for an unmapped region, AIB_E_OS when read fails. */
#define AIB_CHECK_NONE 0
#define AIB_CHECK_BOUNDS 1
#define AIB_CHECK_FULL 2
typedef int (*aib_read_fn)(void *ctx, uint64_t address, void *dst, uint64_t n);
int aib_check_content(const aib_decoded *d, const uint64_t *region_bases, size_t n_bases, int level,
                      aib_read_fn read, void *ctx, aib_error *err);

/* ---------- frames over a socket (channel.c) and the publisher's serve loop (serve.c) ------------
 * The one frame codec; the format is docs/protocol.md's ("Frames"). A channel borrows a connected
 * Unix stream socket's fd; callers serialise receives and sends (the Python Connection's locks).
 * timeout_ms < 0 blocks. A receive that fails other than by a timeout leaves the channel unusable:
 * close the connection. */
typedef struct aib_channel aib_channel;
typedef struct aib_frame {
  uint32_t kind;
  uint32_t n_fds;
  uint64_t length;
  const uint8_t *payload;  /* valid until the next receive on the channel */
  int fds[253];            /* received descriptors, owned by the caller */
} aib_frame;
aib_channel *aib_channel_new(int fd, uint32_t max_payload);
void aib_channel_free(aib_channel *ch);   /* closes descriptors received but not handed out */
size_t aib_channel_buffered(const aib_channel *ch);
/* 1 when part of a frame was received and not handed out (or a frame was abandoned part way): a
 * timed-out receive then cannot be followed by a fresh one at a frame boundary. */
int aib_channel_mid_frame(const aib_channel *ch);
/* Drops what was received and not handed out (closing its descriptors); later receives fail. For a
 * connection being closed. */
void aib_channel_drop(aib_channel *ch);
/* One frame: header, part_a then part_b as its payload, fds attached. AIB_E_PEER_CLOSED on a
 * channel marked closed, AIB_E_LIMIT (payload or fd count over a limit) and AIB_E_STATE (kind over
 * 65535, a descriptor not open) send nothing; a timeout after part of the frame went out is
 * AIB_E_PROTOCOL (the stream is broken). */
int aib_channel_send(aib_channel *ch, uint32_t kind, const uint8_t *part_a, size_t len_a,
                     const uint8_t *part_b, size_t len_b, const int *fds, uint32_t n_fds,
                     int64_t timeout_ms, aib_error *err);
int aib_channel_recv(aib_channel *ch, int64_t timeout_ms, aib_frame *out, aib_error *err);
/* Like recv, for a server waiting for requests: AIB_E_TIMEOUT when idle_ms pass before the first
 * byte of a frame (nothing consumed: call again later); a frame begun must be complete within
 * idle_ms of its first byte, else AIB_E_PROTOCOL. */
int aib_channel_recv_idle(aib_channel *ch, int64_t idle_ms, aib_frame *out, aib_error *err);
/* Payload limits by frame kind for what the channel receives, on top of max_payload: a frame of
 * kind k < n_kinds announcing more than limits[k] bytes, or of a later kind announcing any, is
 * refused from its header before any of its payload is waited for (AIB_E_PROTOCOL, field "length";
 * note ends the message). limits is borrowed (a static table); NULL removes them. */
void aib_channel_limit_kinds(aib_channel *ch, const uint32_t *limits, uint32_t n_kinds, const char *note);
/* 1 when the last receive failed because the peer broke the framing (AIB_E_PROTOCOL from a receive,
 * not from a send): what is sent next still starts at a frame boundary, so the peer can be told why. */
int aib_channel_refused(const aib_channel *ch);
/* Bytes (kernel accounting) sent on the socket that the peer has not read; 0 when it read all. */
int64_t aib_channel_peer_unread(const aib_channel *ch);
/* The connection's closed state, which the channel owns: mark_closed sets it (and returns 1 when it
 * was set already), closed reads it. Nothing else changes: the caller shuts the socket down and
 * closes its descriptor (channel.py). */
int aib_channel_mark_closed(aib_channel *ch);
int aib_channel_closed(const aib_channel *ch);
/* Whether the channel is open and nothing waits to be read on it: not marked closed, no bytes or
 * descriptors buffered, and the socket neither readable nor closed (one poll). A session's get without a round trip needs it, and so does
 * get_next between its sleeps on the board: anything there (a farewell ERROR, an end of file) must be
 * met by a request (channel.c). */
int aib_channel_quiet(aib_channel *ch);
/* send then receive the answer, both within timeout_ms */
int aib_channel_request(aib_channel *ch, uint32_t kind, const uint8_t *payload, size_t length,
                        int64_t timeout_ms, aib_frame *out, aib_error *err);
/* ---------- the version board (board.c) --------------------------------------------------------
 * A shared page of AIB_BOARD_SLOT_SIZE-byte slots: a publisher's table writes each published name's
 * (serial, version) into the name's slot (serial: the version the entry was put at; 0: the slot is
 * empty); sessions map it read-only and read a slot without a round trip (docs/protocol.md). write:
 * one writer per board. read: 1 with a consistent (serial, version), 0 when the slot stayed busy. */
#define AIB_BOARD_SLOT_SIZE 32
#define AIB_BOARD_NO_SLOT 4294967295 /* an answer's slot when the name has none (the board was full) */
#define AIB_BOARD_MAX_SLOTS 1048576
void aib_board_write(void *board, uint32_t slot, uint64_t serial, uint64_t version);
int aib_board_read(const void *board, uint32_t slot, uint64_t *serial, uint64_t *version);
/* peek: read plus the slot's seq, for a wait (1, or 0 when the slot stayed busy). wait: sleep until
 * the slot is written after the caller saw seen_seq, or timeout_ns passed (1: timed out; 0: woken,
 * written meanwhile, or interrupted: peek again). wake: wake the slot's sleepers in this and other
 * processes (a closing session's own waiters); every write wakes them too. */
int aib_board_peek(const void *board, uint32_t slot, uint64_t *seq, uint64_t *serial, uint64_t *version);
int aib_board_wait(const void *board, uint32_t slot, uint64_t seen_seq, int64_t timeout_ns);
/* spin: poll the slot's seq without sleeping for up to spin_ns (1: it changed from seen_seq, or *stop
 * became non-zero; 0: the time passed). A busy core, for a waiter whose next version is due soon. */
int aib_board_spin(const void *board, uint32_t slot, uint64_t seen_seq, int64_t spin_ns, const int *stop);
void aib_board_wake(const void *board, uint32_t slot);
/* Published entries by name. put copies name and message, borrows the fds and takes a reference on
 * keeper; the entry lives while published or leased, then drops the keeper (whose token tells
 * Python to close the export record). remove returns 1 when the name was not published. */
typedef struct aib_pubtable aib_pubtable;
aib_pubtable *aib_pubtable_new(void);
void aib_pubtable_unref(aib_pubtable *t);
void aib_pubtable_clear(aib_pubtable *t);
int aib_pubtable_put(aib_pubtable *t, const uint8_t *name, size_t name_len, const uint8_t *message,
                     size_t message_len, const int *fds, uint32_t n_fds, aib_owner *keeper, aib_error *err);
int aib_pubtable_remove(aib_pubtable *t, const uint8_t *name, size_t name_len);
int64_t aib_pubtable_leases(const aib_pubtable *t);
/* The version of the entry published as name (the table's publish counter when it was put, so
 * every put of any name gets a new, larger one); 0 when the name is not published. */
uint64_t aib_pubtable_version(aib_pubtable *t, const uint8_t *name, size_t name_len);
uint64_t aib_pubtable_renew(aib_pubtable *t, const uint8_t *name, size_t name_len);
/* Keep the board (n_slots slots, zeroed, writable here) up to date from now on: every published
 * name gets a slot while one is free (AIB_BOARD_NO_SLOT otherwise), written on put, renew and remove.
 * NULL detaches it (the caller may unmap it after). Call before the first put or after clear. */
void aib_pubtable_set_board(aib_pubtable *t, void *board, uint32_t n_slots);
/* Descriptors sent in answers that peers may not have read yet, all connections together. */
int64_t aib_pubtable_fds_unread(const aib_pubtable *t);
/* One session's connection: its leases (given back by free) and the serve loop. Until
 * aib_server_conn_welcome, aib_serve returns every frame (HELLO first, answered by Python). Then it
 * answers GET for published names (ITEM + lease), RELEASE and PING until another frame arrives,
 * which it returns with AIB_SERVE_FRAME for Python to handle (the frame's fds are then the
 * caller's). AIB_SERVE_IDLE: idle_ms passed with no frame begun (nothing consumed). The limit
 * returns leave the GET in out for Python to refuse with ERROR; nothing was sent. Any other return
 * is an error code (AIB_E_PEER_CLOSED when the session went away). */
#define AIB_SERVE_FRAME 100
#define AIB_SERVE_IDLE 101
#define AIB_SERVE_LEASE_LIMIT 102  /* the connection holds max_leases leases */
#define AIB_SERVE_UNREAD_LIMIT 103 /* the peer has not read answers with max_unread_fds descriptors */
#define AIB_SERVE_FDS_BUSY 104     /* sendmsg refused the descriptors (ETOOMANYREFS); lease given back */
typedef struct aib_server_conn aib_server_conn;
aib_server_conn *aib_server_conn_new(aib_pubtable *t, aib_channel *ch);
/* Limits (< 0: none): leases this connection may hold; descriptors in answers its peer has not read
 * (a peer that read everything is always answered; all connections together may have half of
 * RLIMIT_NOFILE unread); how long an answer may wait for room in the socket (then AIB_E_TIMEOUT,
 * or AIB_E_PROTOCOL when part of it went out: close the connection). */
void aib_server_conn_configure(aib_server_conn *c, int64_t max_leases, int64_t max_unread_fds,
                               int64_t send_timeout_ms);
void aib_server_conn_welcome(aib_server_conn *c);
/* The most payload a session may send in a frame of this kind (docs/protocol.md, "Limits"), before
 * the handshake (welcomed 0: HELLO's alone) or after it; 0 for kinds sessions do not send. A server
 * connection's channel refuses a frame over it from its header (aib_server_conn_new installs them,
 * aib_server_conn_welcome the ones after the handshake). */
uint32_t aib_request_limit(uint32_t kind, int welcomed);
/* The session mapped the board (it asked with BOARD_FD): GETs are answered with BOARD_ITEM, which
 * adds the entry's version, serial and board slot to the lease id. */
void aib_server_conn_use_board(aib_server_conn *c);
void aib_server_conn_free(aib_server_conn *c);
int64_t aib_server_conn_leases(const aib_server_conn *c);
/* 1 when the connection holds no lease (and its mutex was free): it is then retired, and every later
 * lease on it is refused (AIB_E_PEER_CLOSED), so the server can close it without taking a lease its
 * client relies on. 0 leaves it as it was. */
int aib_server_conn_retire(aib_server_conn *c);
int aib_serve(aib_server_conn *c, int64_t idle_ms, aib_frame *out, aib_error *err);
/* Held waits (feature "watch"), answered from any thread while aib_serve may run on another: the
 * connection's mutex orders them with the loop's own lease table changes and sends (Python's send
 * lock orders them with its other sends). lease_newer leases the entry published as name when its
 * version is over after and sends VERSIONED_ITEM (lease id, version, message; fds), setting
 * *version; AIB_SERVE_ABSENT (not published) and AIB_SERVE_NOT_NEWER send nothing, and so do the
 * limit returns above. send sends one frame without descriptors (an ERROR answering a wait). Both
 * wait at most timeout_ms for the mutex too (AIB_E_TIMEOUT: the loop is stuck answering a client
 * that does not read). */
#define AIB_SERVE_ABSENT 105
#define AIB_SERVE_NOT_NEWER 106
int aib_server_conn_lease_newer(aib_server_conn *c, const uint8_t *name, size_t name_len, uint64_t after,
                                int64_t timeout_ms, uint64_t *version, aib_error *err);
int aib_server_conn_send(aib_server_conn *c, uint32_t kind, const uint8_t *payload, size_t length,
                         int64_t timeout_ms, aib_error *err);
/* ---------- the session's remembered messages (remembered.c) ----------------------------------
 * The one record of a session's remembered messages (docs/lifetime.md 5a): lookup by message bytes
 * (and files), one message per name, the least-recently-used bound (limit; 0 remembers nothing) and
 * the last use of kept leases. put takes a reference on template_owner, which carries the validated
 * decode (aib_owner_share_decoded) and holds the opened regions; event is the opened CUevent for
 * the sync slot (0: none); name NULL: remembered under no name; lingers: the template holds a kept
 * lease (see expire). *id_out is the message's id (0: not remembered, the limit is 0), by which the
 * caller keeps what it needs beside it. A message the set lets go of (replaced by the same bytes or
 * by its name's next message, pushed out by the bound, forgotten, expired) waits until the caller
 * takes its id with take_forgotten (0: none left) and closes its own side. */
typedef struct aib_remembered aib_remembered;
/* A file the template maps, by the (st_dev, st_ino) of the descriptor it arrived with. */
typedef struct aib_file_identity {
  uint64_t dev, ino;
} aib_file_identity;
aib_remembered *aib_remembered_new(size_t limit);
void aib_remembered_free(aib_remembered *r);
void aib_remembered_set_limit(aib_remembered *r, size_t limit);
size_t aib_remembered_limit(aib_remembered *r);
size_t aib_remembered_count(aib_remembered *r);
/* fd_policy AIB_REMEMBERED_SAME_FILES: files holds one identity per descriptor the message travels
 * with, in fd-index order; an answer with the same bytes is imported from it only when its
 * descriptors are those files. AIB_REMEMBERED_ANY_FDS: the descriptors name nothing the bytes do
 * not (a CUDA pool's fd: the pool is named in the message and imported once per process), so any
 * are accepted. Either way the answer's descriptors are closed when it is imported in C. */
#define AIB_REMEMBERED_SAME_FILES 0
#define AIB_REMEMBERED_ANY_FDS 1
int aib_remembered_put(aib_remembered *r, const uint8_t *message, size_t length, aib_owner *template_owner,
                       uint64_t event, const aib_file_identity *files, uint32_t n_files, uint32_t fd_policy,
                       const uint8_t *name, size_t name_len, int lingers, uint64_t *id_out);
/* The id of the message these bytes arriving with these descriptors are (0: not remembered), now
 * the most recently used; *event_out its event. */
uint64_t aib_remembered_find(aib_remembered *r, const uint8_t *message, size_t length, const int *fds,
                             uint32_t n_fds, uint64_t *event_out);
/* Forget the message remembered under name unless its bytes are unless (NULL: in any case); returns
 * how many (0 or 1). */
size_t aib_remembered_forget_name(aib_remembered *r, const uint8_t *name, size_t name_len, const uint8_t *unless,
                                  size_t unless_len);
size_t aib_remembered_forget_all(aib_remembered *r);
/* The board slot and entry serial of the name's remembered message while it holds a standing lease
 * (1), else 0. */
int aib_remembered_board_place(aib_remembered *r, const uint8_t *name, size_t name_len, uint32_t *slot,
                               uint64_t *serial);
/* Forget the messages holding a kept lease that no get used for linger seconds by now
 * (CLOCK_MONOTONIC seconds, Python's time.monotonic()), and give back the standing leases (see
 * aib_session_get) no get used for as long (the message stays remembered); returns the next such
 * deadline, -1 when no kept or standing lease is left. */
double aib_remembered_expire(aib_remembered *r, double now, double linger);
uint64_t aib_remembered_take_forgotten(aib_remembered *r);
typedef struct aib_get_result {
  uint64_t entry_id;
  aib_owner *owner;  /* the lease's owner (token set, sync slot filled); one reference, the caller's */
  uintptr_t owner_address; /* the same, as a number (what py_capsules.c's functions take) */
  uint64_t *sync_slot;  /* the owner's slot holding the CUevent (the spec's sync_event), or NULL */
  uint64_t version;     /* the version got (BOARD_ITEM answers and board reads); 0: not known */
  uint32_t flags;       /* AIB_GET_* flags below */
} aib_get_result;
#define AIB_GET_LOCAL 1    /* answered from the board: no round trip, the standing lease holds the data */
#define AIB_GET_STANDING 2 /* this get took a standing lease for the message (the linger clock runs) */
/* GET name, then: an ITEM carrying a remembered message (and its files) is imported here, the
 * message marked used, and AIB_GET_IMPORTED returned with out filled (entry_id: its id); otherwise AIB_OK with the received frame for the
 * caller (out->owner NULL); or an error code (the channel is then unusable).
 * The lease's owner gets the reaper token lease_tokens | lease id (lease ids from 1 to
 * 2^AIB_LEASE_ID_BITS - 1; others take the caller's path) and holds a reference on keeper, so that what
 * the caller needs to send the RELEASE lives as long as any lease does. */
#define AIB_GET_IMPORTED 101
/* The answer was a message not remembered, imported here because every region of it is open in
 * this process already (region_table.c); out->entry_id is 0. */
#define AIB_GET_IMPORTED_NEW 102
#define AIB_LEASE_ID_BITS 40
/* With board (the publisher's version board mapped here, n_slots slots; NULL: none): a name whose
 * remembered message holds a standing lease is imported without a round trip while the board shows
 * the serial that lease is on and nothing is waiting on the channel (AIB_GET_IMPORTED, flags
 * AIB_GET_LOCAL; the import holds the standing lease). A BOARD_ITEM answer with a remembered message
 * makes that answer's lease the message's standing lease when it has none for that serial
 * (AIB_GET_STANDING): the lease then lives while the message is remembered and some get used it in
 * the last linger seconds (aib_remembered_expire). */
int aib_session_get(aib_channel *ch, const uint8_t *name, size_t name_len, int64_t timeout_ms,
                    aib_remembered *remembered, uint64_t lease_tokens, aib_owner *keeper,
                    const void *board, uint32_t board_slots, aib_get_result *out, aib_frame *frame,
                    aib_error *err);
/* The local part of aib_session_get alone: the name's remembered message imported from the board
 * when it holds a standing lease and the channel has nothing unread (AIB_GET_IMPORTED, out filled,
 * flags AIB_GET_LOCAL); else AIB_OK and nothing sent or changed. Call it as aib_session_get is
 * called (nothing else receiving on ch meanwhile); py_local_get.c's builtin does. */
int aib_session_get_local(aib_channel *ch, aib_remembered *remembered, const void *board, uint32_t board_slots,
                          const uint8_t *name, size_t name_len, aib_get_result *out);
/* ---------- the host modules' libc calls (host_system.c) --------------------------------------
 * On failure *error is errno: mmap_shared returns 0 (a read-write MAP_SHARED mapping of fd from
 * offset 0), pwritev -1 (pairs: count (base, length) pairs, as struct iovec[]), procmap_query -1
 * (PROCMAP_QUERY on an open /proc/self/maps; it sets query->size). */
typedef struct aib_procmap_query {
  uint64_t size, query_flags, query_addr;
  uint64_t vma_start, vma_end, vma_flags, vma_page_size, vma_offset, inode;
  uint32_t dev_major, dev_minor, vma_name_size, build_id_size;
  uint64_t vma_name_addr, build_id_addr;
} aib_procmap_query;
uint64_t aib_sys_mmap_shared(int fd, size_t length, int *error);
int aib_sys_munmap(uint64_t address, size_t length);
int64_t aib_sys_pwritev(int fd, const uint64_t *pairs, int count, int64_t offset, int *error);
int aib_sys_procmap_query(int fd, aib_procmap_query *query, int *error);

#include "bridge_cuda.h"
#include "bridge_stream.h"

#endif
