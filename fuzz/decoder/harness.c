/* libFuzzer harness for the message decoder and the content checks (run.sh builds and runs it).
 *
 * Input: a 2-byte little-endian message length, the message, then the bytes of its regions, one
 * after the other (region i gets the next `size` bytes, zero-padded). Each region is its own
 * malloc of exactly its declared size, so AddressSanitizer reports any byte read outside one.
 *
 * For every message that aib_decode accepts and aib_check_content(FULL) passes, the oracle below
 * reads the rebuilt arrays the way a consumer following the Arrow specification would, from the
 * C Data structs alone (format strings, lengths, offsets, buffer pointers), following every
 * offset, view, dictionary index, union type id and offset and run end; every byte it touches must
 * lie inside a region, or the harness aborts (a crash libFuzzer saves). The oracle is written from
 * the specification, not from content_check.c, so a gap in one is not hidden by the same gap in
 * the other. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bridge.h"

#define MAX_REGION_BYTES (1u << 20)
/* The level under test; building with -DCHECK_LEVEL=AIB_CHECK_NONE shows the oracle catching what
 * the checks exist for (run.sh --self-test). */
#ifndef CHECK_LEVEL
#define CHECK_LEVEL AIB_CHECK_FULL
#endif

/* How far inputs got, printed at exit when FUZZ_STATS is set (is the oracle reached?). */
static uint64_t n_inputs, n_decoded, n_backed, n_accepted, n_walked_nodes;
static void print_stats(void) {
  fprintf(stderr, "harness: %llu inputs, %llu decoded, %llu backed by memory, %llu accepted by the check, "
          "%llu arrays walked by the oracle\n", (unsigned long long)n_inputs, (unsigned long long)n_decoded,
          (unsigned long long)n_backed, (unsigned long long)n_accepted, (unsigned long long)n_walked_nodes);
}

typedef struct span {
  const uint8_t *start;
  uint64_t size;
} span;

static span regions[AIB_MAX_REGIONS];
static size_t n_regions;
static volatile uint64_t sink;
/* Where the core points zero-length buffers (64 zero bytes of its own, not in any region): found
 * once by rebuilding a message whose int64 column of length 0 has an empty data buffer. */
static span zeros;

static void find_zeros(void) {
  static const uint8_t probe[] = {'A', 'I', 'B', 'M', 1, 0, 1, 0, 19, 0, 0, 0, 0, 0, 0, 0,
                                  1, 0, 0, 0,               /* CPU, no identity, no sync, no regions */
                                  1, 'l', 0, 0, 2, 0, 0,    /* schema: "l", no name, nullable */
                                  1, 0, 1, 0, 2, 0, 1,      /* one batch: length 0, NULL, EMPTY */
                                  0};                       /* no extensions */
  aib_decoded *d = NULL;
  aib_error err;
  struct ArrowArray array = {0};
  aib_owner *owner = aib_owner_new(0);
  if (aib_decode(probe, sizeof(probe), 0, 0, &d, &err) != AIB_OK ||
      aib_rebuild_array(d, 0, NULL, 0, owner, &array, &err) != AIB_OK) {
    fprintf(stderr, "harness: the probe message failed: %s\n", err.message);
    abort();
  }
  zeros.start = array.buffers[1];
  zeros.size = 64;
  array.release(&array);
  aib_owner_unref(owner);
  aib_decoded_free(d);
}

static void violation(const char *what, const char *format, long long a, long long b) {
  fprintf(stderr, "ORACLE: %s (format '%s', %lld, %lld)\n", what, format, a, b);
  abort();
}

/* Every read goes through here: [p, p + n) must lie inside one region. */
static void touch(const void *p, int64_t n, const char *format) {
  if (n <= 0) return;
  const uint8_t *q = p;
  if (q >= zeros.start && (uint64_t)n <= zeros.size - (uint64_t)(q - zeros.start)) return;
  for (size_t i = 0; i < n_regions; i++) {
    const uint8_t *s = regions[i].start;
    if (q >= s && (uint64_t)(q - s) <= regions[i].size && (uint64_t)n <= regions[i].size - (uint64_t)(q - s)) {
      sink += q[0] + q[n - 1];
      return;
    }
  }
  violation("read outside every region", format, (long long)(uintptr_t)p, n);
}

static int64_t get(const void *base, int64_t index, int width, int is_signed, const char *format) {
  const uint8_t *p = (const uint8_t *)base + index * width;
  touch(p, width, format);
  switch (width) {
    case 1: return is_signed ? (int64_t) * (const int8_t *)p : (int64_t) * (const uint8_t *)p;
    case 2: { int16_t v; memcpy(&v, p, 2); return is_signed ? v : (int64_t)(uint16_t)v; }
    case 4: { int32_t v; memcpy(&v, p, 4); return is_signed ? v : (int64_t)(uint32_t)v; }
    default: { int64_t v; memcpy(&v, p, 8); return v; }
  }
}

static int is_valid(const struct ArrowArray *a, int64_t i, const char *format) {
  if (a->n_buffers == 0 || a->buffers[0] == NULL || a->null_count == 0) return 1;
  const uint8_t *bits = a->buffers[0];
  int64_t bit = a->offset + i;
  touch(bits + (bit >> 3), 1, format);
  return (bits[bit >> 3] >> (bit & 7)) & 1;
}

static int fixed_width_bits(const char *f) {
  if (strlen(f) == 1) {
    switch (f[0]) {
      case 'b': return 1;
      case 'c': case 'C': return 8;
      case 's': case 'S': case 'e': return 16;
      case 'i': case 'I': case 'f': return 32;
      case 'l': case 'L': case 'g': return 64;
      default: return 0;
    }
  }
  if (f[0] == 'w' && f[1] == ':') return 8 * atoi(f + 2);
  if (f[0] == 'd' && f[1] == ':') {
    const char *comma = strchr(f + 2, ',');
    const char *second = comma ? strchr(comma + 1, ',') : NULL;
    return second ? atoi(second + 1) : 128;
  }
  if (f[0] == 't') {
    if (!strcmp(f, "tdD") || !strcmp(f, "tts") || !strcmp(f, "ttm") || !strcmp(f, "tiM")) return 32;
    if (!strcmp(f, "tin")) return 128;
    return 64;
  }
  return 0;
}

static void read_array(const struct ArrowSchema *s, const struct ArrowArray *a);

/* A reader reads a child over [from, to) of its logical positions. */
static void read_child_range(const struct ArrowSchema *s, const struct ArrowArray *c, int64_t from, int64_t to,
                             const char *format) {
  if (from < 0 || to < from || to > c->length) violation("child range outside the child", format, from, to);
  read_array(s, c);
}

static void read_offsets(const struct ArrowSchema *s, const struct ArrowArray *a, int width) {
  const char *f = s->format;
  if (a->length == 0) {
    /* readers (pyarrow's validation) still load offsets[offset] of an empty slice */
    if (a->buffers[1] != NULL) (void)get(a->buffers[1], a->offset, width, 1, f);
    return;
  }
  int64_t first = get(a->buffers[1], a->offset, width, 1, f), previous = first;
  for (int64_t i = 1; i <= a->length; i++) {
    int64_t v = get(a->buffers[1], a->offset + i, width, 1, f);
    if (v < previous) violation("decreasing offsets", f, previous, v);
    previous = v;
  }
  if (a->n_children == 0) {  /* binary: the data bytes */
    if (first < 0) violation("negative offset", f, first, 0);
    /* no data bytes: the data buffer may be NULL (a zero-size buffer), so no pointer arithmetic */
    if (previous > first) touch((const uint8_t *)a->buffers[2] + first, previous - first, f);
  } else {
    read_child_range(s->children[0], a->children[0], first, previous, f);
  }
}

static void read_array(const struct ArrowSchema *s, const struct ArrowArray *a) {
  const char *f = s->format;
  n_walked_nodes++;
  int64_t n = a->length, o = a->offset;
  if (n < 0 || o < 0) violation("negative length or offset", f, n, o);
  if (n > 0 && a->n_buffers > 0 && a->buffers[0] != NULL && a->null_count != 0 && strncmp(f, "+u", 2) != 0 &&
      strcmp(f, "+r") != 0 && strcmp(f, "n") != 0)
    touch((const uint8_t *)a->buffers[0] + o / 8, (o + n + 7) / 8 - o / 8, f);
  if (s->dictionary != NULL) {
    int bits = fixed_width_bits(f);
    for (int64_t i = 0; i < n; i++) {
      if (!is_valid(a, i, f)) continue;
      int64_t k = get(a->buffers[1], o + i, bits / 8, f[0] >= 'a', f);
      if (k < 0 || k >= a->dictionary->length) violation("dictionary index outside the dictionary", f, k, a->dictionary->length);
    }
    read_array(s->dictionary, a->dictionary);
    return;
  }
  int bits = fixed_width_bits(f);
  if (bits > 0) {
    if (n > 0) touch((const uint8_t *)a->buffers[1] + (o * bits) / 8, ((o + n) * bits + 7) / 8 - (o * bits) / 8, f);
    return;
  }
  if (!strcmp(f, "n")) return;
  if (!strcmp(f, "u") || !strcmp(f, "z") || !strcmp(f, "+l") || !strcmp(f, "+m")) return read_offsets(s, a, 4);
  if (!strcmp(f, "U") || !strcmp(f, "Z") || !strcmp(f, "+L")) return read_offsets(s, a, 8);
  if (!strcmp(f, "vu") || !strcmp(f, "vz")) {
    int64_t n_variadic = a->n_buffers - 3;
    const int64_t *sizes = a->buffers[a->n_buffers - 1];
    for (int64_t k = 0; k < n_variadic; k++) {
      int64_t size = get(sizes, k, 8, 1, f);
      touch(a->buffers[2 + k], size, f); /* a reader copies a variadic buffer by its declared size */
    }
    for (int64_t i = 0; i < n; i++) {
      const uint8_t *view = (const uint8_t *)a->buffers[1] + 16 * (o + i);
      int64_t length = get(view, 0, 4, 1, f);
      if (length < 0) violation("negative view length", f, length, i);
      if (length <= 12) continue;
      int64_t index = get(view + 8, 0, 4, 1, f), offset = get(view + 12, 0, 4, 1, f);
      if (index < 0 || index >= n_variadic || offset < 0) violation("view outside the data buffers", f, index, offset);
      int64_t size = get(sizes, index, 8, 1, f);
      if (offset + length > size) violation("view past its buffer's declared size", f, offset + length, size);
      touch((const uint8_t *)a->buffers[2 + index] + offset, length, f);
    }
    return;
  }
  if (!strcmp(f, "+vl") || !strcmp(f, "+vL")) {
    int width = f[2] == 'l' ? 4 : 8;
    for (int64_t i = 0; i < n; i++) {
      int64_t offset = get(a->buffers[1], o + i, width, 1, f), size = get(a->buffers[2], o + i, width, 1, f);
      if (offset < 0 || size < 0 || offset + size > a->children[0]->length)
        violation("list view outside the child", f, offset, size);
    }
    read_array(s->children[0], a->children[0]);
    return;
  }
  if (!strncmp(f, "+w:", 3)) {
    int64_t size = atoll(f + 3);
    read_child_range(s->children[0], a->children[0], o * size, (o + n) * size, f);
    return;
  }
  if (!strcmp(f, "+s")) {
    for (int64_t k = 0; k < a->n_children; k++) read_child_range(s->children[k], a->children[k], o, o + n, f);
    return;
  }
  if (!strncmp(f, "+ud:", 4) || !strncmp(f, "+us:", 4)) {
    int dense = f[2] == 'd';
    int child_of[128];
    for (int k = 0; k < 128; k++) child_of[k] = -1;
    const char *p = f + 4;
    for (int k = 0; *p; k++) {
      child_of[atoi(p) & 127] = k;
      p = strchr(p, ',');
      if (p == NULL) break;
      p++;
    }
    for (int64_t i = 0; i < n; i++) {
      int64_t id = get(a->buffers[0], o + i, 1, 1, f);
      if (id < 0 || child_of[id] < 0) violation("undeclared union type id", f, id, i);
      const struct ArrowArray *c = a->children[child_of[id]];
      int64_t at = dense ? get(a->buffers[1], o + i, 4, 1, f) : o + i;
      if (at < 0 || at >= c->length) violation("union slot outside its child", f, at, c->length);
    }
    for (int64_t k = 0; k < a->n_children; k++) read_array(s->children[k], a->children[k]);
    return;
  }
  if (!strcmp(f, "+r")) {
    const struct ArrowArray *ends = a->children[0];
    int width = fixed_width_bits(s->children[0]->format) / 8;
    int64_t previous = 0;
    for (int64_t i = 0; i < ends->length; i++) {
      int64_t v = get(ends->buffers[1], ends->offset + i, width, 1, f);
      if (v <= previous) violation("run ends not increasing", f, previous, v);
      previous = v;
    }
    if (n > 0 && previous < o + n) violation("run ends do not cover the array", f, previous, o + n);
    read_array(s->children[0], ends);
    read_array(s->children[1], a->children[1]);
    return;
  }
  violation("format the oracle does not know", f, 0, 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (n_inputs++ == 0) {
    find_zeros();
    if (getenv("FUZZ_STATS") != NULL) atexit(print_stats);
  }
  if (size < 2) return 0;
  size_t message_length = (size_t)data[0] | ((size_t)data[1] << 8);
  if (message_length > size - 2) return 0;
  const uint8_t *message = data + 2, *rest = message + message_length;
  size_t rest_length = size - 2 - message_length;
  aib_decoded *d = NULL;
  aib_error err;
  if (aib_decode(message, message_length, AIB_MAX_FDS, 0, &d, &err) != AIB_OK) return 0;
  n_decoded++;
  size_t count = aib_decoded_region_count(d);
  const aib_region *declared = aib_decoded_regions(d);
  uint64_t total = 0;
  for (size_t i = 0; i < count; i++) {
    if (declared[i].size > MAX_REGION_BYTES || (total += declared[i].size) > MAX_REGION_BYTES) {
      aib_decoded_free(d);
      return 0; /* too large to back with memory here; the decode itself was exercised */
    }
  }
  n_backed++;
  uint64_t *bases = calloc(count ? count : 1, sizeof(uint64_t));
  n_regions = count;
  for (size_t i = 0; i < count; i++) {
    uint64_t n = declared[i].size;
    uint8_t *p = malloc(n ? n : 1);
    size_t from_input = rest_length < n ? rest_length : n;
    memcpy(p, rest, from_input);
    memset(p + from_input, 0, n - from_input);
    rest += from_input;
    rest_length -= from_input;
    regions[i].start = p;
    regions[i].size = n;
    bases[i] = (uint64_t)(uintptr_t)p;
  }
  if (aib_check_content(d, bases, count, CHECK_LEVEL, NULL, NULL, &err) == AIB_OK) {
    n_accepted++;
    /* BOUNDS must accept whatever FULL accepts */
    if (CHECK_LEVEL == AIB_CHECK_FULL && aib_check_content(d, bases, count, AIB_CHECK_BOUNDS, NULL, NULL, &err) != AIB_OK) {
      fprintf(stderr, "ORACLE: bounds refused what full accepted: %s\n", err.message);
      abort();
    }
    struct ArrowSchema schema = {0};
    if (aib_rebuild_schema(d, &schema, &err) == AIB_OK) {
      aib_owner *owner = aib_owner_new(0);
      for (int64_t b = 0; owner != NULL && b < aib_decoded_batch_count(d); b++) {
        struct ArrowArray array = {0};
        if (aib_rebuild_array(d, b, bases, count, owner, &array, &err) != AIB_OK) {
          fprintf(stderr, "ORACLE: an accepted message failed to rebuild: %s\n", err.message);
          abort();
        }
        read_array(&schema, &array);
        array.release(&array);
      }
      if (owner != NULL) aib_owner_unref(owner);
      schema.release(&schema);
    }
  }
  for (size_t i = 0; i < count; i++) free((void *)regions[i].start);
  n_regions = 0;
  free(bases);
  aib_decoded_free(d);
  return 0;
}
