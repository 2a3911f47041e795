/* What wire.c needs from owner.c, without Python: the harness links the decoder, the layout rules
 * and the content checks alone. Owners here only count references (the harness checks that every
 * rebuilt tree gives its references back). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

struct aib_owner {
  int64_t refs;
};

atomic_llong aib_node_counter;

int aib_fail(aib_error *err, int code, const char *field, const char *path, const char *fmt, ...) {
  if (err != NULL) {
    err->code = code;
    snprintf(err->field, sizeof(err->field), "%s", field ? field : "");
    snprintf(err->path, sizeof(err->path), "%s", path ? path : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof(err->message), fmt, ap);
    va_end(ap);
  }
  return code;
}

size_t aib_metadata_length(const char *metadata) {
  if (metadata == NULL) return 0;
  int32_t n;
  memcpy(&n, metadata, 4);
  size_t pos = 4;
  for (int32_t i = 0; i < 2 * n; i++) {
    int32_t len;
    memcpy(&len, metadata + pos, 4);
    pos += 4 + (size_t)len;
  }
  return pos;
}

aib_owner *aib_owner_new(uint64_t token) {
  (void)token;
  aib_owner *o = calloc(1, sizeof(*o));
  if (o != NULL) o->refs = 1;
  return o;
}
void aib_owner_ref(aib_owner *owner) {
  if (owner != NULL) owner->refs++;
}
void aib_owner_unref(aib_owner *owner) {
  if (owner != NULL && --owner->refs == 0) free(owner);
}
