/* An EIO injector for tests, loaded with LD_PRELOAD (no root, no device): the calls below fail
 * with EIO on a file descriptor whose path contains CKPTFS_EIO_PATH, for the operations named in
 * CKPTFS_EIO_OPS ("write", "fsync", "read", comma-separated), after CKPTFS_EIO_SKIP matching calls
 * have gone through. Every other call goes to the C library. tests/test_eio.py builds and uses it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

static long seen;

static int faulty(int fd, const char *op) {
    const char *want = getenv("CKPTFS_EIO_PATH");
    const char *ops = getenv("CKPTFS_EIO_OPS");
    if (!want || !ops || !strstr(ops, op)) return 0;
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) return 0;
    path[n] = 0;
    if (!strstr(path, want)) return 0;
    const char *skip = getenv("CKPTFS_EIO_SKIP");
    if (__atomic_fetch_add(&seen, 1, __ATOMIC_SEQ_CST) < (skip ? atol(skip) : 0)) return 0;
    errno = EIO;
    return 1;
}

#define NEXT(name) ((__typeof__(&name))dlsym(RTLD_NEXT, #name))

ssize_t write(int fd, const void *b, size_t n) {
    return faulty(fd, "write") ? -1 : NEXT(write)(fd, b, n);
}
ssize_t writev(int fd, const struct iovec *v, int c) {
    return faulty(fd, "write") ? -1 : NEXT(writev)(fd, v, c);
}
ssize_t pwrite64(int fd, const void *b, size_t n, off_t o) {
    return faulty(fd, "write") ? -1 : NEXT(pwrite64)(fd, b, n, o);
}
ssize_t pwritev64(int fd, const struct iovec *v, int c, off_t o) {
    return faulty(fd, "write") ? -1 : NEXT(pwritev64)(fd, v, c, o);
}
int fsync(int fd) { return faulty(fd, "fsync") ? -1 : NEXT(fsync)(fd); }
int fdatasync(int fd) { return faulty(fd, "fsync") ? -1 : NEXT(fdatasync)(fd); }
ssize_t read(int fd, void *b, size_t n) {
    return faulty(fd, "read") ? -1 : NEXT(read)(fd, b, n);
}
ssize_t pread64(int fd, void *b, size_t n, off_t o) {
    return faulty(fd, "read") ? -1 : NEXT(pread64)(fd, b, n, o);
}
ssize_t preadv64(int fd, const struct iovec *v, int c, off_t o) {
    return faulty(fd, "read") ? -1 : NEXT(preadv64)(fd, v, c, o);
}
ssize_t readv(int fd, const struct iovec *v, int c) {
    return faulty(fd, "read") ? -1 : NEXT(readv)(fd, v, c);
}
/* CPython's os.preadv and os.pwritev call the v2 forms */
ssize_t preadv64v2(int fd, const struct iovec *v, int c, off_t o, int flags) {
    return faulty(fd, "read") ? -1 : NEXT(preadv64v2)(fd, v, c, o, flags);
}
ssize_t pwritev64v2(int fd, const struct iovec *v, int c, off_t o, int flags) {
    return faulty(fd, "write") ? -1 : NEXT(pwritev64v2)(fd, v, c, o, flags);
}
