/* The producer's fast path for fresh device data: what publishing CUDA columns repeats per column and
 * per buffer, done in C.
 *
 *  - aib_columns_build: the Arrow schema and array of 1-D numeric columns given as raw pointers (what
 *    from_cuda_arrays reads from each array's __cuda_array_interface__), one allocation per tree,
 *    instead of a pyarrow buffer, array and record batch per column and an export;
 *  - aib_cuda_devices_of: which device each column lives on, one attribute query per column;
 *  - the export region table: the region (kind, handle, size, identity, flags) the placer made for an
 *    allocation, keyed by the allocation's buffer id. Buffer ids are never reused in a process, so an
 *    entry can never name another allocation; an entry for a freed allocation is dead weight until the
 *    table is cleared;
 *  - aib_cuda_place: the one placement of a message's CUDA buffers. One walk, one attribute query per
 *    allocation, each allocation's region from the regions the caller made for this message or from
 *    the table; the allocations with neither are handed back, the caller (cuda/placer.py) makes their
 *    regions — exports, or copies under the copy policy — and calls again, which then places all.
 *
 * The table holds only what the placer approved: shareable device memory, placed without a copy and
 * without a per-message fd. Anything else — a new allocation, managed or pinned memory, another
 * device, a VMM allocation, a pool region when the message must carry the pool's fd — is missing
 * until the caller made its region for the message, with the checks that raise for what it cannot
 * share. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* The CUDA driver's values this file needs (cuda.h; the core is built without it). */
#define CU_POINTER_ATTRIBUTE_MEMORY_TYPE 2
#define CU_POINTER_ATTRIBUTE_BUFFER_ID 7
#define CU_POINTER_ATTRIBUTE_IS_MANAGED 8
#define CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define CU_POINTER_ATTRIBUTE_RANGE_START_ADDR 11
#define CU_POINTER_ATTRIBUTE_RANGE_SIZE 12
#define CU_MEMORYTYPE_HOST 1
#define CU_MEMORYTYPE_DEVICE 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define UNPLACED UINT64_MAX /* a slot's region before placement (metadata.SLOT_UNPLACED) */

typedef int (*get_attributes_fn)(unsigned n, const int *attributes, void **data, uint64_t ptr);

/* ---------- columns as Arrow structs ------------------------------------------------------------ */
static const char *const column_formats[] = {"c", "s", "i", "l", "C", "S", "I", "L", "e", "f", "g"};
#define N_COLUMN_FORMATS (sizeof(column_formats) / sizeof(column_formats[0]))

static void release_child_schema(struct ArrowSchema *s) { s->release = NULL; }

/* The root owns the block holding every node and string: one free(). */
static void release_root_schema(struct ArrowSchema *s) {
  if (s == NULL || s->release == NULL) return;
  for (int64_t i = 0; i < s->n_children; i++) s->children[i]->release = NULL;
  free(s->private_data);
  atomic_fetch_sub(&aib_node_counter, 1 + s->n_children);
  s->release = NULL;
}

static void release_child_array(struct ArrowArray *a) { a->release = NULL; }

static void release_root_array(struct ArrowArray *a) {
  if (a == NULL || a->release == NULL) return;
  for (int64_t i = 0; i < a->n_children; i++) a->children[i]->release = NULL;
  free(a->private_data);
  atomic_fetch_sub(&aib_node_counter, 1 + a->n_children);
  a->release = NULL;
}

int aib_columns_build(size_t n, const char *const *names, const aib_cuda_column *columns, int as_batch,
                      struct ArrowSchema *schema_out, struct ArrowArray *array_out, aib_error *err) {
  if (schema_out->release != NULL || array_out->release != NULL)
    return aib_fail(err, AIB_E_STATE, "", "", "the destination structs are not released");
  if (n == 0 || (!as_batch && n != 1) || n > (1u << 20))
    return aib_fail(err, AIB_E_FORMAT, "n", "", "%zu columns (as_batch %d) cannot make an Arrow %s", n, as_batch,
                    as_batch ? "record batch" : "array");
  int64_t length = columns[0].length;
  for (size_t i = 0; i < n; i++) {
    if (columns[i].code >= N_COLUMN_FORMATS)
      return aib_fail(err, AIB_E_FORMAT, "code", "", "column %zu: unknown format code %u", i, columns[i].code);
    if (columns[i].length != length || length < 0)
      return aib_fail(err, AIB_E_FORMAT, "length", "", "column %zu: length %lld, column 0: %lld", i,
                      (long long)columns[i].length, (long long)length);
  }
  size_t n_children = as_batch ? n : 0;
  /* Schema block: child pointers, child structs, names (NUL-terminated). */
  size_t names_size = 0;
  for (size_t i = 0; as_batch && i < n; i++) names_size += strlen(names[i]) + 1;
  size_t schema_size = n_children * (sizeof(struct ArrowSchema *) + sizeof(struct ArrowSchema)) + names_size + 1;
  /* Array block: child pointers, child structs, the root's buffer list, two buffers per column. */
  size_t array_size = n_children * (sizeof(struct ArrowArray *) + sizeof(struct ArrowArray)) + sizeof(void *) +
                      n * 2 * sizeof(void *);
  char *schema_block = calloc(1, schema_size);
  char *array_block = calloc(1, array_size);
  if (schema_block == NULL || array_block == NULL) {
    free(schema_block);
    free(array_block);
    return aib_fail(err, AIB_E_NOMEM, "", "", "allocating the structs of %zu columns", n);
  }
  /* Schema. */
  memset(schema_out, 0, sizeof(*schema_out));
  if (as_batch) {
    struct ArrowSchema **children = (struct ArrowSchema **)schema_block;
    struct ArrowSchema *child_structs = (struct ArrowSchema *)(children + n);
    char *cursor = (char *)(child_structs + n);
    for (size_t i = 0; i < n; i++) {
      struct ArrowSchema *c = &child_structs[i];
      size_t len = strlen(names[i]);
      memcpy(cursor, names[i], len + 1);
      c->format = column_formats[columns[i].code];
      c->name = cursor;
      c->flags = ARROW_FLAG_NULLABLE;
      c->release = release_child_schema;
      children[i] = c;
      cursor += len + 1;
    }
    schema_out->format = "+s";
    schema_out->name = cursor; /* "" (the block is zeroed) */
    schema_out->n_children = (int64_t)n;
    schema_out->children = children;
  } else {
    schema_out->format = column_formats[columns[0].code];
    schema_out->name = schema_block; /* "" */
    schema_out->flags = ARROW_FLAG_NULLABLE;
  }
  schema_out->private_data = schema_block;
  schema_out->release = release_root_schema;
  /* Array. */
  memset(array_out, 0, sizeof(*array_out));
  const void **buffers;
  if (as_batch) {
    struct ArrowArray **children = (struct ArrowArray **)array_block;
    struct ArrowArray *child_structs = (struct ArrowArray *)(children + n);
    const void **root_buffers = (const void **)(child_structs + n);
    buffers = root_buffers + 1;
    for (size_t i = 0; i < n; i++) {
      struct ArrowArray *c = &child_structs[i];
      buffers[2 * i + 1] = (const void *)(uintptr_t)columns[i].data;
      c->length = length;
      c->n_buffers = 2;
      c->buffers = &buffers[2 * i];
      c->release = release_child_array;
      children[i] = c;
    }
    array_out->n_buffers = 1;
    array_out->buffers = root_buffers;
    array_out->n_children = (int64_t)n;
    array_out->children = children;
  } else {
    buffers = (const void **)array_block;
    buffers[1] = (const void *)(uintptr_t)columns[0].data;
    array_out->n_buffers = 2;
    array_out->buffers = buffers;
  }
  array_out->length = length;
  array_out->private_data = array_block;
  array_out->release = release_root_array;
  atomic_fetch_add(&aib_node_counter, 2 * (1 + (long long)n_children));
  return AIB_OK;
}

/* ---------- which device each column lives on --------------------------------------------------- */
int aib_cuda_devices_of(const aib_cuda_column *columns, size_t n, int32_t *device_out, int32_t *other_out,
                        size_t *failed) {
  get_attributes_fn fn = (get_attributes_fn)aib_cuda_pointer_get_attributes();
  static const int attributes[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
  *failed = n;
  if (fn == NULL) return CUDA_ERROR_NOT_INITIALIZED;
  for (size_t i = 0; i < n; i++) {
    uint64_t slots[2] = {0, 0};
    void *data[2] = {&slots[0], &slots[1]};
    int rc = fn(2, attributes, data, columns[i].data);
    /* Unknown to the driver (every attribute left at its default: no error), pinned host memory, or
     * a refused query: the caller says which. Managed memory passes: the placer copies it or
     * refuses it by the copy policy. */
    if (rc != 0 || (uint32_t)slots[0] == 0 || (uint32_t)slots[0] == CU_MEMORYTYPE_HOST) {
      *failed = i;
      return rc ? rc : -1;
    }
    int32_t device = (int32_t)(uint32_t)slots[1];
    if (i == 0) *device_out = device;
    if (device != *device_out) {
      *failed = i;
      *other_out = device;
      return -2;
    }
  }
  return 0;
}

/* ---------- the export region table -------------------------------------------------------------- */
typedef struct export_entry {
  uint64_t buffer_id; /* 0: empty */
  int32_t device;
  aib_region region;
} export_entry;

struct aib_export_regions {
  pthread_mutex_t lock;
  size_t capacity; /* a power of two */
  size_t count;
  uint64_t hits, misses;
  export_entry *entries;
};

aib_export_regions *aib_export_regions_new(size_t capacity) {
  size_t cap = 64;
  while (cap < capacity * 2 && cap < ((size_t)1 << 20)) cap *= 2; /* at most half full */
  aib_export_regions *t = calloc(1, sizeof(*t));
  if (t == NULL) return NULL;
  t->entries = calloc(cap, sizeof(export_entry));
  if (t->entries == NULL) {
    free(t);
    return NULL;
  }
  t->capacity = cap;
  pthread_mutex_init(&t->lock, NULL);
  return t;
}

void aib_export_regions_free(aib_export_regions *t) {
  if (t == NULL) return;
  pthread_mutex_destroy(&t->lock);
  free(t->entries);
  free(t);
}

static size_t slot_of(uint64_t buffer_id, size_t capacity) {
  return (size_t)((buffer_id * 0x9E3779B97F4A7C15ull) >> 17) & (capacity - 1);
}

/* Under the lock. */
static export_entry *find_entry(aib_export_regions *t, uint64_t buffer_id) {
  for (size_t k = slot_of(buffer_id, t->capacity);; k = (k + 1) & (t->capacity - 1)) {
    export_entry *e = &t->entries[k];
    if (e->buffer_id == buffer_id || e->buffer_id == 0) return e;
  }
}

void aib_export_regions_clear(aib_export_regions *t) {
  pthread_mutex_lock(&t->lock);
  memset(t->entries, 0, t->capacity * sizeof(export_entry));
  t->count = 0;
  pthread_mutex_unlock(&t->lock);
}

int aib_export_regions_put(aib_export_regions *t, uint64_t buffer_id, int32_t device, const aib_region *region) {
  if (buffer_id == 0 || region->handle_len > sizeof(region->handle)) return AIB_E_FORMAT;
  pthread_mutex_lock(&t->lock);
  if (t->count * 2 >= t->capacity) { /* full: forget everything; the placer makes entries again */
    memset(t->entries, 0, t->capacity * sizeof(export_entry));
    t->count = 0;
  }
  export_entry *e = find_entry(t, buffer_id);
  if (e->buffer_id == 0) t->count++;
  e->buffer_id = buffer_id;
  e->device = device;
  e->region = *region;
  pthread_mutex_unlock(&t->lock);
  return AIB_OK;
}

void aib_export_regions_stats(aib_export_regions *t, uint64_t *entries, uint64_t *hits, uint64_t *misses) {
  pthread_mutex_lock(&t->lock);
  *entries = t->count;
  *hits = t->hits;
  *misses = t->misses;
  pthread_mutex_unlock(&t->lock);
}

/* The region of allocation buffer_id: one the caller made for this message, else the table's (NULL:
 * none; the table's pool regions only when pool_regions_allowed). Counts the table's answers. */
static int region_of(aib_export_regions *t, uint64_t buffer_id, int32_t device, int pool_regions_allowed,
                     const uint64_t *made_ids, const aib_region *made, size_t n_made, aib_region *out) {
  for (size_t k = 0; k < n_made; k++)
    if (made_ids[k] == buffer_id) {
      *out = made[k];
      return 1;
    }
  if (t == NULL) return 0;
  pthread_mutex_lock(&t->lock);
  export_entry *e = find_entry(t, buffer_id);
  int usable = e->buffer_id == buffer_id && e->device == device &&
               (e->region.kind != AIB_REGION_KIND_CUDA_POOL || pool_regions_allowed);
  if (usable) *out = e->region;
  if (usable) t->hits++; else t->misses++;
  pthread_mutex_unlock(&t->lock);
  return usable;
}

static int inside(uint64_t address, uint64_t length, uint64_t base, uint64_t size) {
  return address >= base && address - base <= size && length <= size - (address - base); /* no overflow */
}

int aib_cuda_place(aib_export_regions *t, aib_described *d, int32_t device, int pool_regions_allowed,
                   const uint64_t *made_ids, const aib_region *made, size_t n_made, aib_region *regions_out,
                   uint64_t *missing_out, size_t max_regions, size_t *n_regions, size_t *n_buffers,
                   size_t *n_missing) {
  get_attributes_fn fn = (get_attributes_fn)aib_cuda_pointer_get_attributes();
  static const int attributes[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,      CU_POINTER_ATTRIBUTE_IS_MANAGED,
                                   CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,   CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                   CU_POINTER_ATTRIBUTE_RANGE_SIZE,       CU_POINTER_ATTRIBUTE_BUFFER_ID};
  *n_regions = 0;
  *n_buffers = 0;
  *n_missing = 0;
  size_t n_slots = aib_described_buffer_count(d);
  aib_buffer_slot *slots = aib_described_buffers(d);
  /* The allocations met so far (base, size), those with a region (region k of regions_out) and those
   * without (missing_out: the first buffer's address, the allocation's base and size, 0 0 when the
   * driver could not say). At most one allocation per unplaced buffer, so max_regions >= n_slots
   * always suffices. */
  uint64_t stack_bases[64], stack_sizes[64];
  uint64_t *bases = stack_bases, *sizes = stack_sizes;
  if (max_regions < n_slots) return -1;
  if (n_slots > 64) {
    bases = malloc(n_slots * sizeof(uint64_t));
    sizes = malloc(n_slots * sizeof(uint64_t));
    if (bases == NULL || sizes == NULL) {
      free(bases == stack_bases ? NULL : bases);
      free(sizes == stack_sizes ? NULL : sizes);
      return -1;
    }
  }
  size_t count = 0, missing = 0, buffers = 0;
  /* First pass: every unplaced buffer's allocation and its region (slots untouched, so a message with
   * missing regions is left as it was for the caller's second call). */
  for (size_t i = 0; i < n_slots; i++) {
    aib_buffer_slot *s = &slots[i];
    if (s->region != UNPLACED) continue; /* placed already, absent or empty */
    buffers++;
    size_t k = 0;
    for (; k < count; k++)
      if (inside(s->address, s->length, bases[k], sizes[k])) break;
    if (k < count) continue;
    for (k = 0; k < missing; k++)
      if (missing_out[3 * k + 2] != 0 && inside(s->address, s->length, missing_out[3 * k + 1], missing_out[3 * k + 2]))
        break;
    if (k < missing) continue;
    uint64_t v[6] = {0, 0, 0, 0, 0, 0};
    void *data[6] = {&v[0], &v[1], &v[2], &v[3], &v[4], &v[5]};
    int known = fn != NULL && fn(6, attributes, data, s->address) == 0 && inside(s->address, s->length, v[3], v[4]);
    aib_region region;
    if (known && (uint32_t)v[0] == CU_MEMORYTYPE_DEVICE && v[1] == 0 && (int32_t)(uint32_t)v[2] == device &&
        region_of(t, v[5], device, pool_regions_allowed, made_ids, made, n_made, &region)) {
      regions_out[count] = region;
      bases[count] = v[3];
      sizes[count] = v[4];
      count++;
    } else {
      missing_out[3 * missing] = s->address;
      missing_out[3 * missing + 1] = known ? v[3] : 0;
      missing_out[3 * missing + 2] = known ? v[4] : 0;
      missing++;
    }
  }
  if (missing == 0) {
    /* The regions in the order of their allocations' addresses: the same arrays give byte-identical
     * messages whichever regions were made this time, so a consumer's remembered message matches.
     * Slot order differs from address order whenever the allocator hands out a lower address later
     * (CuPy's pool reusing freed blocks). Insertion sort: a message has few allocations. */
    for (size_t k = 1; k < count; k++) {
      uint64_t base = bases[k], size = sizes[k];
      aib_region region = regions_out[k];
      size_t j = k;
      for (; j > 0 && bases[j - 1] > base; j--) {
        bases[j] = bases[j - 1];
        sizes[j] = sizes[j - 1];
        regions_out[j] = regions_out[j - 1];
      }
      bases[j] = base;
      sizes[j] = size;
      regions_out[j] = region;
    }
    /* Second pass: place. */
    for (size_t i = 0; i < n_slots; i++) {
      aib_buffer_slot *s = &slots[i];
      if (s->region != UNPLACED) continue;
      for (size_t k = 0; k < count; k++)
        if (inside(s->address, s->length, bases[k], sizes[k])) {
          s->region = AIB_REGION_FIRST + k;
          s->offset = s->address - bases[k];
          break;
        }
    }
    *n_regions = count;
    *n_buffers = buffers;
  }
  *n_missing = missing;
  if (bases != stack_bases) {
    free(bases);
    free(sizes);
  }
  return 0;
}
