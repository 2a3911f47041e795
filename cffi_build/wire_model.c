/* The metadata model's own operations, shared by the four stages of the wire format (describe,
 * encode, decode, rebuild: wire_*.c): growing its arrays and arena, new nodes, node paths and
 * failures that name them, and the schema rules checked on both sides (describe catches producer
 * bugs, decode untrusted messages). wire_model.h says what the model is. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wire_model.h"

uint32_t aib_wire_version(void) { return ((uint32_t)WIRE_MAJOR << 16) | WIRE_MINOR; }

int aib_model_grow(void **p, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap) return 1;
  size_t cap2 = *cap ? *cap : 16;
  while (cap2 < need) cap2 *= 2;
  void *q = realloc(*p, cap2 * elem);
  if (q == NULL) return 0;
  *p = q;
  *cap = cap2;
  return 1;
}

void aib_model_free(model *m) {
  free(m->arena);
  free(m->nodes);
  free(m->child_list);
  free(m->anodes);
  free(m->slots);
  free(m->pending);
  memset(m, 0, sizeof(*m));
}

int aib_model_reserve(model *m, size_t arena_bytes) {
  return GROW(m, arena, arena_cap, arena_bytes) && GROW(m, nodes, nodes_cap, 32) &&
         GROW(m, child_list, child_cap, 32) && GROW(m, anodes, anodes_cap, 32) && GROW(m, slots, slots_cap, 64);
}

int aib_model_arena_put(model *m, const void *data, size_t n, uint32_t *off_out) {
  if (m->arena_len + n + 1 > UINT32_MAX) return 0;
  if (!GROW(m, arena, arena_cap, m->arena_len + n + 1)) return 0;
  memcpy(m->arena + m->arena_len, data, n);
  m->arena[m->arena_len + n] = '\0';
  *off_out = (uint32_t)m->arena_len;
  m->arena_len += n + 1;
  return 1;
}

void aib_node_path(const model *m, int32_t node, int64_t batch, char *out, size_t cap) {
  int32_t chain[AIB_MAX_DEPTH + 2];
  int n = 0;
  for (int32_t k = node; k >= 0 && (size_t)k < m->n_nodes && n < AIB_MAX_DEPTH + 2; k = m->nodes[k].parent)
    chain[n++] = k;
  size_t pos = 0;
#define APPEND(...)                                                            \
  do {                                                                         \
    if (pos < cap) {                                                           \
      int w = snprintf(out + pos, cap - pos, __VA_ARGS__);                     \
      pos = w < 0 ? cap : (pos + (size_t)w < cap ? pos + (size_t)w : cap);     \
    }                                                                          \
  } while (0)
  if (batch >= 0) APPEND("batch%lld/", (long long)batch);
  APPEND("root");
  for (int i = n - 2; i >= 0; i--) {
    int32_t position = m->nodes[chain[i]].position;
    if (position < 0)
      APPEND("/dictionary");
    else
      APPEND("/child%d", position);
  }
#undef APPEND
}

int aib_model_fail_at(aib_error *err, int code, const model *m, int32_t node, int64_t batch, const char *field,
                   const char *fmt, ...) {
  if (err == NULL) return code;
  char message[sizeof(err->message)];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(message, sizeof(message), fmt, ap);
  va_end(ap);
  char path[sizeof(err->path)];
  path[0] = '\0';
  if (node >= 0) aib_node_path(m, node, batch, path, sizeof(path));
  return aib_fail(err, code, field, path, "%s", message);
}

int aib_model_check_schema_node(const model *m, int32_t idx, aib_error *err) {
  const snode *s = &m->nodes[idx];
  const aib_layout *L = &s->layout;
  if (s->flags & ~(int64_t)(ARROW_FLAG_DICTIONARY_ORDERED | ARROW_FLAG_NULLABLE | ARROW_FLAG_MAP_KEYS_SORTED))
    return aib_model_fail_at(err, AIB_E_WIRE, m, idx, -1, "flags", "unknown flag bits 0x%llx", (unsigned long long)s->flags);
  if (L->n_children >= 0 && s->n_children != L->n_children)
    return aib_model_fail_at(err, AIB_E_FORMAT, m, idx, -1, "n_children", "format '%s' needs %d children, has %d",
                   m->arena + s->format_off, L->n_children, s->n_children);
  if (s->dictionary >= 0 && !L->is_integer)
    return aib_model_fail_at(err, AIB_E_FORMAT, m, idx, -1, "dictionary",
                   "a dictionary-encoded field needs an integer index type, not '%s'", m->arena + s->format_off);
  if (L->kind == AIB_KIND_MAP) {
    const snode *entries = &m->nodes[m->child_list[s->first_child]];
    if (entries->layout.kind != AIB_KIND_STRUCT || entries->n_children != 2)
      return aib_model_fail_at(err, AIB_E_FORMAT, m, idx, -1, "children", "a map's child must be a struct of key and value");
  }
  if (L->kind == AIB_KIND_RUN_END) {
    const snode *ends = &m->nodes[m->child_list[s->first_child]];
    const char *f = m->arena + ends->format_off;
    if (ends->format_len != 1 || (f[0] != 's' && f[0] != 'i' && f[0] != 'l') || ends->dictionary >= 0)
      return aib_model_fail_at(err, AIB_E_FORMAT, m, idx, -1, "children", "run ends must be int16, int32 or int64, not '%s'", f);
  }
  return AIB_OK;
}

int32_t aib_model_new_node(model *m, int32_t parent, int32_t position) {
  if (m->n_nodes >= AIB_MAX_SCHEMA_NODES) return -1;
  if (!GROW(m, nodes, nodes_cap, m->n_nodes + 1)) return -1;
  int32_t idx = (int32_t)m->n_nodes++;
  memset(&m->nodes[idx], 0, sizeof(snode));
  m->nodes[idx].parent = parent;
  m->nodes[idx].position = position;
  m->nodes[idx].dictionary = -1;
  return idx;
}

int aib_model_reserve_children(model *m, int32_t idx, int64_t n_children) {
  if (!GROW(m, child_list, child_cap, m->n_child_list + (size_t)n_children)) return 0;
  m->nodes[idx].n_children = (int32_t)n_children;
  m->nodes[idx].first_child = (int32_t)m->n_child_list;
  m->n_child_list += (size_t)n_children;
  return 1;
}
