/* A stand-in libcuda.so.1 for CPU tests of the producer's CUDA paths (tests/test_in_place_cpu.py):
 * one device, whose primary context is current from the start (as after CuPy made it so), and
 * "device memory" at or above fake_device_base in 1 MiB allocations (buffer id: the address's MiB);
 * fake_host_base..fake_device_base answers as pinned host memory, anything lower is unknown. Every
 * other driver function the bridge declares is a stub answering CUDA_SUCCESS (the test fixture
 * generates those from cuda/_declarations.py and compiles them with this file). Counters tell a test
 * which calls were made; nothing here touches a GPU. */
#include <stdint.h>
#include <string.h>

uint64_t fake_device_base = 0x700000000000ULL;
uint64_t fake_host_base = 0x600000000000ULL;
int fake_pointer_queries = 0, fake_pushes = 0, fake_waits = 0, fake_records = 0;
static const uintptr_t primary = 0xC0;
static __thread uintptr_t stack[16];
static __thread int depth = -1; /* -1: the primary context not made current yet on this thread */

int cuInit(unsigned flags) { (void)flags; return 0; }
int cuDriverGetVersion(int *version) { *version = 13000; return 0; }
int cuGetErrorName(int error, const char **text) { (void)error; *text = "CUDA_ERROR_FAKE"; return 0; }
int cuGetErrorString(int error, const char **text) { (void)error; *text = "a stand-in driver's error"; return 0; }
int cuDeviceGetName(char *name, int len, int dev) { (void)dev; strncpy(name, "fake", (size_t)len); return 0; }
int cuDeviceGetCount(int *count) { *count = 1; return 0; }
int cuDeviceGet(int *dev, int ordinal) { if (ordinal != 0) return 101; *dev = 0; return 0; }
int cuDevicePrimaryCtxRetain(uintptr_t *ctx, int dev) { (void)dev; *ctx = primary; return 0; }
static void start(void) { if (depth < 0) { stack[0] = primary; depth = 1; } }
int cuCtxGetCurrent(uintptr_t *ctx) { start(); *ctx = depth ? stack[depth - 1] : 0; return 0; }
int cuCtxPushCurrent_v2(uintptr_t ctx) { start(); if (depth == 16) return 1; stack[depth++] = ctx; fake_pushes++; return 0; }
int cuCtxPopCurrent_v2(uintptr_t *ctx) { start(); if (depth == 0) return 201; *ctx = stack[--depth]; return 0; }
/* No context current on this thread (a thread that never used CUDA). */
void fake_clear_context(void) { depth = 0; }
int cuDeviceGetUuid_v2(uint8_t *uuid, int dev) { (void)dev; memset(uuid, 0xAB, 16); return 0; }
int cuDeviceGetUuid(uint8_t *uuid, int dev) { return cuDeviceGetUuid_v2(uuid, dev); }
int cuDeviceGetAttribute(int *value, int attribute, int dev) { (void)attribute; (void)dev; *value = 1; return 0; }
static uintptr_t next_event = 0xE000;
int cuEventCreate(uintptr_t *event, unsigned flags) { (void)flags; *event = next_event; next_event += 0x10; return 0; }
int cuEventRecord(uintptr_t event, uintptr_t stream) { (void)event; (void)stream; fake_records++; return 0; }
int cuStreamWaitEvent(uintptr_t stream, uintptr_t event, unsigned flags) {
  (void)stream; (void)event; (void)flags; fake_waits++; return 0; }
int cuIpcGetEventHandle(uint8_t *handle, uintptr_t event) {
  memset(handle, 0, 64); memcpy(handle, &event, sizeof event); handle[63] = 0xEE; return 0; }
int cuIpcGetMemHandle(uint8_t *handle, uint64_t ptr) {
  uint64_t base = ptr >> 20; memset(handle, 0, 64); memcpy(handle, &base, sizeof base); handle[63] = 0x11; return 0; }

static int answer(int attribute, void *data, uint64_t ptr) {
  int device_memory = ptr >= fake_device_base;
  switch (attribute) {
    case 1: *(uintptr_t *)data = primary; break;                       /* context */
    case 2: *(uint32_t *)data = device_memory ? 2 : 1; break;          /* memory type: device / host */
    case 7: *(uint64_t *)data = ptr >> 20; break;                      /* buffer id */
    case 8: *(uint32_t *)data = 0; break;                              /* managed */
    case 9: *(uint32_t *)data = 0; break;                              /* device ordinal */
    case 10: *(uint32_t *)data = (uint32_t)device_memory; break;       /* legacy IPC capable */
    case 11: *(uint64_t *)data = ptr & ~0xFFFFFULL; break;             /* range start */
    case 12: *(uint64_t *)data = 0x100000; break;                      /* range size */
    case 13: *(uint32_t *)data = 1; break;                             /* mapped */
    case 14: *(uint64_t *)data = 0; break;                             /* allowed handle types */
    case 17: *(uintptr_t *)data = 0; break;                            /* mempool */
    default: return 1;
  }
  return 0;
}
int cuPointerGetAttributes(unsigned n, int *attributes, void **data, uint64_t ptr) {
  fake_pointer_queries++;
  if (ptr < fake_host_base) return 1; /* CUDA_ERROR_INVALID_VALUE: unknown to the driver */
  for (unsigned i = 0; i < n; i++)
    if (answer(attributes[i], data[i], ptr)) return 1;
  return 0;
}
int cuPointerGetAttribute(void *data, int attribute, uint64_t ptr) {
  fake_pointer_queries++;
  if (ptr < fake_host_base) return 1;
  return answer(attribute, data, ptr);
}
