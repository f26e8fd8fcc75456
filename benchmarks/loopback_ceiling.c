/* The loopback request/response ceiling for benchmarks/restore_save.py: what a C server and a C client move
 * over one TCP connection on 127.0.0.1 with no protocol work at all, for the same request shapes as a bulk
 * restore (get) and save (put).
 *
 *   loopback_ceiling server PORT      serve one connection at a time on 127.0.0.1:PORT until killed
 *   loopback_ceiling client PORT      connect, then run commands read from stdin, one per line:
 *       get N SIZE CHUNK    send a request naming N keys (16 bytes each), receive N * SIZE bytes into the arena
 *       put N SIZE CHUNK    send a request naming N keys, then N * SIZE bytes from the arena; wait for an ack
 *       verify N SIZE       check the arena holds the pattern the server starts with
 *     and answer each with one line: "ok NANOSECONDS" (verify: "ok 0" or "bad OFFSET").
 *
 * CHUNK is the size of every read/write system call on both sides: SIZE gives one call per block (the
 * syscall size a bulk get/put makes per block), 0 means one call for everything that is left (the kernel
 * then moves as much as the socket buffers allow per call). Both sides keep one preallocated, touched
 * buffer of N * SIZE bytes (the server's "store", the client's "arena"), so no call allocates memory.
 *
 * Built by restore_save.py with: gcc -O2 -o loopback_ceiling loopback_ceiling.c
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { OP_GET = 1, OP_PUT = 2, KEY_BYTES = 16 };

struct head {
    uint64_t op, n, size, chunk;
};

static unsigned char *buf;
static size_t buf_len;
static unsigned char *keys;
static size_t keys_len;

static void die(const char *what) {
    perror(what);
    exit(1);
}

static unsigned char pattern(size_t i) { return (unsigned char)((i * 2654435761u) >> 13); }

/* Grow the one buffer to len bytes, touching every page (and writing the pattern) outside any timed call. */
static void ensure(size_t len) {
    if (len <= buf_len) return;
    free(buf);
    buf = malloc(len);
    if (!buf) die("malloc");
    for (size_t i = 0; i < len; i++) buf[i] = pattern(i);
    buf_len = len;
}

static void ensure_keys(size_t len) {
    if (len <= keys_len) return;
    free(keys);
    keys = calloc(1, len);
    if (!keys) die("calloc");
    keys_len = len;
}

/* Send len bytes, CHUNK bytes per call (0: everything left). Returns 0, or -1 when the peer went away. */
static int send_all(int fd, const unsigned char *p, size_t len, size_t chunk) {
    while (len) {
        size_t want = chunk && chunk < len ? chunk : len;
        ssize_t k = send(fd, p, want, MSG_NOSIGNAL);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += k;
        len -= (size_t)k;
    }
    return 0;
}

static int recv_all(int fd, unsigned char *p, size_t len, size_t chunk) {
    while (len) {
        size_t want = chunk && chunk < len ? chunk : len;
        ssize_t k = recv(fd, p, want, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        p += k;
        len -= (size_t)k;
    }
    return 0;
}

static void nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static struct sockaddr_in loopback(int port) {
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return a;
}

static _Noreturn void serve(int port) {
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = loopback(port);
    if (bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 4)) die("bind/listen");
    for (;;) {
        int fd = accept(ls, NULL, NULL);
        if (fd < 0) {
            if (errno == EINTR) continue;
            die("accept");
        }
        nodelay(fd);
        struct head h;
        while (recv_all(fd, (unsigned char *)&h, sizeof h, 0) == 0) {
            size_t total = h.n * h.size;
            ensure_keys(h.n * KEY_BYTES);
            ensure(total);
            if (recv_all(fd, keys, h.n * KEY_BYTES, 0)) break;
            if (h.op == OP_GET) {
                if (send_all(fd, buf, total, h.chunk)) break;
            } else if (h.op == OP_PUT) {
                uint64_t ack = h.n;
                if (recv_all(fd, buf, total, h.chunk) || send_all(fd, (unsigned char *)&ack, sizeof ack, 0)) break;
            } else {
                break;
            }
        }
        close(fd);
    }
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int client(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = loopback(port);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) die("connect");
    nodelay(fd);
    char line[256], op[16];
    unsigned long long n, size, chunk;
    setvbuf(stdout, NULL, _IOLBF, 0);
    while (fgets(line, sizeof line, stdin)) {
        chunk = 0;
        if (sscanf(line, "%15s %llu %llu %llu", op, &n, &size, &chunk) < 3) {
            printf("error bad command\n");
            continue;
        }
        size_t total = (size_t)(n * size);
        ensure(total);
        ensure_keys((size_t)n * KEY_BYTES);
        if (strcmp(op, "verify") == 0) {
            size_t i = 0;
            while (i < total && buf[i] == pattern(i)) i++;
            if (i == total) printf("ok 0\n");
            else printf("bad %zu\n", i);
            continue;
        }
        struct head h = {strcmp(op, "get") == 0 ? OP_GET : OP_PUT, n, size, chunk};
        uint64_t ack = 0;
        int64_t t0 = now_ns();
        int failed = send_all(fd, (unsigned char *)&h, sizeof h, 0) || send_all(fd, keys, (size_t)n * KEY_BYTES, 0);
        if (!failed && h.op == OP_GET) failed = recv_all(fd, buf, total, (size_t)chunk);
        if (!failed && h.op == OP_PUT)
            failed = send_all(fd, buf, total, (size_t)chunk) || recv_all(fd, (unsigned char *)&ack, sizeof ack, 0) ||
                     ack != n;
        int64_t t1 = now_ns();
        if (failed) {
            printf("error connection\n");
            return 1;
        }
        printf("ok %lld\n", (long long)(t1 - t0));
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s server|client PORT\n", argv[0]);
        return 2;
    }
    int port = atoi(argv[2]);
    if (strcmp(argv[1], "server") == 0) serve(port);
    if (strcmp(argv[1], "client") == 0) return client(port);
    fprintf(stderr, "usage: %s server|client PORT\n", argv[0]);
    return 2;
}
