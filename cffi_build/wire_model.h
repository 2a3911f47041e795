/* The metadata model shared by wire.c (describe, encode, decode, rebuild) and content_check.c (the
 * checks of buffer contents after mapping); not part of the cffi surface. */
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

/* The node's path for error messages: "batch0/root/child1/dictionary" (batch < 0: no batch part). */
void aib_node_path(const model *m, int32_t node, int64_t batch, char *out, size_t cap);

#endif
