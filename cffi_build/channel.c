/* Frames over a connected Unix stream socket: the one frame codec of the publisher/session protocol.
 *
 * Every frame either side sends or receives goes through here, the handshake included; the frame
 * format, the rule that ties descriptors to frames and the errors are specified in docs/protocol.md
 * ("Frames"). Calls run without the GIL (the publisher's serve loop and the session's requests call
 * in from C, Python through arrow_ipc_bridge/transport/channel.py).
 *
 * A channel borrows the socket's fd: the Python Connection owns it, and callers hold the
 * connection's receive (send) lock around every receive (send) here so that close() cannot close the
 * fd under a call in progress. One receiver at a time; sends are serialised by the caller.
 *
 * A receive that times out keeps what it read of a frame in the buffer, except a frame too large for
 * the buffer: its partial payload is dropped and the channel is out of sync for good (every later
 * receive fails). aib_channel_mid_frame tells the caller whether the stream can go on. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define HEADER_SIZE 16
#define BUFFER_SIZE (64 * 1024)
#define PENDING_FDS_MAX (2 * AIB_MAX_FDS)
/* How long a request whose send found the peer gone looks for its farewell (queued already, or
 * end of file at once: a bound only). */
#define FAREWELL_WAIT_MS 100

struct aib_channel {
  int fd;
  uint32_t max_payload;
  uint8_t *buf; /* BUFFER_SIZE bytes; [start, end) received and not yet handed out */
  size_t start, end;
  uint8_t *big; /* payload of the last frame too large for buf; freed at the next receive */
  /* Descriptors received but not yet handed out, each with the buffer position just past the last
   * byte of the read that brought it: it belongs to the frame holding that byte (docs/protocol.md). */
  int pending_fds[PENDING_FDS_MAX];
  size_t pending_end[PENDING_FDS_MAX];
  int n_pending;
  int64_t rcvtimeo_ms; /* the socket's SO_RCVTIMEO as we set it: 0 none, -1 could not be set */
  int out_of_sync;     /* a large frame was abandoned part way: the stream cannot be resumed */
  int refused;         /* the last receive failed because the peer broke the framing (AIB_E_PROTOCOL) */
  /* Payload limits by frame kind (aib_channel_limit_kinds; NULL: max_payload alone), borrowed, and
   * the words that end the error for a frame over them. */
  const uint32_t *kind_limits;
  uint32_t n_kind_limits;
  const char *limits_note;
  /* Set once by aib_channel_mark_closed (the Python Channel's close, or a failure that ends it);
   * the one record of whether the connection is closed, which channel.py and aib_channel_quiet
   * read. Atomic: the Python side writes it holding the GIL, a call may read it without. */
  atomic_int closed;
};

static void close_all(const int *fds, int n) {
  for (int i = 0; i < n; i++) close(fds[i]);
}

aib_channel *aib_channel_new(int fd, uint32_t max_payload) {
  if (fd < 0) return NULL;
  aib_channel *ch = calloc(1, sizeof(*ch));
  if (ch == NULL) return NULL;
  ch->buf = malloc(BUFFER_SIZE);
  if (ch->buf == NULL) {
    free(ch);
    return NULL;
  }
  ch->fd = fd;
  ch->max_payload = max_payload;
  return ch;
}

void aib_channel_free(aib_channel *ch) {
  if (ch == NULL) return;
  close_all(ch->pending_fds, ch->n_pending);
  free(ch->big);
  free(ch->buf);
  free(ch);
}

size_t aib_channel_buffered(const aib_channel *ch) { return ch->end - ch->start; }

void aib_channel_limit_kinds(aib_channel *ch, const uint32_t *limits, uint32_t n_kinds, const char *note) {
  ch->kind_limits = limits;
  ch->n_kind_limits = limits != NULL ? n_kinds : 0;
  ch->limits_note = note != NULL ? note : "";
}

int aib_channel_refused(const aib_channel *ch) { return ch->refused; }

int aib_channel_mid_frame(const aib_channel *ch) {
  /* A receive returns as soon as a whole frame is buffered, so bytes or descriptors still held
   * between calls are the beginning of an incomplete frame. */
  return ch->out_of_sync || ch->end > ch->start || ch->n_pending > 0;
}

void aib_channel_drop(aib_channel *ch) {
  close_all(ch->pending_fds, ch->n_pending);
  ch->n_pending = 0;
  free(ch->big);
  ch->big = NULL;
  ch->start = ch->end = 0;
  ch->out_of_sync = 1;
}

int aib_channel_mark_closed(aib_channel *ch) { return atomic_exchange(&ch->closed, 1); }

int aib_channel_closed(const aib_channel *ch) { return atomic_load(&ch->closed); }

int aib_channel_quiet(aib_channel *ch) {
  /* A closed channel's descriptor may be closed (and its number reused) once nobody holds its
   * locks: it is never polled. */
  if (atomic_load(&ch->closed)) return 0;
  if (ch->start != ch->end || ch->n_pending != 0 || ch->out_of_sync) return 0;
  struct pollfd p = {.fd = ch->fd, .events = POLLIN, .revents = 0};
  return poll(&p, 1, 0) == 0; /* a frame, an end of file or an error all make it ready */
}

int64_t aib_channel_peer_unread(const aib_channel *ch) {
  int n = 0;
  /* SIOCOUTQ on a Unix stream socket: what was sent and the peer has not read yet (in the kernel's
   * accounting units, 0 exactly when the peer read everything). */
  if (ioctl(ch->fd, SIOCOUTQ, &n) != 0) return -1;
  return n;
}

/* ---------- deadlines ---------------------------------------------------------------------------- */
static int64_t now_ms(void) { return aib_monotonic_ns() / 1000000; }

/* Waits for `events` on fd until the deadline (-1: forever). AIB_OK, AIB_E_TIMEOUT or AIB_E_OS. */
static int wait_for(int fd, short events, int64_t deadline, aib_error *err) {
  for (;;) {
    int wait = -1;
    if (deadline >= 0) {
      int64_t left = deadline - now_ms();
      if (left <= 0) return aib_fail(err, AIB_E_TIMEOUT, "", "", "no answer before the deadline");
      wait = left > 0x7fffffff ? 0x7fffffff : (int)left;
    }
    struct pollfd p = {.fd = fd, .events = events};
    int n = poll(&p, 1, wait);
    if (n > 0) return AIB_OK; /* readable, writable, or HUP/ERR: the next call reports which */
    if (n == 0) continue;     /* re-checks the deadline */
    if (errno == EINTR) continue;
    int e = errno;
    aib_fail(err, AIB_E_OS, "", "", "poll failed: %s", strerror(e));
    err->errno_value = e;
    return AIB_E_OS;
  }
}

static int os_failure(aib_error *err, int e, const char *op) {
  if (e == ECONNRESET || e == EPIPE || e == ENOTCONN || e == ESHUTDOWN)
    return aib_fail(err, AIB_E_PEER_CLOSED, "", "", "the peer closed the connection (%s: %s)", op,
                    strerror(e));
  aib_fail(err, AIB_E_OS, "", "", "%s failed: %s", op, strerror(e));
  if (err) err->errno_value = e;
  return AIB_E_OS;
}

/* ---------- send ------------------------------------------------------------------------------- */
int aib_channel_send(aib_channel *ch, uint32_t kind, const uint8_t *part_a, size_t len_a,
                     const uint8_t *part_b, size_t len_b, const int *fds, uint32_t n_fds,
                     int64_t timeout_ms, aib_error *err) {
  /* Closed here (channel.py's close, or a failure): nothing goes out, and the caller's wrapper
   * names the close. Checked in this call so that a send costs its wrapper no call of its own. */
  if (atomic_load(&ch->closed)) return aib_fail(err, AIB_E_PEER_CLOSED, "", "", "the channel is closed");
  if (kind > 0xffff) return aib_fail(err, AIB_E_STATE, "kind", "", "frame kind %u over 65535", kind);
  if (n_fds > AIB_MAX_FDS) return aib_fail(err, AIB_E_LIMIT, "fds", "", "%u descriptors, at most %d", n_fds, AIB_MAX_FDS);
  uint64_t total = (uint64_t)len_a + len_b;
  if (total > ch->max_payload)
    return aib_fail(err, AIB_E_LIMIT, "payload", "", "payload of %llu bytes over the limit of %u",
                    (unsigned long long)total, ch->max_payload);
  uint8_t header[HEADER_SIZE] = {'A', 'I', 'B', 'T', 1, 0};
  header[6] = kind & 0xff;
  header[7] = kind >> 8;
  aib_store_u32le(header + 8, (uint32_t)total);
  header[12] = n_fds & 0xff;
  header[13] = n_fds >> 8;
  struct iovec iov[3] = {{header, HEADER_SIZE}, {(void *)part_a, len_a}, {(void *)part_b, len_b}};
  int n_iov = 3;
  struct iovec *cur = iov;
  union {
    struct cmsghdr align;
    char bytes[CMSG_SPACE(AIB_MAX_FDS * sizeof(int))];
  } control;
  int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
  int first = 1;
  size_t left = HEADER_SIZE + (size_t)total;
  while (left > 0) {
    struct msghdr msg = {.msg_iov = cur, .msg_iovlen = (size_t)n_iov};
    if (first && n_fds > 0) {
      memset(&control, 0, sizeof(control));
      msg.msg_control = control.bytes;
      msg.msg_controllen = CMSG_SPACE(n_fds * sizeof(int));
      struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(n_fds * sizeof(int));
      memcpy(CMSG_DATA(c), fds, n_fds * sizeof(int));
    }
    ssize_t sent = sendmsg(ch->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        int rc = wait_for(ch->fd, POLLOUT, deadline, err);
        if (rc) return first ? rc : (rc == AIB_E_TIMEOUT ? aib_fail(err, AIB_E_PROTOCOL, "", "", "send timed out in the middle of a frame") : rc);
        continue;
      }
      if (first && n_fds > 0 && errno == EBADF)
        return aib_fail(err, AIB_E_STATE, "fds", "", "one of the %u descriptors is not open", n_fds);
      return os_failure(err, errno, "sendmsg");
    }
    first = 0;
    left -= (size_t)sent;
    /* Skip what went out. */
    size_t done = (size_t)sent;
    while (n_iov > 0 && done >= cur->iov_len) {
      done -= cur->iov_len;
      cur++;
      n_iov--;
    }
    if (n_iov > 0) {
      cur->iov_base = (uint8_t *)cur->iov_base + done;
      cur->iov_len -= done;
    }
  }
  return AIB_OK;
}

/* ---------- receive ---------------------------------------------------------------------------- */
/* One recvmsg into dst (cap bytes). Descriptors that came with it are appended to the pending list,
 * tagged with `tag_end` (the buffer position after the read, or a marker for big frames). Returns
 * bytes read (0 = EOF) or -1 with the error set. */
static ssize_t read_some(aib_channel *ch, uint8_t *dst, size_t cap, int64_t deadline, int big,
                         size_t position_after, aib_error *err, int *rc_out) {
  union {
    struct cmsghdr align;
    char bytes[CMSG_SPACE(AIB_MAX_FDS * sizeof(int))];
  } control;
  for (;;) {
    /* One system call where we can: a blocking recvmsg (the socket is in blocking mode; a close()
     * elsewhere shuts it down, which wakes us). With a deadline it blocks only when the socket's
     * SO_RCVTIMEO ends no later than the deadline, so it can wake early (EAGAIN: look again), never
     * late; else poll first. poll + recvmsg is a second system call on every round trip. */
    int blocking = deadline < 0;
    if (!blocking) {
      int64_t left = deadline - now_ms();
      if (left <= 0) {
        *rc_out = aib_fail(err, AIB_E_TIMEOUT, "", "", "no answer before the deadline");
        return -1;
      }
      if (ch->rcvtimeo_ms == 0 || ch->rcvtimeo_ms > left) {
        /* Set once per timeout in practice: a session asks with the same timeout every time. */
        int64_t want = left > 1 ? left - 1 : 1;
        struct timeval tv = {.tv_sec = (time_t)(want / 1000), .tv_usec = (suseconds_t)(want % 1000) * 1000};
        ch->rcvtimeo_ms = setsockopt(ch->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) == 0 ? want : -1;
      }
      blocking = ch->rcvtimeo_ms > 0 && ch->rcvtimeo_ms <= left;
      if (!blocking) {
        int rc = wait_for(ch->fd, POLLIN, deadline, err);
        if (rc) {
          *rc_out = rc;
          return -1;
        }
      }
    }
    struct iovec iov = {dst, cap};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.bytes,
                         .msg_controllen = sizeof(control.bytes)};
    ssize_t got = recvmsg(ch->fd, &msg, MSG_CMSG_CLOEXEC | (blocking ? 0 : MSG_DONTWAIT));
    if (got < 0) {
      if (errno == EINTR) continue;
      /* SO_RCVTIMEO ran out, or poll woke us for nothing: the deadline decides at the loop's top
       * (without one, a timeout left on the socket by an earlier request just means read again). */
      if (errno == EAGAIN) continue;
      *rc_out = os_failure(err, errno, "recvmsg");
      return -1;
    }
    int truncated = (msg.msg_flags & MSG_CTRUNC) != 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      int n = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
      const int *in = (const int *)CMSG_DATA(c);
      for (int i = 0; i < n; i++) {
        if (ch->n_pending == PENDING_FDS_MAX) {
          close(in[i]);
          truncated = 1;
          continue;
        }
        ch->pending_fds[ch->n_pending] = in[i];
        ch->pending_end[ch->n_pending] = big ? (size_t)-1 : position_after + (size_t)got;
        ch->n_pending++;
      }
    }
    if (truncated) {
      *rc_out = aib_fail(err, AIB_E_PROTOCOL, "fds", "", "descriptors were truncated (more than a frame may carry, or this process is out of descriptors: check RLIMIT_NOFILE)");
      return -1;
    }
    return got;
  }
}

/* Moves the descriptors that belong to a frame (tag in (lo, hi], or the big-frame marker) into out. */
static int take_fds(aib_channel *ch, size_t lo, size_t hi, int include_big, aib_frame *out) {
  int kept = 0, taken = 0;
  for (int i = 0; i < ch->n_pending; i++) {
    size_t tag = ch->pending_end[i];
    int mine = (tag > lo && tag <= hi) || (include_big && tag == (size_t)-1);
    if (mine && taken < AIB_MAX_FDS) {
      out->fds[taken++] = ch->pending_fds[i];
    } else if (mine) {
      close(ch->pending_fds[i]);
      taken++;
    } else {
      ch->pending_fds[kept] = ch->pending_fds[i];
      ch->pending_end[kept] = tag;
      kept++;
    }
  }
  ch->n_pending = kept;
  return taken;
}

static int frame_fd_check(aib_channel *ch, aib_frame *out, int taken, uint32_t announced, aib_error *err) {
  if ((uint32_t)taken == announced) {
    out->n_fds = announced;
    return AIB_OK;
  }
  close_all(out->fds, taken < AIB_MAX_FDS ? taken : AIB_MAX_FDS);
  out->n_fds = 0;
  return aib_fail(err, AIB_E_PROTOCOL, "fds", "", "frame announced %u descriptors and %d arrived", announced, taken);
}

/* A timeout inside a frame that the idle receive had started: the stream cannot be resumed. */
static int mid_frame(int rc, int64_t timeout_ms, aib_error *err) {
  if (rc != AIB_E_TIMEOUT) return rc;
  return aib_fail(err, AIB_E_PROTOCOL, "", "", "a frame was not completed within %lld ms", (long long)timeout_ms);
}

/* Moves the unread bytes to the start of the buffer. Descriptor tags hold buffer positions, so they
 * move with the bytes. */
static void compact(aib_channel *ch) {
  size_t shift = ch->start;
  if (shift == 0) return;
  memmove(ch->buf, ch->buf + shift, ch->end - shift);
  for (int i = 0; i < ch->n_pending; i++)
    if (ch->pending_end[i] != (size_t)-1) ch->pending_end[i] -= shift;
  ch->end -= shift;
  ch->start = 0;
}

/* Receives one frame. `idle` set: a timeout before the first byte of the frame is AIB_E_TIMEOUT
 * with nothing consumed (the channel is as before: the caller may wait elsewhere and call again);
 * once a byte came, the frame must be complete within timeout_ms of it, or AIB_E_PROTOCOL. */
static int recv_frame_now(aib_channel *ch, int64_t timeout_ms, int idle, aib_frame *out, aib_error *err) {
  out->kind = 0;
  out->length = 0;
  out->payload = NULL;
  out->n_fds = 0;
  free(ch->big);
  ch->big = NULL;
  if (ch->out_of_sync)
    return aib_fail(err, AIB_E_PROTOCOL, "", "", "the stream is out of sync (a frame was abandoned part way)");
  int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
  int rc = AIB_OK;
  /* Room to read: compact when what is left of the buffer cannot hold a header plus some. */
  if (ch->start == ch->end) {
    ch->start = ch->end = 0;
  }
  while (ch->end - ch->start < HEADER_SIZE) {
    int started = ch->end > ch->start || ch->n_pending > 0;
    compact(ch);
    ssize_t got = read_some(ch, ch->buf + ch->end, BUFFER_SIZE - ch->end, deadline, 0, ch->end, err, &rc);
    if (got < 0) {
      if (idle && started && rc == AIB_E_TIMEOUT)
        return aib_fail(err, AIB_E_PROTOCOL, "", "", "a frame was not completed within %lld ms",
                        (long long)timeout_ms);
      return rc;
    }
    if (idle && !started && got > 0 && timeout_ms >= 0) deadline = now_ms() + timeout_ms;
    if (got == 0) {
      if (ch->end == ch->start && ch->n_pending == 0)
        return aib_fail(err, AIB_E_PEER_CLOSED, "", "", "the peer closed the connection");
      return aib_fail(err, AIB_E_PROTOCOL, "", "", "the peer closed the connection in the middle of a frame");
    }
    ch->end += (size_t)got;
  }
  const uint8_t *h = ch->buf + ch->start;
  uint32_t version = h[4] | (uint32_t)h[5] << 8;
  uint32_t kind = h[6] | (uint32_t)h[7] << 8;
  uint64_t length = aib_load_u32le(h + 8);
  uint32_t n_fds = h[12] | (uint32_t)h[13] << 8;
  uint32_t reserved = h[14] | (uint32_t)h[15] << 8;
  if (memcmp(h, "AIBT", 4) != 0) return aib_fail(err, AIB_E_PROTOCOL, "magic", "", "bad frame magic");
  if (version != 1) return aib_fail(err, AIB_E_PROTOCOL, "version", "", "frame version %u, expected 1", version);
  if (reserved != 0) return aib_fail(err, AIB_E_PROTOCOL, "reserved", "", "reserved header field is %u", reserved);
  if (length > ch->max_payload)
    return aib_fail(err, AIB_E_PROTOCOL, "length", "", "payload of %llu bytes over the limit of %u",
                    (unsigned long long)length, ch->max_payload);
  if (ch->kind_limits != NULL) {
    /* From the header alone: none of an oversized frame's payload is waited for or kept. */
    uint32_t limit = kind < ch->n_kind_limits ? ch->kind_limits[kind] : 0;
    if (length > limit)
      return aib_fail(err, AIB_E_PROTOCOL, "length", "",
                      "a frame of kind %u announces a payload of %llu bytes, over the %u bytes that kind may "
                      "carry%s", kind, (unsigned long long)length, limit, ch->limits_note);
  }
  if (n_fds > AIB_MAX_FDS) return aib_fail(err, AIB_E_PROTOCOL, "fds", "", "%u descriptors announced, at most %d", n_fds, AIB_MAX_FDS);
  out->kind = kind;
  out->length = length;
  size_t frame_start = ch->start;
  if (HEADER_SIZE + length <= BUFFER_SIZE) {
    size_t need = HEADER_SIZE + (size_t)length;
    if (ch->start + need > BUFFER_SIZE) { /* compact so the whole frame fits */
      compact(ch);
      frame_start = 0;
    }
    while (ch->end - ch->start < need) {
      ssize_t got = read_some(ch, ch->buf + ch->end, BUFFER_SIZE - ch->end, deadline, 0, ch->end, err, &rc);
      if (got < 0) return idle ? mid_frame(rc, timeout_ms, err) : rc;
      if (got == 0) return aib_fail(err, AIB_E_PROTOCOL, "", "", "the peer closed the connection in the middle of a frame");
      ch->end += (size_t)got;
    }
    out->payload = ch->buf + ch->start + HEADER_SIZE;
    ch->start += need;
    int taken = take_fds(ch, frame_start, ch->start, 0, out);
    return frame_fd_check(ch, out, taken, n_fds, err);
  }
  /* A big frame: its own buffer of exactly the payload size, read only up to the frame's end so that
   * every descriptor arriving meanwhile is this frame's. */
  uint8_t *big = malloc(length ? (size_t)length : 1);
  if (big == NULL) return aib_fail(err, AIB_E_NOMEM, "", "", "no memory for a %llu-byte frame", (unsigned long long)length);
  size_t have = ch->end - ch->start - HEADER_SIZE;
  memcpy(big, ch->buf + ch->start + HEADER_SIZE, have);
  size_t header_end = ch->end;
  ch->start = ch->end = 0;
  /* Every descriptor pending now is this frame's (frames before it were handed out with theirs),
   * so one too many is an error at once rather than after the whole payload. */
  while (have < length && (uint32_t)ch->n_pending <= n_fds) {
    ssize_t got = read_some(ch, big + have, (size_t)length - have, deadline, 1, 0, err, &rc);
    if (got < 0) {
      free(big);
      ch->out_of_sync = 1; /* the bytes read so far are gone */
      return idle ? mid_frame(rc, timeout_ms, err) : rc;
    }
    if (got == 0) {
      free(big);
      ch->out_of_sync = 1;
      return aib_fail(err, AIB_E_PROTOCOL, "", "", "the peer closed the connection in the middle of a frame");
    }
    have += (size_t)got;
  }
  if ((uint32_t)ch->n_pending > n_fds) {
    free(big);
    ch->out_of_sync = 1;
    return aib_fail(err, AIB_E_PROTOCOL, "fds", "", "frame announced %u descriptors and %d arrived", n_fds, ch->n_pending);
  }
  ch->big = big;
  out->payload = big;
  int taken = take_fds(ch, frame_start, header_end, 1, out);
  return frame_fd_check(ch, out, taken, n_fds, err);
}

static int recv_frame(aib_channel *ch, int64_t timeout_ms, int idle, aib_frame *out, aib_error *err) {
  int rc = recv_frame_now(ch, timeout_ms, idle, out, err);
  ch->refused = rc == AIB_E_PROTOCOL;
  return rc;
}

int aib_channel_recv(aib_channel *ch, int64_t timeout_ms, aib_frame *out, aib_error *err) {
  return recv_frame(ch, timeout_ms, 0, out, err);
}

int aib_channel_recv_idle(aib_channel *ch, int64_t idle_ms, aib_frame *out, aib_error *err) {
  return recv_frame(ch, idle_ms, 1, out, err);
}

int aib_channel_request(aib_channel *ch, uint32_t kind, const uint8_t *payload, size_t length,
                        int64_t timeout_ms, aib_frame *out, aib_error *err) {
  int64_t start = now_ms();
  int rc = aib_channel_send(ch, kind, payload, length, NULL, 0, NULL, 0, timeout_ms, err);
  if (rc == AIB_E_PEER_CLOSED) {
    /* A server that closed the connection may have said why first (a farewell ERROR: closed to make
     * room, a limit): that is the answer. The peer is gone, so this never waits for more than what
     * is queued; without a frame the send's error stands. */
    aib_error sent;
    if (err != NULL) sent = *err;
    if (recv_frame(ch, FAREWELL_WAIT_MS, 0, out, err) == AIB_OK) return AIB_OK;
    if (err != NULL) *err = sent;
    return rc;
  }
  if (rc) return rc;
  int64_t left = timeout_ms;
  if (timeout_ms >= 0) {
    left = timeout_ms - (now_ms() - start);
    if (left < 0) left = 0;
  }
  return aib_channel_recv(ch, left, out, err);
}
