/* describe: a producer's ArrowSchema/ArrowArray trees -> the metadata model (layouts parsed, buffer
 * sizes known from lengths, offsets and, where host-readable, the values that size them), then the
 * regions the buffers are placed in. The producer side of the wire format (docs/wire-format.md). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wire_model.h"

/* ---------- describe ---------------------------------------------------------------------------- */
aib_described *aib_describe_new(void) { return calloc(1, sizeof(aib_described)); }

void aib_described_free(aib_described *d) {
  if (d == NULL) return;
  aib_model_free(&d->m);
  free(d);
}

static int describe_schema_node(model *m, const struct ArrowSchema *s, int32_t parent, int32_t position,
                                int depth, int32_t *out_idx, aib_error *err) {
  if (depth > AIB_MAX_DEPTH)
    return aib_fail(err, AIB_E_LIMIT, "depth", "", "schema nesting deeper than %d", AIB_MAX_DEPTH);
  if (s == NULL || s->release == NULL)
    return aib_fail(err, AIB_E_RELEASED, "release", "", "schema node is missing or released");
  if (s->format == NULL) return aib_fail(err, AIB_E_FORMAT, "format", "", "schema node has no format");
  int32_t idx = aib_model_new_node(m, parent, position);
  if (idx < 0) return aib_fail(err, AIB_E_LIMIT, "nodes", "", "more than %d schema nodes", AIB_MAX_SCHEMA_NODES);
  snode *n = &m->nodes[idx];
  size_t flen = strlen(s->format);
  int rc = aib_layout_parse(s->format, flen, &n->layout, err);
  if (rc != AIB_OK) {
    if (err != NULL) aib_node_path(m, idx, -1, err->path, sizeof(err->path));
    return rc;
  }
  if (s->n_children < 0 || s->n_children > AIB_MAX_SCHEMA_NODES)
    return aib_model_fail_at(err, AIB_E_LIMIT, m, idx, -1, "n_children", "bad child count %lld", (long long)s->n_children);
  uint32_t format_off, name_off = 0, md_off = 0;
  size_t nlen = s->name ? strlen(s->name) : 0;
  size_t mlen = aib_metadata_length(s->metadata);
  /* The decoder's limits, checked here too, so we never encode a message a peer must refuse. */
  if (flen > AIB_MAX_FORMAT_BYTES)
    return aib_model_fail_at(err, AIB_E_LIMIT, m, idx, -1, "format", "format string over %d bytes", AIB_MAX_FORMAT_BYTES);
  if (nlen > AIB_MAX_NAME_BYTES)
    return aib_model_fail_at(err, AIB_E_LIMIT, m, idx, -1, "name", "field name of %zu bytes is over the %d byte limit", nlen,
                   AIB_MAX_NAME_BYTES);
  if (mlen > AIB_MAX_METADATA_BYTES)
    return aib_model_fail_at(err, AIB_E_LIMIT, m, idx, -1, "metadata", "field metadata of %zu bytes is over the %d byte limit",
                   mlen, AIB_MAX_METADATA_BYTES);
  if (mlen > 0) {
    int32_t pairs;
    memcpy(&pairs, s->metadata, 4);
    if (pairs > MAX_METADATA_PAIRS)
      return aib_model_fail_at(err, AIB_E_LIMIT, m, idx, -1, "metadata", "%d metadata pairs, over the %d limit", pairs,
                     MAX_METADATA_PAIRS);
  }
  if (!aib_model_arena_put(m, s->format, flen, &format_off) || !aib_model_arena_put(m, s->name ? s->name : "", nlen, &name_off) ||
      (mlen && !aib_model_arena_put(m, s->metadata, mlen, &md_off)) || !aib_model_reserve_children(m, idx, s->n_children))
    return aib_fail(err, AIB_E_NOMEM, "", "", "out of memory describing a schema");
  n = &m->nodes[idx];
  n->format_off = format_off;
  n->format_len = (uint32_t)flen;
  n->name_off = name_off;
  n->name_len = (uint32_t)nlen;
  n->has_name = s->name != NULL;
  n->md_off = md_off;
  n->md_len = (uint32_t)mlen;
  n->flags = s->flags;
  for (int64_t i = 0; i < s->n_children; i++) {
    int32_t child;
    rc = describe_schema_node(m, s->children[i], idx, (int32_t)i, depth + 1, &child, err);
    if (rc != AIB_OK) return rc;
    m->child_list[m->nodes[idx].first_child + i] = child;
  }
  if (s->dictionary != NULL) {
    int32_t dict;
    rc = describe_schema_node(m, s->dictionary, idx, -1, depth + 1, &dict, err);
    if (rc != AIB_OK) return rc;
    m->nodes[idx].dictionary = dict;
  }
  *out_idx = idx;
  return aib_model_check_schema_node(m, idx, err);
}

int aib_describe_schema(aib_described *d, const struct ArrowSchema *schema, aib_error *err) {
  if (d->m.has_schema) return aib_fail(err, AIB_E_STATE, "", "", "the schema was already described");
  int32_t root;
  if (!aib_model_reserve(&d->m, 1024)) return aib_fail(err, AIB_E_NOMEM, "", "", "out of memory");
  int rc = describe_schema_node(&d->m, schema, -1, 0, 0, &root, err);
  if (rc != AIB_OK) {
    aib_model_free(&d->m);
    return rc;
  }
  d->m.has_schema = 1;
  return AIB_OK;
}

static uint64_t read_le(const void *address, uint32_t width) {
  switch (width) {
    case 4: { int32_t v; memcpy(&v, address, 4); return v < 0 ? UINT64_MAX : (uint64_t)v; }
    default: { int64_t v; memcpy(&v, address, 8); return v < 0 ? UINT64_MAX : (uint64_t)v; }
  }
}

/* The byte length of a data-dependent buffer: read here when host-readable, else a pending read. */
static int data_length(model *m, size_t slot, const void *value_address, uint32_t width, int host_readable,
                       int32_t node, int64_t batch, aib_error *err) {
  if (host_readable) {
    uint64_t v = read_le(value_address, width);
    if (v > ((uint64_t)1 << 62))
      return aib_model_fail_at(err, AIB_E_FORMAT, m, node, batch, "buffers", "negative or huge offset/size value in the array");
    m->slots[slot].length = v;
    return AIB_OK;
  }
  if (!GROW(m, pending, pending_cap, m->n_pending + 1)) return aib_fail(err, AIB_E_NOMEM, "", "", "out of memory");
  aib_pending_read *p = &m->pending[m->n_pending++];
  p->slot = slot;
  p->address = (uint64_t)(uintptr_t)value_address;
  p->width = width;
  p->reserved = 0;
  return AIB_OK;
}

static int describe_array_node(model *m, int32_t idx, const struct ArrowArray *a, int host_readable, int64_t batch,
                               aib_error *err) {
  const snode *s = &m->nodes[idx];
  const aib_layout *L = &s->layout;
  if (a == NULL || a->release == NULL)
    return aib_model_fail_at(err, AIB_E_RELEASED, m, idx, batch, "release", "array node is missing or released");
  if (a->n_children != s->n_children)
    return aib_model_fail_at(err, AIB_E_FORMAT, m, idx, batch, "n_children", "array has %lld children, schema %d",
                   (long long)a->n_children, s->n_children);
  if ((a->dictionary != NULL) != (s->dictionary >= 0))
    return aib_model_fail_at(err, AIB_E_FORMAT, m, idx, batch, "dictionary", "array and schema disagree about a dictionary");
  if (a->n_buffers < 0 || a->n_buffers > 3 + MAX_VARIADIC)
    return aib_model_fail_at(err, AIB_E_LIMIT, m, idx, batch, "n_buffers", "bad buffer count %lld", (long long)a->n_buffers);
  /* Older producers (pyarrow <= 25 for extension types over null storage) export a null array with
   * one (NULL) validity buffer; the specification gives the null type none. Nothing is read from a
   * null array's buffers, so we describe it as the specification has it. */
  int64_t n_buffers = L->kind == AIB_KIND_NULL ? 0 : a->n_buffers;
  if (a->null_count < -1 || a->null_count > a->length)
    return aib_model_fail_at(err, AIB_E_FORMAT, m, idx, batch, "null_count", "null_count %lld for length %lld",
                   (long long)a->null_count, (long long)a->length);
  anode *an = &m->anodes[(size_t)batch * m->n_nodes + (size_t)idx];
  an->length = a->length;
  an->null_count = a->null_count;
  an->offset = a->offset;
  an->n_buffers = (uint32_t)n_buffers;
  an->first_buffer = (uint32_t)m->n_slots;
  int64_t small[8];
  int64_t *sizes = n_buffers <= 8 ? small : malloc((size_t)n_buffers * sizeof(int64_t));
  if (sizes == NULL) return aib_fail(err, AIB_E_NOMEM, "", "", "out of memory");
  int rc = aib_layout_min_sizes(L, a->length, a->offset, n_buffers, sizes, err);
  if (rc == AIB_OK && m->n_slots + (size_t)n_buffers > AIB_MAX_BUFFERS)
    rc = aib_fail(err, AIB_E_LIMIT, "buffers", "", "more than %d buffers", AIB_MAX_BUFFERS);
  if (rc == AIB_OK && !GROW(m, slots, slots_cap, m->n_slots + (size_t)n_buffers))
    rc = aib_fail(err, AIB_E_NOMEM, "", "", "out of memory");
  int64_t end = a->offset + a->length;
  for (int64_t i = 0; rc == AIB_OK && i < n_buffers; i++) {
    size_t slot = m->n_slots++;
    aib_buffer_slot *b = &m->slots[slot];
    b->address = (uint64_t)(uintptr_t)a->buffers[i];
    b->length = (uint64_t)sizes[i];
    b->offset = 0;
    if (L->kind == AIB_KIND_BINARY || L->kind == AIB_KIND_LARGE_BINARY) {
      if (i == 2 && a->length > 0) {
        uint32_t w = L->kind == AIB_KIND_BINARY ? 4 : 8;
        if (a->buffers[1] == NULL) {
          rc = aib_model_fail_at(err, AIB_E_FORMAT, m, idx, batch, "buffers[1]", "offsets buffer is NULL");
          break;
        }
        rc = data_length(m, slot, (const char *)a->buffers[1] + (size_t)end * w, w, host_readable, idx, batch, err);
      }
    } else if (L->kind == AIB_KIND_VIEW && i >= 2 && i < n_buffers - 1) {
      const void *variadic_sizes = a->buffers[n_buffers - 1];
      if (variadic_sizes == NULL) {
        rc = aib_model_fail_at(err, AIB_E_FORMAT, m, idx, batch, "buffers", "variadic sizes buffer is NULL");
        break;
      }
      rc = data_length(m, slot, (const char *)variadic_sizes + (size_t)(i - 2) * 8, 8, host_readable, idx, batch, err);
    }
    if (rc != AIB_OK) break;
    if (b->address == 0) {
      /* Only a validity bitmap may be left out with data behind it, and only without nulls (a null
       * count of -1 with no bitmap means "no nulls" too). */
      int may_be_null = b->length == 0 || (aib_layout_is_validity(L, i) && a->null_count <= 0);
      if (!may_be_null) {
        rc = aib_model_fail_at(err, AIB_E_FORMAT, m, idx, batch, "buffers", "buffer %lld is NULL but must hold %lld bytes",
                     (long long)i, (long long)b->length);
        break;
      }
      b->region = AIB_REGION_NULL;
      b->length = 0;
    } else {
      b->region = b->length == 0 ? AIB_REGION_EMPTY : REGION_UNASSIGNED;
    }
  }
  if (sizes != small) free(sizes);
  if (rc != AIB_OK) return rc;
  for (int32_t i = 0; i < s->n_children; i++) {
    rc = describe_array_node(m, m->child_list[s->first_child + i], a->children[i], host_readable, batch, err);
    if (rc != AIB_OK) return rc;
  }
  if (s->dictionary >= 0) return describe_array_node(m, s->dictionary, a->dictionary, host_readable, batch, err);
  return AIB_OK;
}

int aib_describe_batch(aib_described *d, const struct ArrowArray *array, int host_readable, aib_error *err) {
  model *m = &d->m;
  if (!m->has_schema) return aib_fail(err, AIB_E_STATE, "", "", "describe the schema before a batch");
  if (m->n_batches >= AIB_MAX_BATCHES || (size_t)(m->n_batches + 1) * m->n_nodes > AIB_MAX_ARRAY_NODES)
    return aib_fail(err, AIB_E_LIMIT, "batches", "", "too many batches for one message");
  if (!GROW(m, anodes, anodes_cap, m->n_anodes + m->n_nodes))
    return aib_fail(err, AIB_E_NOMEM, "", "", "out of memory");
  size_t slots_before = m->n_slots, pending_before = m->n_pending;
  int rc = describe_array_node(m, 0, array, host_readable, m->n_batches, err);
  if (rc != AIB_OK) {
    /* leave the described batches before this one intact */
    m->n_slots = slots_before;
    m->n_pending = pending_before;
    return rc;
  }
  m->n_anodes += m->n_nodes;
  m->n_batches++;
  return AIB_OK;
}

size_t aib_described_buffer_count(const aib_described *d) { return d->m.n_slots; }
aib_buffer_slot *aib_described_buffers(aib_described *d) { return d->m.slots; }
size_t aib_described_pending_count(const aib_described *d) { return d->m.n_pending; }
const aib_pending_read *aib_described_pending(const aib_described *d) { return d->m.pending; }
size_t aib_described_node_count(const aib_described *d) { return d->m.n_nodes; }
int64_t aib_described_batch_count(const aib_described *d) { return d->m.n_batches; }

int aib_described_set_length(aib_described *d, uint64_t slot, uint64_t length, aib_error *err) {
  if (slot >= d->m.n_slots) return aib_fail(err, AIB_E_STATE, "slot", "", "slot %llu out of range", (unsigned long long)slot);
  if (length > ((uint64_t)1 << 62)) return aib_fail(err, AIB_E_FORMAT, "length", "", "negative or huge data length");
  aib_buffer_slot *b = &d->m.slots[slot];
  if (b->address == 0 && length > 0)
    return aib_fail(err, AIB_E_FORMAT, "buffers", "", "a NULL buffer must hold %llu bytes", (unsigned long long)length);
  b->length = length;
  if (b->address != 0) b->region = length == 0 ? AIB_REGION_EMPTY : REGION_UNASSIGNED;
  return AIB_OK;
}

void aib_described_place_all(aib_described *d, uint64_t region_index, uint64_t base) {
  for (size_t i = 0; i < d->m.n_slots; i++) {
    aib_buffer_slot *b = &d->m.slots[i];
    if (b->region != REGION_UNASSIGNED) continue;
    b->region = AIB_REGION_FIRST + region_index;
    b->offset = b->address - base;
  }
}

/* A live stream's small written batch in one call (producer/stream_ring.py): the Python loop over
 * the slots, a memmove per buffer and four other calls cost the writer more than the copy itself.
 * The structs come as addresses (a producer's capsules' pointers, read by the caller), and the
 * rest as two structs the writer keeps: converting each argument in Python cost the writer more
 * than this call's own work. The comparison with the segment's last message lets the writer keep
 * its message object while the layout stays (one object for its schema check and its sends). */
int aib_ring_place(aib_ring *ring, const aib_ring_segment *segment, uintptr_t schema_address,
                   uintptr_t array_address, int device_array) {
  aib_error *err = &ring->err;
  uint64_t align = ring->align;
  ring->needed = 0;
  ring->out_len = 0;
  ring->changed = 0;
  if (align == 0 || (align & (align - 1)) != 0)
    return aib_fail(err, AIB_E_STATE, "align", "", "alignment %llu is not a power of two",
                    (unsigned long long)align);
  const struct ArrowSchema *schema = (const struct ArrowSchema *)schema_address;
  /* An ArrowDeviceArray starts with its ArrowArray. Data on a device is not the ring's: answered
   * as a batch too large for it (the caller exports it instead). */
  const struct ArrowArray *array = (const struct ArrowArray *)array_address;
  if (device_array && array != NULL && array->release != NULL &&
      ((const struct ArrowDeviceArray *)array_address)->device_type != ARROW_DEVICE_CPU) {
    ring->needed = UINT64_MAX;
    return AIB_E_LIMIT;
  }
  aib_described *d = aib_describe_new();
  if (d == NULL) return aib_fail(err, AIB_E_NOMEM, "", "", "allocating a description");
  int rc = aib_describe_schema(d, schema, err);
  if (rc == AIB_OK) rc = aib_describe_batch(d, array, 1, err);
  if (rc != AIB_OK) goto done;
  /* What the unplaced buffers take, each rounded up to the alignment (as they are laid out). */
  uint64_t total = 0, limit = ring->limit;
  for (size_t i = 0; i < d->m.n_slots; i++) {
    const aib_buffer_slot *b = &d->m.slots[i];
    if (b->region != REGION_UNASSIGNED) continue;
    if (b->length > limit) {
      total = limit + 1;
      break;
    }
    total += (b->length + align - 1) & ~(align - 1);
    if (total > limit) break;
  }
  ring->needed = total;
  if (total > limit || segment == NULL || segment->start > segment->capacity ||
      total > segment->capacity - segment->start) {
    rc = AIB_E_LIMIT; /* not small, or only measured, or not room in this region: nothing copied */
    goto done;
  }
  uint64_t offset = segment->start;
  for (size_t i = 0; i < d->m.n_slots; i++) {
    aib_buffer_slot *b = &d->m.slots[i];
    if (b->region != REGION_UNASSIGNED) continue;
    if (b->length)
      memcpy((void *)(uintptr_t)(segment->base + offset), (const void *)(uintptr_t)b->address, b->length);
    b->region = AIB_REGION_FIRST;
    b->offset = offset;
    offset += (b->length + align - 1) & ~(align - 1);
  }
  rc = aib_encode(d, AIB_MESSAGE_ARRAY, &ring->device, &segment->region, 1, 1, ring->out, ring->out_cap,
                  &ring->out_len, err);
  if (rc == AIB_OK)
    ring->changed = segment->message == NULL || segment->message_len != ring->out_len ||
                    memcmp(segment->message, ring->out, ring->out_len) != 0;
done:
  aib_described_free(d);
  return rc;
}
