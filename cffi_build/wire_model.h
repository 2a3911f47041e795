/* The metadata model: what a message means, the same for both directions, so the producer and the
 * consumer agree by construction. Shared by the stages of the wire format (wire_describe.c,
 * wire_encode.c, wire_decode.c, wire_rebuild.c; operations in wire_model.c) and content_check.c (the
 * checks of buffer contents after mapping); not part of the cffi surface.
 *
 *   describe: producer's ArrowSchema/ArrowArray trees -> model (layouts parsed, buffer sizes known)
 *   encode:   model + regions + device -> message bytes
 *   decode:   message bytes -> model, validating every field against limits, layouts and regions
 *   rebuild:  model + region base addresses -> fresh ArrowSchema/ArrowArray trees
 *
 * Schema nodes are stored in pre-order (node, children, dictionary); each batch stores one array
 * node per schema node in the same order. */
#ifndef AIB_WIRE_MODEL_H
#define AIB_WIRE_MODEL_H
#include "internal.h"

typedef struct snode {
  uint32_t format_off, format_len; /* arena offsets: the arena may move while it grows */
  uint32_t name_off, name_len;
  uint32_t md_off, md_len; /* Arrow C metadata blob; md_len == 0: no metadata */
  int has_name;
  int64_t flags;
  int32_t n_children, first_child; /* children indexes live in child_list[first_child ...] */
  int32_t dictionary;              /* node index, -1 when none */
  int32_t parent, position;        /* for error paths; position -1 = dictionary of parent */
  aib_layout layout;
} snode;

typedef struct anode {
  int64_t length, null_count, offset;
  uint32_t first_buffer, n_buffers;
} anode;

typedef struct model {
  char *arena;
  size_t arena_len, arena_cap;
  snode *nodes;
  size_t n_nodes, nodes_cap;
  int32_t *child_list;
  size_t n_child_list, child_cap;
  anode *anodes;
  size_t n_anodes, anodes_cap;
  aib_buffer_slot *slots;
  size_t n_slots, slots_cap;
  aib_pending_read *pending;
  size_t n_pending, pending_cap;
  int64_t n_batches;
  int has_schema;
} model;

struct aib_described {
  model m;
};

struct aib_decoded {
  model m;
  uint32_t kind, minor;
  aib_device_info device;
  aib_region *regions;
  size_t n_regions;
};

#define WIRE_MAGIC "AIBM"
#define WIRE_MAJOR 1
#define WIRE_MINOR 0
#define HEADER_BYTES 16
#define MAX_VARIADIC 65536
#define MAX_EXTENSIONS 64
#define MAX_METADATA_PAIRS 65536
#define MAX_LENGTH ((uint64_t)1 << 56)
#define REGION_UNASSIGNED UINT64_MAX

/* Grows *p (an array of *cap elements of elem bytes) to hold need; 0 when out of memory. */
int aib_model_grow(void **p, size_t *cap, size_t need, size_t elem);
#define GROW(m, field, capfield, need) aib_model_grow((void **)&(m)->field, &(m)->capfield, (need), sizeof(*(m)->field))
void aib_model_free(model *m);
/* Sizes the model's arrays once for a typical message, so small messages cost no reallocs. */
int aib_model_reserve(model *m, size_t arena_bytes);
/* Copies n bytes (plus a NUL) into the arena; *off_out is where. 0 when out of memory or too big. */
int aib_model_arena_put(model *m, const void *data, size_t n, uint32_t *off_out);
/* Reserves a new schema node (zeroed, parent and position set) and returns its index or -1. */
int32_t aib_model_new_node(model *m, int32_t parent, int32_t position);
/* Reserves n_children entries of the child list for node idx; 0 when out of memory. */
int aib_model_reserve_children(model *m, int32_t idx, int64_t n_children);
/* Fails with the node path filled in. */
int aib_model_fail_at(aib_error *err, int code, const model *m, int32_t node, int64_t batch, const char *field,
                      const char *fmt, ...) __attribute__((format(printf, 7, 8)));
/* Checks one schema node once its children and dictionary are in the model: the rules that need
 * more than the node's own format string. Shared by describe (catches producer bugs) and decode. */
int aib_model_check_schema_node(const model *m, int32_t idx, aib_error *err);

/* The node's path for error messages: "batch0/root/child1/dictionary" (batch < 0: no batch part). */
void aib_node_path(const model *m, int32_t node, int64_t batch, char *out, size_t cap);

#endif
