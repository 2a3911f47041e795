/* The top-level columns of an imported batch as plain arrays see them: for each column its name, its
 * numeric type (when it has one a plain array can show), length, null count and the address of its
 * first value. One call per batch, read straight from the validated decode and the regions' bases,
 * so a consumer wanting 16 columns as CuPy / PyTorch / NumPy arrays pays no per-column walk of
 * rebuilt structs (py_capsules.c builds the Python side: arrow_ipc_bridge/arrays/columns.py). */
#include <string.h>

#include "wire_model.h"

/* The numeric formats, in the order of AIB_NUMERIC_* (arrow_ipc_bridge/arrays/columns.py keeps the same
 * order for its dtypes): DLPack type code (kDLInt 0, kDLUInt 1, kDLFloat 2) and bits. */
static const struct {
  char format;
  uint8_t code, bits;
} numeric_types[] = {
    {'c', 0, 8},  {'s', 0, 16}, {'i', 0, 32}, {'l', 0, 64}, {'C', 1, 8},  {'S', 1, 16},
    {'I', 1, 32}, {'L', 1, 64}, {'e', 2, 16}, {'f', 2, 32}, {'g', 2, 64},
};
#define N_NUMERIC ((int)(sizeof(numeric_types) / sizeof(numeric_types[0])))

int aib_numeric_dlpack_type(int numeric, uint8_t *code, uint8_t *bits) {
  if (numeric < 0 || numeric >= N_NUMERIC) return 0;
  *code = numeric_types[numeric].code;
  *bits = numeric_types[numeric].bits;
  return 1;
}

static int numeric_of(const model *m, const snode *s) {
  if (s->format_len != 1 || s->dictionary >= 0) return -1; /* dictionary-encoded: categories, not numbers */
  char f = m->arena[s->format_off];
  for (int i = 0; i < N_NUMERIC; i++)
    if (numeric_types[i].format == f) return i;
  return -1;
}

/* One column: node idx of the batch, `skip` rows in (a struct root's offset applies to its children)
 * and `rows` long. */
static int column_fact(const aib_decoded *d, const anode *batch_nodes, int64_t batch, int32_t idx, int64_t skip,
                       int64_t rows, int row_nulls, const uint64_t *bases, size_t n_bases, aib_column_fact *out,
                       aib_error *err) {
  const model *m = &d->m;
  const snode *s = &m->nodes[idx];
  const anode *a = &batch_nodes[idx];
  memset(out, 0, sizeof(*out));
  out->name = m->arena + s->name_off;
  out->name_len = s->name_len;
  out->numeric = numeric_of(m, s);
  out->length = rows;
  /* -1: unknown, or the rows themselves have nulls (a struct root with nulls): no plain array */
  out->null_count = row_nulls ? -1 : a->null_count;
  if (out->numeric < 0 || rows == 0) return AIB_OK;
  const aib_buffer_slot *b = &m->slots[a->first_buffer + 1]; /* fixed-width layouts: validity, data */
  if (b->region == AIB_REGION_NULL || b->region == AIB_REGION_EMPTY) return AIB_OK; /* decode allows it only when empty */
  uint64_t r = b->region - AIB_REGION_FIRST;
  /* base 0 means "not mapped", except for the same-process region whose base is address 0 */
  if (r >= n_bases || (bases[r] == 0 && d->regions[r].kind != AIB_REGION_KIND_PROCESS))
    return aib_model_fail_at(err, AIB_E_STATE, m, idx, batch, "region", "region %llu is not mapped", (unsigned long long)r);
  /* In bounds: decode checked that the buffer holds offset + length values and that a struct's
   * children are at least as long as the rows it addresses (offset + length). */
  out->data = bases[r] + b->offset + (uint64_t)(a->offset + skip) * (numeric_types[out->numeric].bits / 8);
  return AIB_OK;
}

int aib_decoded_is_record_batch(const aib_decoded *d) { return d->m.nodes[0].layout.kind == AIB_KIND_STRUCT; }

size_t aib_decoded_column_count(const aib_decoded *d) {
  const snode *root = &d->m.nodes[0];
  return root->layout.kind == AIB_KIND_STRUCT ? (size_t)root->n_children : 1;
}

int aib_decoded_columns(const aib_decoded *d, int64_t batch, const uint64_t *bases, size_t n_bases,
                        aib_column_fact *out, size_t capacity, size_t *n_out, aib_error *err) {
  const model *m = &d->m;
  *n_out = 0;
  if (batch < 0 || batch >= m->n_batches)
    return aib_fail(err, AIB_E_STATE, "batch", "", "batch %lld out of range (the data has %lld)", (long long)batch,
                    (long long)m->n_batches);
  const anode *batch_nodes = &m->anodes[(size_t)batch * m->n_nodes];
  const snode *root = &m->nodes[0];
  const anode *root_array = &batch_nodes[0];
  if (root->layout.kind != AIB_KIND_STRUCT) {
    if (capacity < 1) return aib_fail(err, AIB_E_LIMIT, "", "", "no room for one column");
    *n_out = 1;
    return column_fact(d, batch_nodes, batch, 0, 0, root_array->length, 0, bases, n_bases, out, err);
  }
  if ((size_t)root->n_children > capacity)
    return aib_fail(err, AIB_E_LIMIT, "", "", "%d columns, room for %zu", root->n_children, capacity);
  for (int32_t i = 0; i < root->n_children; i++) {
    int rc = column_fact(d, batch_nodes, batch, m->child_list[root->first_child + i], root_array->offset,
                         root_array->length, root_array->null_count != 0, bases, n_bases, &out[i], err);
    if (rc != AIB_OK) return rc;
  }
  *n_out = (size_t)root->n_children;
  return AIB_OK;
}
