/* The bottom of the C core: what every other file uses and that uses none of them — the version
 * the core was built as, error reporting (aib_fail), the hash of the core's tables, and the length of
 * an ArrowSchema metadata blob. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

#ifndef AIB_VERSION
#error "AIB_VERSION must be defined by the build (build_bridge.py)"
#endif

const char *aib_core_version(void) { return AIB_VERSION; }

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

uint64_t aib_hash_bytes(const uint8_t *p, size_t n) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a, 8 bytes a step where it can */
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    memcpy(&w, p + i, 8);
    h = (h ^ w) * 1099511628211ull;
  }
  for (; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h ^ n;
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
