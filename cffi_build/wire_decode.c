/* decode: message bytes from another process -> the model, validating every field against the
 * limits, the layout rules (layout.c) and the regions before anything is built from it
 * (docs/wire-format.md is the spec; keep them in step). Nothing here trusts the input. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wire_model.h"

/* ---------- decode ------------------------------------------------------------------------------ */
typedef struct reader {
  const uint8_t *p;
  size_t len, pos;
} reader;

static int get_varint(reader *r, uint64_t *out) {
  uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (r->pos >= r->len) return 0;
    uint8_t b = r->p[r->pos++];
    if (shift == 63 && b > 1) return 0; /* more than 64 bits */
    v |= (uint64_t)(b & 0x7f) << shift;
    if (!(b & 0x80)) {
      if (b == 0 && shift > 0) return 0; /* over-long: one value, one encoding */
      *out = v;
      return 1;
    }
  }
  return 0;
}
static size_t remaining(const reader *r) { return r->len - r->pos; }

/* A length-prefixed byte string of at most max bytes; returns a pointer into the message. */
static int get_bytes(reader *r, size_t max, const uint8_t **p, size_t *n) {
  uint64_t len;
  if (!get_varint(r, &len) || len > max || len > remaining(r)) return 0;
  *p = r->p + r->pos;
  *n = (size_t)len;
  r->pos += (size_t)len;
  return 1;
}

#define WIRE_FAIL(field, ...) aib_model_fail_at(err, AIB_E_WIRE, m, node, batch, field, __VA_ARGS__)

static int decode_metadata(reader *r, model *m, snode *s, int32_t node, aib_error *err) {
  const int64_t batch = -1;
  uint64_t pairs;
  if (!get_varint(r, &pairs) || pairs > MAX_METADATA_PAIRS || pairs > remaining(r) / 2)
    return WIRE_FAIL("metadata", "bad metadata pair count");
  if (pairs == 0) return AIB_OK;
  /* Converted to the Arrow C layout (int32 count, int32-prefixed strings) right here, so rebuild
   * is a copy. Total size is bounded by the message size plus 4 bytes per string. */
  size_t start = m->arena_len;
  int32_t count = (int32_t)pairs;
  uint32_t off;
  if (!aib_model_arena_put(m, &count, 4, &off)) return aib_fail(err, AIB_E_NOMEM, "", "", "out of memory");
  m->arena_len--; /* arena_put adds a NUL terminator; metadata entries are packed */
  size_t total = 4;
  for (uint64_t i = 0; i < 2 * pairs; i++) {
    const uint8_t *p;
    size_t n;
    if (!get_bytes(r, AIB_MAX_METADATA_BYTES, &p, &n))
      return WIRE_FAIL("metadata", "metadata string truncated or over %d bytes", AIB_MAX_METADATA_BYTES);
    total += 4 + n;
    if (total > AIB_MAX_METADATA_BYTES) return WIRE_FAIL("metadata", "metadata over %d bytes", AIB_MAX_METADATA_BYTES);
    int32_t len32 = (int32_t)n;
    if (!aib_model_arena_put(m, &len32, 4, &off)) return aib_fail(err, AIB_E_NOMEM, "", "", "out of memory");
    m->arena_len--;
    if (!aib_model_arena_put(m, p, n, &off)) return aib_fail(err, AIB_E_NOMEM, "", "", "out of memory");
    m->arena_len--;
  }
  /* keep a terminator after the blob so the arena stays printable */
  if (!aib_model_arena_put(m, "", 0, &off)) return aib_fail(err, AIB_E_NOMEM, "", "", "out of memory");
  s = &m->nodes[node];
  s->md_off = (uint32_t)start;
  s->md_len = (uint32_t)total;
  return AIB_OK;
}

static int decode_schema_node(reader *r, model *m, int32_t parent, int32_t position, int depth, int32_t *out_idx,
                              aib_error *err) {
  const int64_t batch = -1;
  int32_t node = parent;
  if (depth > AIB_MAX_DEPTH) return aib_model_fail_at(err, AIB_E_LIMIT, m, node, -1, "depth", "nesting deeper than %d", AIB_MAX_DEPTH);
  node = aib_model_new_node(m, parent, position);
  if (node < 0) return aib_model_fail_at(err, AIB_E_LIMIT, m, parent, -1, "nodes", "more than %d schema nodes", AIB_MAX_SCHEMA_NODES);
  const uint8_t *p;
  size_t n;
  uint32_t off;
  if (!get_bytes(r, AIB_MAX_FORMAT_BYTES, &p, &n) || n == 0) return WIRE_FAIL("format", "missing or oversized format");
  if (memchr(p, 0, n) != NULL) return WIRE_FAIL("format", "format contains a NUL byte");
  if (!aib_model_arena_put(m, p, n, &off)) return aib_fail(err, AIB_E_NOMEM, "", "", "out of memory");
  m->nodes[node].format_off = off;
  m->nodes[node].format_len = (uint32_t)n;
  int rc = aib_layout_parse((const char *)p, n, &m->nodes[node].layout, err);
  if (rc != AIB_OK) {
    if (err != NULL) aib_node_path(m, node, -1, err->path, sizeof(err->path));
    return rc;
  }
  uint64_t name_tag;
  if (!get_varint(r, &name_tag) || name_tag > (uint64_t)AIB_MAX_NAME_BYTES + 1 || name_tag - (name_tag > 0) > remaining(r))
    return WIRE_FAIL("name", "bad name length");
  if (name_tag > 0) {
    n = (size_t)name_tag - 1;
    p = r->p + r->pos;
    if (memchr(p, 0, n) != NULL) return WIRE_FAIL("name", "name contains a NUL byte");
    r->pos += n;
    if (!aib_model_arena_put(m, p, n, &off)) return aib_fail(err, AIB_E_NOMEM, "", "", "out of memory");
    m->nodes[node].name_off = off;
    m->nodes[node].name_len = (uint32_t)n;
    m->nodes[node].has_name = 1;
  }
  rc = decode_metadata(r, m, &m->nodes[node], node, err);
  if (rc != AIB_OK) return rc;
  uint64_t flags, n_children;
  if (!get_varint(r, &flags)) return WIRE_FAIL("flags", "truncated");
  if (flags > 0xffff) return WIRE_FAIL("flags", "unknown flag bits 0x%llx", (unsigned long long)flags);
  m->nodes[node].flags = (int64_t)flags;
  if (!get_varint(r, &n_children) || n_children > AIB_MAX_SCHEMA_NODES || n_children > remaining(r))
    return WIRE_FAIL("n_children", "bad child count");
  if (r->pos >= r->len) return WIRE_FAIL("dictionary", "truncated");
  uint8_t has_dictionary = r->p[r->pos++];
  if (has_dictionary > 1) return WIRE_FAIL("dictionary", "dictionary marker must be 0 or 1");
  if (!aib_model_reserve_children(m, node, (int64_t)n_children)) return aib_fail(err, AIB_E_NOMEM, "", "", "out of memory");
  for (uint64_t i = 0; i < n_children; i++) {
    int32_t child;
    rc = decode_schema_node(r, m, node, (int32_t)i, depth + 1, &child, err);
    if (rc != AIB_OK) return rc;
    m->child_list[m->nodes[node].first_child + (int32_t)i] = child;
  }
  if (has_dictionary) {
    int32_t dict;
    rc = decode_schema_node(r, m, node, -1, depth + 1, &dict, err);
    if (rc != AIB_OK) return rc;
    m->nodes[node].dictionary = dict;
  }
  *out_idx = node;
  return aib_model_check_schema_node(m, node, err);
}

/* Checks one array node's buffers against its layout and the regions. */
static int check_buffers(const aib_decoded *d, const model *m, int32_t node, int64_t batch, const anode *a,
                         aib_error *err) {
  const aib_layout *L = &m->nodes[node].layout;
  int64_t small[8];
  int64_t *sizes = a->n_buffers <= 8 ? small : malloc((size_t)a->n_buffers * sizeof(int64_t));
  if (sizes == NULL) return aib_fail(err, AIB_E_NOMEM, "", "", "out of memory");
  int rc = aib_layout_min_sizes(L, a->length, a->offset, a->n_buffers, sizes, err);
  if (rc != AIB_OK) {
    if (err != NULL) aib_node_path(m, node, batch, err->path, sizeof(err->path));
    if (sizes != small) free(sizes);
    return rc;
  }
  for (uint32_t i = 0; rc == AIB_OK && i < a->n_buffers; i++) {
    const aib_buffer_slot *b = &m->slots[a->first_buffer + i];
    const char *field = "buffers"; /* the message names the index; snprintf per buffer costs too much here */
    if (b->region == AIB_REGION_NULL) {
      int may_be_null = sizes[i] == 0 || (aib_layout_is_validity(L, i) && a->null_count <= 0);
      if (!may_be_null)
        rc = aib_model_fail_at(err, AIB_E_WIRE, m, node, batch, field, "buffer %u is absent but must hold %lld bytes",
                     i, (long long)sizes[i]);
    } else if (b->region == AIB_REGION_EMPTY) {
      if (sizes[i] != 0)
        rc = aib_model_fail_at(err, AIB_E_WIRE, m, node, batch, field, "buffer %u is empty but must hold %lld bytes",
                     i, (long long)sizes[i]);
    } else {
      uint64_t r = b->region - AIB_REGION_FIRST, end;
      if (r >= d->n_regions)
        rc = aib_model_fail_at(err, AIB_E_WIRE, m, node, batch, field, "buffer %u: region %llu does not exist (%zu regions)",
                     i, (unsigned long long)r, d->n_regions);
      else if (__builtin_add_overflow(b->offset, b->length, &end) || end > d->regions[r].size)
        rc = aib_model_fail_at(err, AIB_E_WIRE, m, node, batch, field,
                     "buffer %u: bytes [%llu, +%llu) lie outside region %llu of %llu bytes", i, (unsigned long long)b->offset,
                     (unsigned long long)b->length, (unsigned long long)r, (unsigned long long)d->regions[r].size);
      else if (b->length < (uint64_t)sizes[i])
        rc = aib_model_fail_at(err, AIB_E_WIRE, m, node, batch, field, "buffer %u: %llu bytes where length %lld + offset %lld need %lld",
                     i, (unsigned long long)b->length, (long long)a->length, (long long)a->offset, (long long)sizes[i]);
    }
  }
  if (sizes != small) free(sizes);
  return rc;
}

/* Child lengths that follow from the parent's length alone (no buffer content is read). */
static int check_children(const model *m, int32_t node, int64_t batch, const anode *base, aib_error *err) {
  const snode *s = &m->nodes[node];
  const anode *a = &base[node];
  int64_t end = a->offset + a->length;
  for (int32_t i = 0; i < s->n_children; i++) {
    const anode *c = &base[m->child_list[s->first_child + i]];
    int64_t need = 0;
    switch (s->layout.kind) {
      case AIB_KIND_STRUCT:
      case AIB_KIND_SPARSE_UNION:
        need = end;
        break;
      case AIB_KIND_FIXED_LIST:
        if (__builtin_mul_overflow(end, s->layout.fixed_size, &need)) need = INT64_MAX;
        break;
      default:
        break;
    }
    if (c->length < need)
      return aib_model_fail_at(err, AIB_E_WIRE, m, m->child_list[s->first_child + i], batch, "length",
                     "child length %lld is shorter than the %lld its parent addresses", (long long)c->length,
                     (long long)need);
  }
  if (s->layout.kind == AIB_KIND_RUN_END) {
    const anode *ends = &base[m->child_list[s->first_child]];
    const anode *values = &base[m->child_list[s->first_child + 1]];
    if (ends->length != values->length)
      return aib_model_fail_at(err, AIB_E_WIRE, m, node, batch, "children", "run ends (%lld) and values (%lld) differ in length",
                     (long long)ends->length, (long long)values->length);
    if (a->length > 0 && ends->length == 0)
      return aib_model_fail_at(err, AIB_E_WIRE, m, node, batch, "children", "a non-empty run-end array needs runs");
  }
  return AIB_OK;
}

static int decode_batches(reader *r, aib_decoded *d, uint32_t kind, aib_error *err) {
  model *m = &d->m;
  int32_t node = -1;
  int64_t batch = -1;
  uint64_t n_batches;
  if (!get_varint(r, &n_batches) || n_batches > AIB_MAX_BATCHES) return WIRE_FAIL("n_batches", "bad batch count");
  if (kind == AIB_MESSAGE_ARRAY && n_batches != 1) return WIRE_FAIL("n_batches", "an array message has exactly one batch");
  uint64_t total = n_batches * m->n_nodes;
  /* every array node takes at least 4 bytes on the wire: bounds the allocation by the message */
  if (total > AIB_MAX_ARRAY_NODES || total > remaining(r) / 4)
    return WIRE_FAIL("n_batches", "%llu batches of %zu nodes do not fit the message", (unsigned long long)n_batches,
                     m->n_nodes);
  if (!GROW(m, anodes, anodes_cap, (size_t)total)) return aib_fail(err, AIB_E_NOMEM, "", "", "out of memory");
  for (batch = 0; batch < (int64_t)n_batches; batch++) {
    anode *base = &m->anodes[(size_t)batch * m->n_nodes];
    for (node = 0; node < (int32_t)m->n_nodes; node++) {
      anode *a = &base[node];
      uint64_t length, nc1, offset, n_buffers;
      if (!get_varint(r, &length) || length > MAX_LENGTH) return WIRE_FAIL("length", "bad or truncated length");
      if (!get_varint(r, &nc1) || nc1 > length + 1) return WIRE_FAIL("null_count", "null count above the length");
      if (!get_varint(r, &offset) || offset > MAX_LENGTH) return WIRE_FAIL("offset", "bad or truncated offset");
      const aib_layout *L = &m->nodes[node].layout;
      if (!get_varint(r, &n_buffers)) return WIRE_FAIL("n_buffers", "truncated");
      if (L->kind == AIB_KIND_VIEW ? (n_buffers < 3 || n_buffers > 3 + MAX_VARIADIC) : n_buffers != (uint64_t)L->n_buffers)
        return WIRE_FAIL("n_buffers", "%llu buffers where the layout of '%s' has %d%s", (unsigned long long)n_buffers,
                         m->arena + m->nodes[node].format_off, L->n_buffers, L->kind == AIB_KIND_VIEW ? " or more" : "");
      if (m->n_slots + n_buffers > AIB_MAX_BUFFERS || n_buffers > remaining(r))
        return WIRE_FAIL("n_buffers", "buffer count does not fit the message");
      if (!GROW(m, slots, slots_cap, m->n_slots + (size_t)n_buffers))
        return aib_fail(err, AIB_E_NOMEM, "", "", "out of memory");
      a->length = (int64_t)length;
      a->null_count = (int64_t)nc1 - 1;
      a->offset = (int64_t)offset;
      a->n_buffers = (uint32_t)n_buffers;
      a->first_buffer = (uint32_t)m->n_slots;
      for (uint64_t i = 0; i < n_buffers; i++) {
        aib_buffer_slot *b = &m->slots[m->n_slots++];
        b->address = 0;
        b->offset = b->length = 0;
        if (!get_varint(r, &b->region)) return WIRE_FAIL("buffers", "truncated buffer reference");
        if (b->region >= AIB_REGION_FIRST && (!get_varint(r, &b->offset) || !get_varint(r, &b->length)))
          return WIRE_FAIL("buffers", "truncated buffer reference");
      }
      int rc = check_buffers(d, m, node, batch, a, err);
      if (rc != AIB_OK) return rc;
    }
    for (node = 0; node < (int32_t)m->n_nodes; node++) {
      int rc = check_children(m, node, batch, base, err);
      if (rc != AIB_OK) return rc;
    }
  }
  m->n_anodes = (size_t)total;
  m->n_batches = (int64_t)n_batches;
  return AIB_OK;
}

void aib_decoded_release_internal(aib_decoded *d) {
  if (d == NULL) return;
  aib_model_free(&d->m);
  free(d->regions);
  free(d);
}

int aib_owner_attach_decoded(aib_owner *owner, aib_decoded *decoded) {
  return aib_owner_hold_decoded(owner, decoded, aib_decoded_release_internal);
}
void aib_decoded_free(aib_decoded *d) { aib_decoded_release_internal(d); }

int aib_decode(const uint8_t *message, size_t length, uint32_t n_fds, uint32_t options, aib_decoded **out,
               aib_error *err) {
  *out = NULL;
  const model *m = NULL;
  int32_t node = -1;
  int64_t batch = -1;
  if (length < HEADER_BYTES) return WIRE_FAIL("header", "message of %zu bytes is shorter than the header", length);
  if (memcmp(message, WIRE_MAGIC, 4) != 0) return WIRE_FAIL("magic", "not an arrow_ipc_bridge message (bad magic)");
  if (message[4] != WIRE_MAJOR)
    return WIRE_FAIL("version", "wire format major version %u is not supported (this build speaks %d.%d)", message[4],
                     WIRE_MAJOR, WIRE_MINOR);
  uint32_t kind = message[6];
  if (kind != AIB_MESSAGE_ARRAY && kind != AIB_MESSAGE_STREAM) return WIRE_FAIL("kind", "unknown message kind %u", kind);
  if (message[7] != 0) return WIRE_FAIL("reserved", "reserved header byte 7 is %u, must be 0", message[7]);
  uint32_t body = aib_load_u32le(message + 8), flags = aib_load_u32le(message + 12);
  if (length > AIB_MAX_MESSAGE_BYTES) return WIRE_FAIL("length", "message over %d bytes", AIB_MAX_MESSAGE_BYTES);
  if ((size_t)body != length - HEADER_BYTES)
    return WIRE_FAIL("body_length", "header announces %u body bytes, %zu arrived", body, length - HEADER_BYTES);
  if (flags != 0) return WIRE_FAIL("flags", "unsupported required features 0x%x", flags);
  if (n_fds > AIB_MAX_FDS) return WIRE_FAIL("fds", "more than %d file descriptors", AIB_MAX_FDS);

  aib_decoded *d = calloc(1, sizeof(*d));
  if (d == NULL) return aib_fail(err, AIB_E_NOMEM, "", "", "out of memory");
  d->kind = kind;
  d->minor = message[5];
  m = &d->m;
  if (!aib_model_reserve(&d->m, length + 64)) {
    free(d);
    return aib_fail(err, AIB_E_NOMEM, "", "", "out of memory");
  }
  reader rd = {message, length, HEADER_BYTES};
  reader *r = &rd;
  int rc = AIB_OK;
  uint64_t v;
  const uint8_t *p;
  size_t n;

  if (!get_varint(r, &v) || v < 1 || v > 64) {
    rc = WIRE_FAIL("device_type", "bad device type");
    goto fail;
  }
  d->device.device_type = (int32_t)v;
  if (!get_bytes(r, sizeof(d->device.identity), &p, &n)) {
    rc = WIRE_FAIL("device_identity", "bad device identity");
    goto fail;
  }
  memcpy(d->device.identity, p, n);
  d->device.identity_len = (uint32_t)n;
  if (!get_bytes(r, sizeof(d->device.sync), &p, &n)) {
    rc = WIRE_FAIL("sync", "bad sync handle");
    goto fail;
  }
  memcpy(d->device.sync, p, n);
  d->device.sync_len = (uint32_t)n;

  if (!get_varint(r, &v) || v > AIB_MAX_REGIONS || v > remaining(r) / 7) {
    rc = WIRE_FAIL("n_regions", "bad region count");
    goto fail;
  }
  d->n_regions = (size_t)v;
  d->regions = calloc(d->n_regions ? d->n_regions : 1, sizeof(aib_region));
  if (d->regions == NULL) {
    rc = aib_fail(err, AIB_E_NOMEM, "", "", "out of memory");
    goto fail;
  }
  for (size_t i = 0; i < d->n_regions; i++) {
    aib_region *g = &d->regions[i];
    uint64_t kind_v, flags_v, fd1;
    if (!get_varint(r, &kind_v) || !get_varint(r, &flags_v) || !get_varint(r, &g->size) ||
        !get_varint(r, &g->file_offset) || !get_varint(r, &g->identity) || !get_varint(r, &fd1) ||
        !get_bytes(r, AIB_MAX_HANDLE_BYTES, &p, &n)) {
      rc = WIRE_FAIL("regions", "region %zu is truncated or oversized", i);
      goto fail;
    }
    if (kind_v < 1 || kind_v > AIB_REGION_KIND_MAX) {
      rc = WIRE_FAIL("regions", "region %zu has unknown kind %llu", i, (unsigned long long)kind_v);
      goto fail;
    }
    if (kind_v == AIB_REGION_KIND_PROCESS && !(options & AIB_DECODE_ALLOW_PROCESS_REGIONS)) {
      rc = WIRE_FAIL("regions", "region %zu is a same-process region, which another process cannot send", i);
      goto fail;
    }
    if (flags_v > UINT32_MAX) {
      rc = WIRE_FAIL("regions", "region %zu has flags 0x%llx over 32 bits", i, (unsigned long long)flags_v);
      goto fail;
    }
    if (fd1 > n_fds) {
      rc = WIRE_FAIL("regions", "region %zu refers to fd %llu but %u fds arrived", i,
                     (unsigned long long)fd1 - 1, n_fds);
      goto fail;
    }
    g->kind = (uint32_t)kind_v;
    g->flags = (uint32_t)flags_v;
    g->fd_index = (int64_t)fd1 - 1;
    g->handle_len = (uint32_t)n;
    memcpy(g->handle, p, n);
  }

  int32_t root;
  rc = decode_schema_node(r, &d->m, -1, 0, 0, &root, err);
  if (rc != AIB_OK) goto fail;
  d->m.has_schema = 1;
  rc = decode_batches(r, d, kind, err);
  if (rc != AIB_OK) goto fail;

  node = -1;
  if (!get_varint(r, &v) || v > MAX_EXTENSIONS) {
    rc = WIRE_FAIL("extensions", "bad extension count");
    goto fail;
  }
  for (uint64_t i = 0; i < v; i++) {
    uint64_t tag;
    if (!get_varint(r, &tag) || !get_bytes(r, AIB_MAX_MESSAGE_BYTES, &p, &n)) {
      rc = WIRE_FAIL("extensions", "truncated extension");
      goto fail;
    }
    if (tag & 1) {
      rc = WIRE_FAIL("extensions", "unknown required extension %llu", (unsigned long long)tag);
      goto fail;
    }
  }
  if (r->pos != r->len) {
    rc = WIRE_FAIL("length", "%zu trailing bytes after the message", r->len - r->pos);
    goto fail;
  }
  *out = d;
  return AIB_OK;
fail:
  aib_decoded_release_internal(d);
  return rc;
}

uint32_t aib_decoded_message_kind(const aib_decoded *d) { return d->kind; }
uint32_t aib_decoded_minor_version(const aib_decoded *d) { return d->minor; }
int64_t aib_decoded_batch_count(const aib_decoded *d) { return d->m.n_batches; }
size_t aib_decoded_region_count(const aib_decoded *d) { return d->n_regions; }
const aib_region *aib_decoded_regions(const aib_decoded *d) { return d->regions; }
const aib_device_info *aib_decoded_device(const aib_decoded *d) { return &d->device; }
size_t aib_decoded_node_count(const aib_decoded *d) { return d->m.n_nodes; }
size_t aib_decoded_buffer_count(const aib_decoded *d) { return d->m.n_slots; }
const aib_buffer_slot *aib_decoded_buffers(const aib_decoded *d) { return d->m.slots; }
