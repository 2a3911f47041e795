/* encode: the model + regions + device -> message bytes (docs/wire-format.md is the spec; keep them
 * in step). Trusted input: the model came from describe in this process. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wire_model.h"

/* ---------- encode ------------------------------------------------------------------------------ */
typedef struct writer {
  uint8_t *buf;
  size_t cap, pos;
} writer;

static void put_byte(writer *w, uint8_t b) {
  if (w->pos < w->cap) w->buf[w->pos] = b;
  w->pos++;
}
static void put_varint(writer *w, uint64_t v) {
  while (v >= 0x80) {
    put_byte(w, (uint8_t)(v | 0x80));
    v >>= 7;
  }
  put_byte(w, (uint8_t)v);
}
static void put_raw(writer *w, const void *p, size_t n) {
  if (w->pos + n <= w->cap) memcpy(w->buf + w->pos, p, n);
  w->pos += n;
}
static void put_bytes(writer *w, const void *p, size_t n) {
  put_varint(w, n);
  put_raw(w, p, n);
}

static void encode_metadata(writer *w, const char *md, size_t md_len) {
  if (md_len == 0) {
    put_varint(w, 0);
    return;
  }
  int32_t n;
  memcpy(&n, md, 4);
  put_varint(w, (uint64_t)n);
  size_t pos = 4;
  for (int32_t i = 0; i < 2 * n; i++) {
    int32_t len;
    memcpy(&len, md + pos, 4);
    put_bytes(w, md + pos + 4, (size_t)len);
    pos += 4 + (size_t)len;
  }
}

int aib_encode(const aib_described *d, uint32_t message_kind, const aib_device_info *device, const aib_region *regions,
               size_t n_regions, uint32_t n_fds, uint8_t *out, size_t out_cap, size_t *out_len, aib_error *err) {
  const model *m = &d->m;
  *out_len = 0;
  if (!m->has_schema) return aib_fail(err, AIB_E_STATE, "", "", "nothing described");
  if (message_kind != AIB_MESSAGE_ARRAY && message_kind != AIB_MESSAGE_STREAM)
    return aib_fail(err, AIB_E_STATE, "kind", "", "unknown message kind %u", message_kind);
  if (message_kind == AIB_MESSAGE_ARRAY && m->n_batches != 1)
    return aib_fail(err, AIB_E_STATE, "kind", "", "an array message needs exactly one batch, has %lld",
                    (long long)m->n_batches);
  if (n_regions > AIB_MAX_REGIONS) return aib_fail(err, AIB_E_LIMIT, "regions", "", "too many regions");
  if (n_fds > AIB_MAX_FDS) return aib_fail(err, AIB_E_LIMIT, "fds", "", "more than %d file descriptors", AIB_MAX_FDS);
  if (device->device_type < 1 || device->device_type > 64)
    return aib_fail(err, AIB_E_STATE, "device_type", "", "device type %d is out of range", device->device_type);
  if (device->identity_len > sizeof(device->identity) || device->sync_len > sizeof(device->sync))
    return aib_fail(err, AIB_E_LIMIT, "device", "", "device identity or sync handle too long");
  for (size_t r = 0; r < n_regions; r++) {
    if (regions[r].kind < 1 || regions[r].kind > AIB_REGION_KIND_MAX || regions[r].handle_len > AIB_MAX_HANDLE_BYTES ||
        regions[r].fd_index < -1 || (regions[r].fd_index >= 0 && (uint64_t)regions[r].fd_index >= n_fds))
      return aib_fail(err, AIB_E_STATE, "regions", "", "region %zu is malformed", r);
  }
  for (size_t i = 0; i < m->n_slots; i++) {
    const aib_buffer_slot *b = &m->slots[i];
    if (b->region == REGION_UNASSIGNED)
      return aib_fail(err, AIB_E_STATE, "region", "", "buffer slot %zu was not placed in a region", i);
    if (b->region >= AIB_REGION_FIRST) {
      uint64_t r = b->region - AIB_REGION_FIRST, end;
      if (r >= n_regions || __builtin_add_overflow(b->offset, b->length, &end) || end > regions[r].size)
        return aib_fail(err, AIB_E_STATE, "region", "", "buffer slot %zu lies outside its region", i);
    }
  }

  writer w = {out, out_cap, 0};
  put_raw(&w, WIRE_MAGIC, 4);
  put_byte(&w, WIRE_MAJOR);
  put_byte(&w, WIRE_MINOR);
  put_byte(&w, (uint8_t)message_kind);
  put_byte(&w, 0);
  put_raw(&w, "\0\0\0\0", 4); /* body length, patched below */
  put_raw(&w, "\0\0\0\0", 4); /* required-feature flags: none in 1.0 */

  put_varint(&w, (uint64_t)device->device_type);
  put_bytes(&w, device->identity, device->identity_len);
  put_bytes(&w, device->sync, device->sync_len);

  put_varint(&w, n_regions);
  for (size_t r = 0; r < n_regions; r++) {
    const aib_region *g = &regions[r];
    put_varint(&w, g->kind);
    put_varint(&w, g->flags);
    put_varint(&w, g->size);
    put_varint(&w, g->file_offset);
    put_varint(&w, g->identity);
    put_varint(&w, (uint64_t)(g->fd_index + 1));
    put_bytes(&w, g->handle, g->handle_len);
  }

  for (size_t k = 0; k < m->n_nodes; k++) {
    const snode *s = &m->nodes[k];
    put_bytes(&w, m->arena + s->format_off, s->format_len);
    if (s->has_name) {
      put_varint(&w, (uint64_t)s->name_len + 1);
      put_raw(&w, m->arena + s->name_off, s->name_len);
    } else {
      put_varint(&w, 0);
    }
    encode_metadata(&w, m->arena + s->md_off, s->md_len);
    put_varint(&w, (uint64_t)s->flags);
    put_varint(&w, (uint64_t)s->n_children);
    put_byte(&w, s->dictionary >= 0);
  }

  put_varint(&w, (uint64_t)m->n_batches);
  for (size_t k = 0; k < m->n_anodes; k++) {
    const anode *a = &m->anodes[k];
    put_varint(&w, (uint64_t)a->length);
    put_varint(&w, (uint64_t)(a->null_count + 1));
    put_varint(&w, (uint64_t)a->offset);
    put_varint(&w, a->n_buffers);
    for (uint32_t i = 0; i < a->n_buffers; i++) {
      const aib_buffer_slot *b = &m->slots[a->first_buffer + i];
      put_varint(&w, b->region);
      if (b->region >= AIB_REGION_FIRST) {
        put_varint(&w, b->offset);
        put_varint(&w, b->length);
      }
    }
  }
  put_varint(&w, 0); /* extensions */

  *out_len = w.pos;
  if (w.pos > AIB_MAX_MESSAGE_BYTES)
    return aib_fail(err, AIB_E_LIMIT, "length", "", "message of %zu bytes is over the %d byte limit", w.pos,
                    AIB_MAX_MESSAGE_BYTES);
  if (w.pos > out_cap) return AIB_E_LIMIT; /* *out_len says how much room is needed */
  aib_store_u32le(out + 8, (uint32_t)(w.pos - HEADER_BYTES));
  return AIB_OK;
}
