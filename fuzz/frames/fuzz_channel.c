/* libFuzzer harness for the C channel's frame parser (cffi_build/channel.c, aib_channel_recv).
 *
 * Each input is a script of writes to one end of a Unix socketpair; the channel reads frames from
 * the other end, as the publisher's serve loop and the session's requests do. The input format:
 *
 *   byte 0            options: bit 0x20 a 64-byte payload limit instead of 1 MiB; bit 0x10 receive
 *                     with a 1 s deadline instead of blocking (bit 0x40, once the handshake's buffered
 *                     bytes, is ignored: the channel reads every byte from the socket itself)
 *   then records      u8 control (low 2 bits: how many descriptors ride on this write by SCM_RIGHTS),
 *                     u16 little-endian length, that many bytes (fewer if the input ends)
 *
 * Writes are non-blocking and the writer is closed before reading, so every receive ends (a frame,
 * an error, or end of file). The harness checks, besides what ASan/UBSan catch (over-reads of the
 * payload are caught by touching every byte of it):
 *   - a frame's length and descriptor count are within the limits, and its descriptors are open;
 *   - a failed receive says why (err.code == rc, a message);
 *   - after the channel is freed no descriptor is left open that was not open before (every
 *     descriptor that arrived was handed out, closed by the channel, or dropped with the socket).
 *
 * owner.c, which defines aib_fail for the core, needs Python's headers and runtime, so the harness
 * carries the same function (it only formats the error). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "internal.h"

#define FD_SCAN 512 /* descriptors checked for leaks: new ones take the lowest free numbers */
#define MAX_FRAMES 256

static int open_fds(void) {
  int n = 0;
  for (int fd = 0; fd < FD_SCAN; fd++)
    if (fcntl(fd, F_GETFD) != -1) n++;
  return n;
}

static int passed_fd = -1; /* the descriptor sent by SCM_RIGHTS (the receiver gets new numbers) */

/* Returns how many descriptors went out with the write. */
static int send_record(int fd, const uint8_t *bytes, size_t len, int n_fds) {
  struct iovec iov = {(void *)bytes, len};
  union {
    struct cmsghdr align;
    char bytes[CMSG_SPACE(3 * sizeof(int))];
  } control;
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
  if (len == 0) n_fds = 0; /* descriptors need at least one byte to ride on */
  if (n_fds > 0) {
    memset(&control, 0, sizeof(control));
    msg.msg_control = control.bytes;
    msg.msg_controllen = CMSG_SPACE(n_fds * sizeof(int));
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(n_fds * sizeof(int));
    int fds[3] = {passed_fd, passed_fd, passed_fd};
    memcpy(CMSG_DATA(c), fds, n_fds * sizeof(int));
  }
  /* A full socket just drops the rest of the input. */
  return sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL) > 0 ? n_fds : 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static int baseline = -1;
  if (passed_fd < 0) passed_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (baseline < 0) baseline = open_fds();
  if (size == 0) return 0;
  uint8_t options = data[0];
  size_t pos = 1;
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) abort();
  int big = 1 << 20;
  (void)setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &big, sizeof(big));
  int sent_fds = 0;
  while (pos + 3 <= size) {
    uint8_t control = data[pos];
    size_t len = (size_t)data[pos + 1] | (size_t)data[pos + 2] << 8;
    pos += 3;
    if (len > size - pos) len = size - pos;
    sent_fds += send_record(sv[0], data + pos, len, control & 3);
    pos += len;
  }
  close(sv[0]); /* end of file after the last byte */

  uint32_t max_payload = (options & 0x20) ? 64 : (1u << 20);
  aib_channel *ch = aib_channel_new(sv[1], max_payload);
  if (ch == NULL) {
    abort(); /* only out of memory refuses a channel */
  } else {
    int64_t timeout_ms = (options & 0x10) ? 1000 : -1;
    aib_frame *frame = calloc(1, sizeof(*frame));
    aib_error err;
    volatile uint8_t sink = 0;
    for (int i = 0; i < MAX_FRAMES; i++) {
      memset(&err, 0, sizeof(err));
      int rc = aib_channel_recv(ch, timeout_ms, frame, &err);
      if (rc != AIB_OK) {
        if (err.code != rc || err.message[0] == '\0') abort(); /* every failure says why */
        if (frame->n_fds != 0) abort();                        /* and hands out no descriptor */
        break;
      }
      if (frame->length > max_payload || frame->n_fds > AIB_MAX_FDS) abort();
      for (uint64_t b = 0; b < frame->length; b++) sink ^= frame->payload[b]; /* ASan: no over-read */
      for (uint32_t f = 0; f < frame->n_fds; f++) {
        if (fcntl(frame->fds[f], F_GETFD) == -1) abort(); /* handed out means open, and ours */
        close(frame->fds[f]);
      }
    }
    (void)sink;
    free(frame);
    aib_channel_free(ch);
    close(sv[1]);
  }
  /* Only received descriptors can leak (the channel opens none): scan when some were sent. */
  if (sent_fds > 0 && open_fds() != baseline) {
    fprintf(stderr, "descriptor leak: %d open, %d before\n", open_fds(), baseline);
    abort();
  }
  return 0;
}
