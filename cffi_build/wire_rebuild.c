/* rebuild: a decoded model + the regions' base addresses in this process -> fresh ArrowSchema /
 * ArrowArray / ArrowDeviceArray trees, each holding a reference on the owner that keeps the regions
 * mapped. The consumer side's hot path: one allocation and one owner reference per tree. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wire_model.h"

/* ---------- rebuild ----------------------------------------------------------------------------- */
/* Zero-length buffers that must not be NULL point here; nobody reads through them. */
static const uint64_t empty_buffer[8] __attribute__((aligned(64)));

/* A rebuilt tree is one allocation: a header, then every node's child pointers, child structs,
 * dictionary struct and buffer pointers, then (schemas) the strings. Each node's private_data is
 * the header, whose count holds the nodes not yet released: a consumer may move a child out and
 * release the parent (the C data interface allows it), and the block lives until the last node is
 * released. One calloc and one owner reference per tree instead of per node, however many columns
 * the batch has. */
typedef struct tree_block {
  atomic_llong live_nodes;
  aib_owner *owner; /* one reference for the whole array tree; NULL for schemas */
} tree_block;

#define TREE_HEADER_SIZE ((sizeof(tree_block) + 15) & ~(size_t)15)

static void tree_node_released(tree_block *t) {
  atomic_fetch_sub(&aib_node_counter, 1);
  if (atomic_fetch_sub_explicit(&t->live_nodes, 1, memory_order_acq_rel) != 1) return;
  aib_owner *owner = t->owner;
  free(t);
  aib_owner_unref(owner); /* last: it may wake the reaper */
}

static void release_tree_schema(struct ArrowSchema *s) {
  if (s == NULL || s->release == NULL) return;
  for (int64_t i = 0; i < s->n_children; i++)
    if (s->children[i]->release != NULL) s->children[i]->release(s->children[i]);
  if (s->dictionary != NULL && s->dictionary->release != NULL) s->dictionary->release(s->dictionary);
  s->release = NULL;
  tree_node_released(s->private_data);
}

static void release_tree_array(struct ArrowArray *a) {
  if (a == NULL || a->release == NULL) return;
  for (int64_t i = 0; i < a->n_children; i++)
    if (a->children[i]->release != NULL) a->children[i]->release(a->children[i]);
  if (a->dictionary != NULL && a->dictionary->release != NULL) a->dictionary->release(a->dictionary);
  a->release = NULL;
  tree_node_released(a->private_data);
}

/* Bytes a tree needs below its root, counted in a first pass so the second cannot fail. */
typedef struct tree_size {
  size_t structs; /* child pointers, child structs, dictionary structs, buffer pointers: 8-aligned */
  size_t strings; /* schemas: format, name and metadata of every node */
  int64_t nodes;
} tree_size;

static void size_schema_node(const model *m, int32_t idx, tree_size *t) {
  const snode *s = &m->nodes[idx];
  t->nodes++;
  t->structs += (size_t)s->n_children * (sizeof(struct ArrowSchema *) + sizeof(struct ArrowSchema));
  if (s->dictionary >= 0) t->structs += sizeof(struct ArrowSchema);
  t->strings += (size_t)s->format_len + 1 + s->name_len + 1 + s->md_len;
  for (int32_t i = 0; i < s->n_children; i++) size_schema_node(m, m->child_list[s->first_child + i], t);
  if (s->dictionary >= 0) size_schema_node(m, s->dictionary, t);
}

static char *copy_string(char **strings, const char *src, size_t len) {
  char *dst = *strings;
  memcpy(dst, src, len);
  dst[len] = '\0';
  *strings += len + 1;
  return dst;
}

static void fill_schema_node(const model *m, int32_t idx, tree_block *t, char **cursor, char **strings,
                             struct ArrowSchema *out) {
  const snode *s = &m->nodes[idx];
  memset(out, 0, sizeof(*out));
  out->format = copy_string(strings, m->arena + s->format_off, s->format_len);
  const char *name = copy_string(strings, m->arena + s->name_off, s->name_len);
  out->name = s->has_name ? name : NULL;
  if (s->md_len) {
    memcpy(*strings, m->arena + s->md_off, s->md_len);
    out->metadata = *strings;
    *strings += s->md_len;
  }
  out->flags = s->flags;
  out->n_children = s->n_children;
  if (s->n_children) {
    struct ArrowSchema **children = (struct ArrowSchema **)*cursor;
    *cursor += (size_t)s->n_children * sizeof(*children);
    struct ArrowSchema *child_structs = (struct ArrowSchema *)*cursor;
    *cursor += (size_t)s->n_children * sizeof(*child_structs);
    for (int32_t i = 0; i < s->n_children; i++) children[i] = &child_structs[i];
    out->children = children;
  }
  if (s->dictionary >= 0) {
    out->dictionary = (struct ArrowSchema *)*cursor;
    *cursor += sizeof(struct ArrowSchema);
  }
  out->private_data = t;
  out->release = release_tree_schema;
  for (int32_t i = 0; i < s->n_children; i++)
    fill_schema_node(m, m->child_list[s->first_child + i], t, cursor, strings, out->children[i]);
  if (s->dictionary >= 0) fill_schema_node(m, s->dictionary, t, cursor, strings, out->dictionary);
}

int aib_rebuild_schema(const aib_decoded *d, struct ArrowSchema *out, aib_error *err) {
  if (out->release != NULL) return aib_fail(err, AIB_E_STATE, "", "", "destination schema is not released");
  tree_size size = {0, 0, 0};
  size_schema_node(&d->m, 0, &size);
  tree_block *t = calloc(1, TREE_HEADER_SIZE + size.structs + size.strings);
  if (t == NULL) return aib_fail(err, AIB_E_NOMEM, "", "", "out of memory rebuilding a schema");
  atomic_init(&t->live_nodes, size.nodes);
  atomic_fetch_add(&aib_node_counter, size.nodes);
  char *cursor = (char *)t + TREE_HEADER_SIZE;
  char *strings = cursor + size.structs;
  fill_schema_node(&d->m, 0, t, &cursor, &strings, out);
  return AIB_OK;
}

/* The first pass over an array tree also checks that every buffer's region is mapped. */
static int size_array_node(const aib_decoded *d, const anode *base, int32_t idx, int64_t batch,
                           const uint64_t *bases, size_t n_bases, tree_size *t, aib_error *err) {
  const model *m = &d->m;
  const snode *s = &m->nodes[idx];
  const anode *a = &base[idx];
  t->nodes++;
  t->structs += (size_t)a->n_buffers * sizeof(void *) +
                (size_t)s->n_children * (sizeof(struct ArrowArray *) + sizeof(struct ArrowArray));
  if (s->dictionary >= 0) t->structs += sizeof(struct ArrowArray);
  for (uint32_t i = 0; i < a->n_buffers; i++) {
    const aib_buffer_slot *b = &m->slots[a->first_buffer + i];
    if (b->region == AIB_REGION_NULL || b->region == AIB_REGION_EMPTY) continue;
    uint64_t r = b->region - AIB_REGION_FIRST;
    /* base 0 means "not mapped", except for the same-process region whose base is address 0 */
    if (r >= n_bases || (bases[r] == 0 && d->regions[r].kind != AIB_REGION_KIND_PROCESS))
      return aib_model_fail_at(err, AIB_E_STATE, m, idx, batch, "region", "region %llu is not mapped", (unsigned long long)r);
  }
  int rc = AIB_OK;
  for (int32_t i = 0; rc == AIB_OK && i < s->n_children; i++)
    rc = size_array_node(d, base, m->child_list[s->first_child + i], batch, bases, n_bases, t, err);
  if (rc == AIB_OK && s->dictionary >= 0) rc = size_array_node(d, base, s->dictionary, batch, bases, n_bases, t, err);
  return rc;
}

static void fill_array_node(const aib_decoded *d, const anode *base, int32_t idx, const uint64_t *bases,
                            tree_block *t, char **cursor, struct ArrowArray *out) {
  const model *m = &d->m;
  const snode *s = &m->nodes[idx];
  const anode *a = &base[idx];
  memset(out, 0, sizeof(*out));
  out->length = a->length;
  out->null_count = a->null_count;
  out->offset = a->offset;
  out->n_buffers = a->n_buffers;
  out->n_children = s->n_children;
  if (a->n_buffers) {
    const void **buffers = (const void **)*cursor;
    *cursor += (size_t)a->n_buffers * sizeof(*buffers);
    for (uint32_t i = 0; i < a->n_buffers; i++) {
      const aib_buffer_slot *b = &m->slots[a->first_buffer + i];
      if (b->region == AIB_REGION_NULL && aib_layout_is_validity(&s->layout, i))
        buffers[i] = NULL; /* no bitmap: no nulls */
      else if (b->region == AIB_REGION_NULL || b->region == AIB_REGION_EMPTY || b->length == 0)
        /* A buffer of no bytes: readers may still load the first offset of an empty array, so it
         * points at zeros of ours rather than at whatever follows it in a region. A producer may
         * leave an empty array's offsets NULL (decode admits it: they need no bytes), but pyarrow
         * refuses a NULL offsets buffer and polars panics on one: it gets the same zeros. */
        buffers[i] = empty_buffer;
      else
        buffers[i] = (const void *)(uintptr_t)(bases[b->region - AIB_REGION_FIRST] + b->offset);
    }
    out->buffers = buffers;
  }
  if (s->n_children) {
    struct ArrowArray **children = (struct ArrowArray **)*cursor;
    *cursor += (size_t)s->n_children * sizeof(*children);
    struct ArrowArray *child_structs = (struct ArrowArray *)*cursor;
    *cursor += (size_t)s->n_children * sizeof(*child_structs);
    for (int32_t i = 0; i < s->n_children; i++) children[i] = &child_structs[i];
    out->children = children;
  }
  if (s->dictionary >= 0) {
    out->dictionary = (struct ArrowArray *)*cursor;
    *cursor += sizeof(struct ArrowArray);
  }
  out->private_data = t;
  out->release = release_tree_array;
  for (int32_t i = 0; i < s->n_children; i++)
    fill_array_node(d, base, m->child_list[s->first_child + i], bases, t, cursor, out->children[i]);
  if (s->dictionary >= 0) fill_array_node(d, base, s->dictionary, bases, t, cursor, out->dictionary);
}

int aib_rebuild_array(const aib_decoded *d, int64_t batch, const uint64_t *region_bases, size_t n_bases,
                      aib_owner *owner, struct ArrowArray *out, aib_error *err) {
  if (out->release != NULL) return aib_fail(err, AIB_E_STATE, "", "", "destination array is not released");
  if (batch < 0 || batch >= d->m.n_batches)
    return aib_fail(err, AIB_E_STATE, "batch", "", "batch %lld out of range", (long long)batch);
  const anode *base = &d->m.anodes[(size_t)batch * d->m.n_nodes];
  tree_size size = {0, 0, 0};
  int rc = size_array_node(d, base, 0, batch, region_bases, n_bases, &size, err);
  if (rc != AIB_OK) return rc;
  tree_block *t = calloc(1, TREE_HEADER_SIZE + size.structs);
  if (t == NULL) return aib_fail(err, AIB_E_NOMEM, "", "", "out of memory rebuilding an array");
  atomic_init(&t->live_nodes, size.nodes);
  atomic_fetch_add(&aib_node_counter, size.nodes);
  aib_owner_ref(owner);
  t->owner = owner;
  char *cursor = (char *)t + TREE_HEADER_SIZE;
  fill_array_node(d, base, 0, region_bases, t, &cursor, out);
  return AIB_OK;
}

int aib_rebuild_device_array(const aib_decoded *d, int64_t batch, const uint64_t *region_bases, size_t n_bases,
                             aib_owner *owner, int32_t device_type, int64_t device_id, void *sync_event,
                             struct ArrowSchema *schema_out, struct ArrowDeviceArray *out, aib_error *err) {
  if (out->array.release != NULL)
    return aib_fail(err, AIB_E_STATE, "", "", "destination device array is not released");
  int rc = aib_rebuild_schema(d, schema_out, err);
  if (rc) return rc;
  rc = aib_rebuild_array(d, batch, region_bases, n_bases, owner, &out->array, err);
  if (rc) {
    schema_out->release(schema_out);
    return rc;
  }
  out->device_type = device_type;
  out->device_id = device_id;
  out->sync_event = sync_event;
  return AIB_OK;
}
