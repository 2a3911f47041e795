/* Arrow format strings -> layout rules: which buffers an array of that type has, how large each must
 * be for a given length and offset, and which children it needs. The single source of truth for
 * both the producer's describe walk and the consumer's validation (docs/wire-format.md lists the
 * table). Format strings here are not NUL-terminated: they may come straight from a message. */
#include <string.h>

#include "internal.h"

static int starts_with(const char *f, size_t n, const char *prefix) {
  size_t k = strlen(prefix);
  return n >= k && memcmp(f, prefix, k) == 0;
}

/* Parses a decimal integer in [lo, hi] from f[*pos..n) up to a separator or the end. */
static int parse_int(const char *f, size_t n, size_t *pos, int64_t lo, int64_t hi, int64_t *out) {
  size_t i = *pos;
  int negative = 0;
  if (i < n && f[i] == '-') {
    negative = 1;
    i++;
  }
  if (i >= n || f[i] < '0' || f[i] > '9') return 0;
  int64_t value = 0;
  while (i < n && f[i] >= '0' && f[i] <= '9') {
    value = value * 10 + (f[i] - '0');
    if (value > ((int64_t)1 << 40)) return 0;
    i++;
  }
  if (negative) value = -value;
  if (value < lo || value > hi) return 0;
  *pos = i;
  *out = value;
  return 1;
}

/* s, m, u or n: a time unit (strchr would also match the terminating NUL). */
static int is_unit(char c) { return c == 's' || c == 'm' || c == 'u' || c == 'n'; }

static void set_fixed(aib_layout *out, int64_t bits, int is_integer) {
  out->kind = AIB_KIND_FIXED;
  out->n_buffers = 2;
  out->n_children = 0;
  out->bit_width = bits;
  out->is_integer = is_integer;
}

static int bad(aib_error *err, const char *f, size_t n, const char *why) {
  return aib_fail(err, AIB_E_FORMAT, "format", "", "unsupported Arrow format string '%.*s': %s",
                  (int)(n > 64 ? 64 : n), f, why);
}

static int parse_union(const char *f, size_t n, aib_layout *out, aib_error *err) {
  /* "+ud:" or "+us:" followed by a comma-separated list of type ids in [0, 127], possibly empty */
  size_t pos = 4;
  out->n_type_ids = 0;
  while (pos < n) {
    int64_t id;
    if (out->n_type_ids >= AIB_MAX_UNION_TYPES) return bad(err, f, n, "more than 128 union type ids");
    if (!parse_int(f, n, &pos, 0, 127, &id)) return bad(err, f, n, "union type ids must be integers in [0, 127]");
    for (int i = 0; i < out->n_type_ids; i++)
      if (out->type_ids[i] == id) return bad(err, f, n, "union type ids must be distinct");
    out->type_ids[out->n_type_ids++] = (int8_t)id;
    if (pos < n) {
      if (f[pos] != ',' || pos + 1 == n) return bad(err, f, n, "malformed union type id list");
      pos++;
    }
  }
  out->n_children = out->n_type_ids;
  return AIB_OK;
}

int aib_layout_parse(const char *f, size_t n, aib_layout *out, aib_error *err) {
  memset(out, 0, sizeof(*out));
  if (n == 0) return bad(err, f, n, "empty");
  if (n > AIB_MAX_FORMAT_BYTES) return bad(err, f, n, "longer than the format limit");
  if (n == 1) {
    switch (f[0]) {
      case 'n': out->kind = AIB_KIND_NULL; return AIB_OK;
      case 'b':
        out->kind = AIB_KIND_BOOL;
        out->n_buffers = 2;
        out->bit_width = 1;
        return AIB_OK;
      case 'c': case 'C': set_fixed(out, 8, 1); return AIB_OK;
      case 's': case 'S': set_fixed(out, 16, 1); return AIB_OK;
      case 'i': case 'I': set_fixed(out, 32, 1); return AIB_OK;
      case 'l': case 'L': set_fixed(out, 64, 1); return AIB_OK;
      case 'e': set_fixed(out, 16, 0); return AIB_OK;
      case 'f': set_fixed(out, 32, 0); return AIB_OK;
      case 'g': set_fixed(out, 64, 0); return AIB_OK;
      case 'z': case 'u':
        out->kind = AIB_KIND_BINARY;
        out->n_buffers = 3;
        return AIB_OK;
      case 'Z': case 'U':
        out->kind = AIB_KIND_LARGE_BINARY;
        out->n_buffers = 3;
        return AIB_OK;
      default: return bad(err, f, n, "unknown type code");
    }
  }
  if (n == 2 && (memcmp(f, "vz", 2) == 0 || memcmp(f, "vu", 2) == 0)) {
    out->kind = AIB_KIND_VIEW;
    out->n_buffers = 3; /* validity, views, variadic sizes; variadic data buffers go in between */
    return AIB_OK;
  }
  if (starts_with(f, n, "d:")) {
    size_t pos = 2;
    int64_t precision, scale, width = 128;
    if (!parse_int(f, n, &pos, 1, 76, &precision)) return bad(err, f, n, "decimal precision must be in [1, 76]");
    if (pos >= n || f[pos] != ',') return bad(err, f, n, "decimal needs 'd:precision,scale[,bitwidth]'");
    pos++;
    if (!parse_int(f, n, &pos, -1000, 1000, &scale)) return bad(err, f, n, "malformed decimal scale");
    if (pos < n) {
      if (f[pos] != ',') return bad(err, f, n, "malformed decimal");
      pos++;
      if (!parse_int(f, n, &pos, 1, 256, &width) || pos != n) return bad(err, f, n, "malformed decimal bit width");
    }
    if (width != 32 && width != 64 && width != 128 && width != 256)
      return bad(err, f, n, "decimal bit width must be 32, 64, 128 or 256");
    set_fixed(out, width, 0);
    return AIB_OK;
  }
  if (starts_with(f, n, "w:")) {
    size_t pos = 2;
    int64_t size;
    if (!parse_int(f, n, &pos, 0, INT32_MAX, &size) || pos != n)
      return bad(err, f, n, "fixed-size binary needs a byte width in [0, 2^31)");
    set_fixed(out, size * 8, 0);
    return AIB_OK;
  }
  if (f[0] == 't') {
    if (n == 3 && f[1] == 'd') {
      if (f[2] == 'D') { set_fixed(out, 32, 0); return AIB_OK; }
      if (f[2] == 'm') { set_fixed(out, 64, 0); return AIB_OK; }
    }
    if (n == 3 && f[1] == 't') {
      if (f[2] == 's' || f[2] == 'm') { set_fixed(out, 32, 0); return AIB_OK; }
      if (f[2] == 'u' || f[2] == 'n') { set_fixed(out, 64, 0); return AIB_OK; }
    }
    if (n >= 4 && f[1] == 's' && is_unit(f[2]) && f[3] == ':') {
      set_fixed(out, 64, 0); /* the time zone after ':' is free text, possibly empty */
      return AIB_OK;
    }
    if (n == 3 && f[1] == 'D' && is_unit(f[2])) { set_fixed(out, 64, 0); return AIB_OK; }
    if (n == 3 && f[1] == 'i') {
      if (f[2] == 'M') { set_fixed(out, 32, 0); return AIB_OK; }
      if (f[2] == 'D') { set_fixed(out, 64, 0); return AIB_OK; }
      if (f[2] == 'n') { set_fixed(out, 128, 0); return AIB_OK; }
    }
    return bad(err, f, n, "unknown temporal type");
  }
  if (f[0] == '+') {
    if (n == 2) {
      switch (f[1]) {
        case 'l': out->kind = AIB_KIND_LIST; out->n_buffers = 2; out->n_children = 1; return AIB_OK;
        case 'L': out->kind = AIB_KIND_LARGE_LIST; out->n_buffers = 2; out->n_children = 1; return AIB_OK;
        case 's': out->kind = AIB_KIND_STRUCT; out->n_buffers = 1; out->n_children = -1; return AIB_OK;
        case 'm': out->kind = AIB_KIND_MAP; out->n_buffers = 2; out->n_children = 1; return AIB_OK;
        case 'r': out->kind = AIB_KIND_RUN_END; out->n_buffers = 0; out->n_children = 2; return AIB_OK;
        default: return bad(err, f, n, "unknown nested type");
      }
    }
    if (n == 3 && memcmp(f, "+vl", 3) == 0) {
      out->kind = AIB_KIND_LIST_VIEW; out->n_buffers = 3; out->n_children = 1; return AIB_OK;
    }
    if (n == 3 && memcmp(f, "+vL", 3) == 0) {
      out->kind = AIB_KIND_LARGE_LIST_VIEW; out->n_buffers = 3; out->n_children = 1; return AIB_OK;
    }
    if (starts_with(f, n, "+w:")) {
      size_t pos = 3;
      int64_t size;
      if (!parse_int(f, n, &pos, 0, INT32_MAX, &size) || pos != n)
        return bad(err, f, n, "fixed-size list needs a list size in [0, 2^31)");
      out->kind = AIB_KIND_FIXED_LIST;
      out->n_buffers = 1;
      out->n_children = 1;
      out->fixed_size = size;
      return AIB_OK;
    }
    if (starts_with(f, n, "+ud:")) {
      out->kind = AIB_KIND_DENSE_UNION;
      out->n_buffers = 2;
      return parse_union(f, n, out, err);
    }
    if (starts_with(f, n, "+us:")) {
      out->kind = AIB_KIND_SPARSE_UNION;
      out->n_buffers = 1;
      return parse_union(f, n, out, err);
    }
    return bad(err, f, n, "unknown nested type");
  }
  return bad(err, f, n, "unknown type code");
}

/* ceil(bits / 8) for a count of `elements` of `bit_width` bits; 0 on overflow past 2^62 (caller
 * checks through the returned flag). */
static int bytes_for(int64_t elements, int64_t bit_width, int64_t *out) {
  int64_t bits;
  if (__builtin_mul_overflow(elements, bit_width, &bits) || bits > ((int64_t)1 << 62)) return 0;
  *out = (bits + 7) / 8;
  return 1;
}

int aib_layout_min_sizes(const aib_layout *layout, int64_t length, int64_t offset, int64_t n_buffers,
                         int64_t *sizes, aib_error *err) {
  if (length < 0 || offset < 0 || length > ((int64_t)1 << 56) || offset > ((int64_t)1 << 56))
    return aib_fail(err, AIB_E_WIRE, "length", "", "length %lld / offset %lld out of range", (long long)length,
                    (long long)offset);
  int64_t end = length + offset; /* elements addressed from the buffer starts */
  int64_t validity = (end + 7) / 8;
  int expected = layout->n_buffers;
  if (layout->kind == AIB_KIND_VIEW ? n_buffers < 3 : n_buffers != expected)
    return aib_fail(err, AIB_E_FORMAT, "n_buffers", "", "%lld buffers where the layout has %d%s",
                    (long long)n_buffers, expected, layout->kind == AIB_KIND_VIEW ? " or more" : "");
  for (int64_t i = 0; i < n_buffers; i++) sizes[i] = 0;
  int ok = 1;
  switch (layout->kind) {
    case AIB_KIND_NULL:
    case AIB_KIND_RUN_END:
      break;
    case AIB_KIND_BOOL:
    case AIB_KIND_FIXED:
      sizes[0] = validity;
      ok = bytes_for(end, layout->bit_width, &sizes[1]);
      break;
    case AIB_KIND_BINARY:
    case AIB_KIND_LIST:
    case AIB_KIND_MAP:
      sizes[0] = validity;
      /* offset + length + 1 offsets: a reader reads offsets[offset] even of an empty slice. Only an
       * empty array at offset 0 may have none (the C Data Interface lets its offsets be NULL). */
      sizes[1] = length || offset ? (end + 1) * 4 : 0;
      break;
    case AIB_KIND_LARGE_BINARY:
    case AIB_KIND_LARGE_LIST:
      sizes[0] = validity;
      sizes[1] = length || offset ? (end + 1) * 8 : 0;
      break;
    case AIB_KIND_VIEW:
      sizes[0] = validity;
      sizes[1] = end * 16;
      sizes[n_buffers - 1] = (n_buffers - 3) * 8;
      break;
    case AIB_KIND_LIST_VIEW:
      sizes[0] = validity;
      sizes[1] = sizes[2] = end * 4;
      break;
    case AIB_KIND_LARGE_LIST_VIEW:
      sizes[0] = validity;
      sizes[1] = sizes[2] = end * 8;
      break;
    case AIB_KIND_FIXED_LIST:
    case AIB_KIND_STRUCT:
      sizes[0] = validity;
      break;
    case AIB_KIND_DENSE_UNION:
      sizes[0] = end;
      sizes[1] = end * 4;
      break;
    case AIB_KIND_SPARSE_UNION:
      sizes[0] = end;
      break;
    default:
      return aib_fail(err, AIB_E_FORMAT, "format", "", "unknown layout kind %d", layout->kind);
  }
  if (!ok) return aib_fail(err, AIB_E_WIRE, "length", "", "buffer size overflows for length %lld", (long long)length);
  return AIB_OK;
}

/* Whether buffer i of this layout is a validity bitmap (which may be NULL when there are no nulls). */
int aib_layout_is_validity(const aib_layout *layout, int64_t i) {
  if (i != 0) return 0;
  switch (layout->kind) {
    case AIB_KIND_NULL:
    case AIB_KIND_RUN_END:
    case AIB_KIND_DENSE_UNION:
    case AIB_KIND_SPARSE_UNION:
      return 0;
    default:
      return 1;
  }
}
