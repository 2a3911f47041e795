/* The libc calls the host-memory modules make on raw addresses (arrow_ipc_bridge/host/): a
 * read-write MAP_SHARED mapping and its unmap (allocate_shared needs a plain address with an
 * explicit unmap, which Python's mmap module does not give without a buffer export that blocks its
 * close), pwritev from buffers' addresses (the producer's copy path) and the PROCMAP_QUERY ioctl
 * (which mapping holds an address). Here, in API mode like every other call across the boundary
 * (c-core.md): the compiler checks the signatures and the kernel struct's layout. Each call sets
 * *error to errno when it fails; the GIL is released around it, as for every core call. */
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/uio.h>

#include "internal.h"

/* <linux/fs.h> (Linux 6.11): struct procmap_query, read and written by PROCMAP_QUERY. */
_Static_assert(sizeof(aib_procmap_query) == 104, "struct procmap_query is 104 bytes");
_Static_assert(offsetof(aib_procmap_query, vma_name_addr) == 88, "struct procmap_query layout");
#define AIB_PROCMAP_QUERY _IOWR('f', 17, aib_procmap_query)

/* The copy path hands (base, length) pairs of 64-bit integers as struct iovec[] (LP64). */
_Static_assert(sizeof(struct iovec) == 2 * sizeof(uint64_t), "struct iovec is two 64-bit words");

uint64_t aib_sys_mmap_shared(int fd, size_t length, int *error) {
  void *p = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    *error = errno;
    return 0;
  }
  return (uint64_t)(uintptr_t)p;
}

int aib_sys_munmap(uint64_t address, size_t length) { return munmap((void *)(uintptr_t)address, length); }

int64_t aib_sys_pwritev(int fd, const uint64_t *pairs, int count, int64_t offset, int *error) {
  ssize_t written = pwritev(fd, (const struct iovec *)(const void *)pairs, count, (off_t)offset);
  if (written < 0) *error = errno;
  return (int64_t)written;
}

int aib_sys_procmap_query(int fd, aib_procmap_query *query, int *error) {
  query->size = sizeof(*query);
  if (ioctl(fd, AIB_PROCMAP_QUERY, query) != 0) {
    *error = errno;
    return -1;
  }
  return 0;
}
