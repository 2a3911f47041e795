/* Content checks: the values inside buffers that index other buffers (offsets, views, dictionary
 * indices, union type ids and offsets, run ends), read after the regions are mapped and before an
 * import is handed out. aib_decode checks that every buffer lies inside its region; this file
 * checks that what a reader follows from one buffer into another stays inside that other buffer.
 * docs/wire-format.md ("Content checks") lists what each level guarantees.
 *
 * Memory is read directly (host mappings) or through a read function (device memory: the caller
 * copies bytes to the host), so the same walk serves both. Every load goes through memcpy: a
 * hostile message may place a buffer at any byte offset, and an unaligned load is undefined. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wire_model.h"

#define SCRATCH_SLOTS 3

typedef struct checker {
  const aib_decoded *d;
  const model *m;
  const uint64_t *bases;
  size_t n_bases;
  int level;
  aib_read_fn read;
  void *ctx;
  aib_error *err;
  int32_t node;  /* where a failure is reported */
  int64_t batch;
  void *scratch[SCRATCH_SLOTS];
  size_t scratch_cap[SCRATCH_SLOTS];
} checker;

static int fail(checker *c, uint32_t buffer, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(checker *c, uint32_t buffer, const char *fmt, ...) {
  if (c->err == NULL) return AIB_E_WIRE;
  char message[sizeof(c->err->message)], path[sizeof(c->err->path)], field[sizeof(c->err->field)];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(message, sizeof(message), fmt, ap);
  va_end(ap);
  aib_node_path(c->m, c->node, c->batch, path, sizeof(path));
  snprintf(field, sizeof(field), "buffers[%u]", buffer);
  return aib_fail(c->err, AIB_E_WIRE, field, path, "%s", message);
}

/* A pointer to bytes [byte_offset, byte_offset + n) of buffer `index` of the current node, in host
 * memory: the mapping itself, or `scratch` filled by the read function. The structural checks of
 * aib_decode already proved the range lies inside the buffer for every caller below; it is checked
 * again here so that a mistake in this file cannot turn into a wild read. */
static int fetch(checker *c, const anode *a, uint32_t index, uint64_t byte_offset, uint64_t n, int scratch,
                 const uint8_t **out) {
  *out = NULL;
  const aib_buffer_slot *b = &c->m->slots[a->first_buffer + index];
  uint64_t end;
  if (n == 0) return AIB_OK;
  if (b->region < AIB_REGION_FIRST || __builtin_add_overflow(byte_offset, n, &end) || end > b->length)
    return fail(c, index, "internal: bytes [%llu, +%llu) are not inside the buffer", (unsigned long long)byte_offset,
                (unsigned long long)n);
  uint64_t r = b->region - AIB_REGION_FIRST;
  if (r >= c->n_bases || c->bases[r] == 0)
    return aib_fail(c->err, AIB_E_STATE, "region", "", "region %llu is not mapped", (unsigned long long)r);
  uint64_t address = c->bases[r] + b->offset + byte_offset;
  if (c->read == NULL) {
    *out = (const uint8_t *)(uintptr_t)address;
    return AIB_OK;
  }
  if (c->scratch_cap[scratch] < n) {
    void *p = realloc(c->scratch[scratch], n);
    if (p == NULL) return aib_fail(c->err, AIB_E_NOMEM, "", "", "out of memory");
    c->scratch[scratch] = p;
    c->scratch_cap[scratch] = n;
  }
  if (c->read(c->ctx, address, c->scratch[scratch], n) != 0)
    return aib_fail(c->err, AIB_E_OS, "region", "", "reading %llu bytes of region %llu failed", (unsigned long long)n,
                    (unsigned long long)r);
  *out = c->scratch[scratch];
  return AIB_OK;
}

/* Little-endian integer of `width` bytes at p (the wire and every supported host are little-endian
 * in buffer contents: Arrow buffers are native, and the bridge runs on one host). */
static int64_t load(const uint8_t *p, int width, int is_signed) {
  switch (width) {
    case 1: { int8_t v; uint8_t u; memcpy(&v, p, 1); memcpy(&u, p, 1); return is_signed ? (int64_t)v : (int64_t)u; }
    case 2: { int16_t v; uint16_t u; memcpy(&v, p, 2); memcpy(&u, p, 2); return is_signed ? (int64_t)v : (int64_t)u; }
    case 4: { int32_t v; uint32_t u; memcpy(&v, p, 4); memcpy(&u, p, 4); return is_signed ? (int64_t)v : (int64_t)u; }
    default: {
      int64_t v;
      uint64_t u;
      memcpy(&v, p, 8);
      memcpy(&u, p, 8);
      /* an unsigned 64-bit value past INT64_MAX is out of every range checked here */
      return is_signed ? v : (u > INT64_MAX ? -1 : (int64_t)u);
    }
  }
}

static int64_t buffer_bytes(const checker *c, const anode *a, uint32_t index) {
  const aib_buffer_slot *b = &c->m->slots[a->first_buffer + index];
  return b->region >= AIB_REGION_FIRST ? (int64_t)b->length : 0;
}

/* Offsets (binary, list, map and their large forms): the n + 1 offsets from the array's offset on
 * must be non-decreasing and lie in [0, limit], limit being the bytes of the data buffer or the
 * child's length. BOUNDS reads only the first and the last. */
static int check_offsets(checker *c, const anode *a, int width, int64_t limit, const char *what) {
  int64_t n = a->length, o = a->offset;
  const uint8_t *p;
  int rc;
  if (c->level == AIB_CHECK_BOUNDS) {
    int64_t first, last;
    if ((rc = fetch(c, a, 1, (uint64_t)o * width, width, 0, &p)) != AIB_OK) return rc;
    first = load(p, width, 1);
    if ((rc = fetch(c, a, 1, (uint64_t)(o + n) * width, width, 0, &p)) != AIB_OK) return rc;
    last = load(p, width, 1);
    if (first < 0 || first > last || last > limit)
      return fail(c, 1, "offsets run from %lld to %lld where %s holds %lld", (long long)first, (long long)last, what,
                  (long long)limit);
    return AIB_OK;
  }
  if ((rc = fetch(c, a, 1, (uint64_t)o * width, (uint64_t)(n + 1) * width, 0, &p)) != AIB_OK) return rc;
  int64_t previous = 0;
  for (int64_t i = 0; i <= n; i++) {
    int64_t v = width == 4 ? load(p + 4 * i, 4, 1) : load(p + 8 * i, 8, 1);
    if (v < previous || v > limit)
      return fail(c, 1, "offset %lld at index %lld is %s (previous %lld, %s holds %lld)", (long long)v,
                  (long long)(o + i), v < previous ? "decreasing or negative" : "past the end", (long long)previous, what,
                  (long long)limit);
    previous = v;
  }
  return AIB_OK;
}

/* Binary and string views: the variadic sizes must fit their buffers; FULL also checks every view
 * (null or not: a reader may look at any slot): length >= 0, and an out-of-line view's buffer index
 * and [offset, offset + length) inside that buffer's declared size. */
static int check_views(checker *c, const anode *a) {
  uint32_t n_variadic = a->n_buffers - 3, sizes_index = a->n_buffers - 1;
  const uint8_t *sizes, *views;
  int rc = fetch(c, a, sizes_index, 0, (uint64_t)n_variadic * 8, 1, &sizes);
  if (rc != AIB_OK) return rc;
  for (uint32_t k = 0; k < n_variadic; k++) {
    int64_t size = load(sizes + 8 * k, 8, 1), held = buffer_bytes(c, a, 2 + k);
    if (size < 0 || size > held)
      return fail(c, sizes_index, "variadic buffer %u declares %lld bytes but holds %lld", k, (long long)size,
                  (long long)held);
  }
  if (c->level != AIB_CHECK_FULL || a->length == 0) return AIB_OK;
  if ((rc = fetch(c, a, 1, (uint64_t)a->offset * 16, (uint64_t)a->length * 16, 0, &views)) != AIB_OK) return rc;
  for (int64_t i = 0; i < a->length; i++) {
    const uint8_t *v = views + 16 * i;
    int64_t length = load(v, 4, 1);
    if (length < 0) return fail(c, 1, "view %lld has negative length %lld", (long long)(a->offset + i), (long long)length);
    if (length <= 12) continue; /* inline */
    int64_t index = load(v + 8, 4, 1), offset = load(v + 12, 4, 1);
    if (index < 0 || index >= (int64_t)n_variadic)
      return fail(c, 1, "view %lld names data buffer %lld of %u", (long long)(a->offset + i), (long long)index, n_variadic);
    int64_t size = load(sizes + 8 * index, 8, 1);
    if (offset < 0 || offset + length > size)
      return fail(c, 1, "view %lld reads bytes [%lld, +%lld) of data buffer %lld, which holds %lld",
                  (long long)(a->offset + i), (long long)offset, (long long)length, (long long)index, (long long)size);
  }
  return AIB_OK;
}

/* List views: every slot's [offset, offset + size) inside the child (FULL only: no O(1) form). */
static int check_list_views(checker *c, const anode *a, int width, int64_t child_length) {
  const uint8_t *offsets, *sizes;
  int rc = fetch(c, a, 1, (uint64_t)a->offset * width, (uint64_t)a->length * width, 0, &offsets);
  if (rc == AIB_OK) rc = fetch(c, a, 2, (uint64_t)a->offset * width, (uint64_t)a->length * width, 1, &sizes);
  if (rc != AIB_OK) return rc;
  for (int64_t i = 0; i < a->length; i++) {
    int64_t offset = load(offsets + width * i, width, 1), size = load(sizes + width * i, width, 1), end;
    if (offset < 0 || size < 0 || __builtin_add_overflow(offset, size, &end) || end > child_length)
      return fail(c, offset < 0 || size >= 0 ? 1 : 2, "list view %lld covers [%lld, +%lld) of a child of length %lld",
                  (long long)(a->offset + i), (long long)offset, (long long)size, (long long)child_length);
  }
  return AIB_OK;
}

/* Unions: every type id one of the declared ones; a dense union's offsets inside the child the
 * type id selects (FULL only). */
static int check_union(checker *c, const snode *s, const anode *a, const anode *base) {
  const aib_layout *L = &s->layout;
  int8_t child_of[128];
  memset(child_of, -1, sizeof(child_of));
  for (int k = 0; k < L->n_type_ids; k++) child_of[(uint8_t)L->type_ids[k] & 127] = (int8_t)k;
  const uint8_t *ids, *offsets = NULL;
  int dense = L->kind == AIB_KIND_DENSE_UNION;
  int rc = fetch(c, a, 0, (uint64_t)a->offset, (uint64_t)a->length, 0, &ids);
  if (rc == AIB_OK && dense) rc = fetch(c, a, 1, (uint64_t)a->offset * 4, (uint64_t)a->length * 4, 1, &offsets);
  if (rc != AIB_OK) return rc;
  for (int64_t i = 0; i < a->length; i++) {
    int8_t id;
    memcpy(&id, ids + i, 1);
    if (id < 0 || child_of[id] < 0)
      return fail(c, 0, "type id %d at index %lld is not one of the union's", id, (long long)(a->offset + i));
    if (!dense) continue;
    const anode *child = &base[c->m->child_list[s->first_child + child_of[id]]];
    int64_t offset = load(offsets + 4 * i, 4, 1);
    if (offset < 0 || offset >= child->length)
      return fail(c, 1, "offset %lld at index %lld is outside child %d of length %lld", (long long)offset,
                  (long long)(a->offset + i), child_of[id], (long long)child->length);
  }
  return AIB_OK;
}

/* Run ends: positive, strictly increasing, the last covering the parent's offset + length (a
 * reader's binary search for any logical index then lands inside the values). BOUNDS checks the
 * last only. Failures name the run-ends child. */
static int check_run_ends(checker *c, const snode *s, const anode *a, const anode *base) {
  int32_t ends_node = c->m->child_list[s->first_child];
  const anode *ends = &base[ends_node];
  int width = (int)(c->m->nodes[ends_node].layout.bit_width / 8);
  int64_t need = a->offset + a->length;
  const uint8_t *p;
  int rc;
  c->node = ends_node;
  if (c->level == AIB_CHECK_BOUNDS) {
    if ((rc = fetch(c, ends, 1, (uint64_t)(ends->offset + ends->length - 1) * width, width, 0, &p)) != AIB_OK) return rc;
    int64_t last = load(p, width, 1);
    if (last < need)
      return fail(c, 1, "the last run end %lld does not cover the parent's %lld values", (long long)last, (long long)need);
    return AIB_OK;
  }
  if ((rc = fetch(c, ends, 1, (uint64_t)ends->offset * width, (uint64_t)ends->length * width, 0, &p)) != AIB_OK)
    return rc;
  int64_t previous = 0;
  for (int64_t i = 0; i < ends->length; i++) {
    int64_t v = load(p + width * i, width, 1);
    if (v <= previous)
      return fail(c, 1, "run end %lld at index %lld is not above the previous %lld", (long long)v,
                  (long long)(ends->offset + i), (long long)previous);
    previous = v;
  }
  if (previous < need)
    return fail(c, 1, "the last run end %lld does not cover the parent's %lld values", (long long)previous, (long long)need);
  return AIB_OK;
}

/* The smallest and largest of n integers at p: one branch-free pass. GCC's -O2 cost model leaves
 * this loop scalar; vectorized it compares a vector of values per instruction, and this pass is
 * most of the check of a long column of offsets or dictionary indices. Unsigned
 * 64-bit values past INT64_MAX come back as -1 (out of every range checked here). */
#define RANGE_LOOP(T)                                \
  do {                                               \
    T lo_v, hi_v;                                    \
    memcpy(&lo_v, p, sizeof(T));                     \
    hi_v = lo_v;                                     \
    for (int64_t i = 1; i < n; i++) {                \
      T v;                                           \
      memcpy(&v, p + (size_t)i * sizeof(T), sizeof(T)); \
      lo_v = v < lo_v ? v : lo_v;                    \
      hi_v = v > hi_v ? v : hi_v;                    \
    }                                                \
    *lo = (int64_t)lo_v;                             \
    *hi = (int64_t)hi_v;                             \
  } while (0)
__attribute__((optimize("tree-vectorize", "vect-cost-model=dynamic"))) static void value_range(const uint8_t *p, int64_t n, int width, int is_signed, int64_t *lo, int64_t *hi) {
  switch (width * (is_signed ? 1 : -1)) {
    case 1: RANGE_LOOP(int8_t); break;
    case -1: RANGE_LOOP(uint8_t); break;
    case 2: RANGE_LOOP(int16_t); break;
    case -2: RANGE_LOOP(uint16_t); break;
    case 4: RANGE_LOOP(int32_t); break;
    case -4: RANGE_LOOP(uint32_t); break;
    case 8: RANGE_LOOP(int64_t); break;
    default: {
      uint64_t lo_u, hi_u;
      RANGE_LOOP(uint64_t);
      memcpy(&lo_u, lo, 8);
      memcpy(&hi_u, hi, 8);
      if (lo_u > INT64_MAX) *lo = -1;
      if (hi_u > INT64_MAX) *lo = -1;
      break;
    }
  }
}

/* Dictionary indices in [0, dictionary length) for every non-null slot (FULL only). Null slots are
 * skipped: producers leave sentinels there (pandas categoricals use -1), and a reader following the
 * specification does not look a null index up. */
static int check_indices(checker *c, const snode *s, const anode *a, const anode *base) {
  int width = (int)(s->layout.bit_width / 8);
  int is_signed = c->m->arena[s->format_off] >= 'a';
  int64_t dictionary_length = base[s->dictionary].length;
  const uint8_t *indices, *validity = NULL;
  int rc = fetch(c, a, 1, (uint64_t)a->offset * width, (uint64_t)a->length * width, 0, &indices);
  if (rc != AIB_OK) return rc;
  int64_t lo, hi;
  value_range(indices, a->length, width, is_signed, &lo, &hi);
  if (lo >= 0 && hi < dictionary_length) return AIB_OK; /* the common case: every slot in range */
  if (a->null_count != 0 && c->m->slots[a->first_buffer].region >= AIB_REGION_FIRST) {
    uint64_t first = (uint64_t)a->offset / 8, last = ((uint64_t)(a->offset + a->length) + 7) / 8;
    if ((rc = fetch(c, a, 0, first, last - first, 1, &validity)) != AIB_OK) return rc;
    validity -= first; /* index by absolute bit below; only bytes [first, last) are read */
  }
  for (int64_t i = 0; i < a->length; i++) {
    int64_t bit = a->offset + i;
    if (validity != NULL && !((validity[bit >> 3] >> (bit & 7)) & 1)) continue;
    int64_t v = load(indices + width * i, width, is_signed);
    if (v < 0 || v >= dictionary_length)
      return fail(c, 1, "dictionary index %lld at index %lld is outside the dictionary's %lld values", (long long)v,
                  (long long)bit, (long long)dictionary_length);
  }
  return AIB_OK;
}

static int check_node(checker *c, int32_t node, const anode *base) {
  const snode *s = &c->m->nodes[node];
  const anode *a = &base[node];
  c->node = node;
  /* the variadic sizes of a view array are read as buffer sizes whatever its length */
  if (s->layout.kind == AIB_KIND_VIEW) return check_views(c, a);
  if (a->length == 0) return AIB_OK;
  const anode *child = s->n_children > 0 ? &base[c->m->child_list[s->first_child]] : NULL;
  switch (s->layout.kind) {
    case AIB_KIND_BINARY:
      return check_offsets(c, a, 4, buffer_bytes(c, a, 2), "the data buffer");
    case AIB_KIND_LARGE_BINARY:
      return check_offsets(c, a, 8, buffer_bytes(c, a, 2), "the data buffer");
    case AIB_KIND_LIST:
    case AIB_KIND_MAP:
      return check_offsets(c, a, 4, child->length, "the child");
    case AIB_KIND_LARGE_LIST:
      return check_offsets(c, a, 8, child->length, "the child");
    case AIB_KIND_LIST_VIEW:
    case AIB_KIND_LARGE_LIST_VIEW:
      if (c->level != AIB_CHECK_FULL) return AIB_OK;
      return check_list_views(c, a, s->layout.kind == AIB_KIND_LIST_VIEW ? 4 : 8, child->length);
    case AIB_KIND_DENSE_UNION:
    case AIB_KIND_SPARSE_UNION:
      return c->level == AIB_CHECK_FULL ? check_union(c, s, a, base) : AIB_OK;
    case AIB_KIND_RUN_END:
      return check_run_ends(c, s, a, base);
    case AIB_KIND_FIXED:
      if (s->dictionary >= 0 && c->level == AIB_CHECK_FULL) return check_indices(c, s, a, base);
      return AIB_OK;
    default:
      return AIB_OK;
  }
}

int aib_check_content(const aib_decoded *d, const uint64_t *region_bases, size_t n_bases, int level, aib_read_fn read,
                      void *ctx, aib_error *err) {
  if (level == AIB_CHECK_NONE) return AIB_OK;
  if (level != AIB_CHECK_BOUNDS && level != AIB_CHECK_FULL)
    return aib_fail(err, AIB_E_STATE, "level", "", "unknown check level %d", level);
  checker c = {.d = d, .m = &d->m, .bases = region_bases, .n_bases = n_bases, .level = level, .read = read,
               .ctx = ctx, .err = err};
  int rc = AIB_OK;
  for (int64_t batch = 0; rc == AIB_OK && batch < d->m.n_batches; batch++) {
    const anode *base = &d->m.anodes[(size_t)batch * d->m.n_nodes];
    c.batch = batch;
    for (int32_t node = 0; rc == AIB_OK && node < (int32_t)d->m.n_nodes; node++) rc = check_node(&c, node, base);
  }
  for (int k = 0; k < SCRATCH_SLOTS; k++) free(c.scratch[k]);
  return rc;
}
