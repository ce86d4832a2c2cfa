/* fdpass.c: the socket plumbing shared by the keeper, its clients and the
 * zygote: abstract Unix addresses, and messages that carry fds by
 * SCM_RIGHTS.  Nothing here knows what a message means; the keeper's and
 * the zygote's protocols are defined where they are served.
 *
 * NOTE [ Receiving fds ]
 * Every fd that arrives is either handed to the caller or closed here, on
 * every path (a short read and an error included): an fd passed with a
 * message that is then refused must not leak into the receiver, which may
 * be a long-lived keeper or zygote.  They arrive close-on-exec
 * (MSG_CMSG_CLOEXEC), so that no child started meanwhile inherits them. */
#include "internal.h"

#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>

/* The most fds one message may carry (the zygote's limit). */
#define MPC_FDPASS_MAX 16

socklen_t mpc__addr(const char *name, struct sockaddr_un *sa) {
    memset(sa, 0, sizeof *sa);
    sa->sun_family = AF_UNIX;
    size_t n = strlen(name);
    if (n > sizeof sa->sun_path - 2)
        n = sizeof sa->sun_path - 2;
    memcpy(sa->sun_path + 1, name, n); /* abstract: leading NUL, no file */
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

int mpc__send_fd(int sock, const void *buf, size_t len, int fd) {
    struct iovec iov = {(void *)buf, len};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (fd >= 0) {
        memset(&u, 0, sizeof u);
        mh.msg_control = u.buf;
        mh.msg_controllen = sizeof u.buf;
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof fd);
    }
    ssize_t n;
    do {
        n = sendmsg(sock, &mh, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n < 0)
        return -errno;
    return (size_t)n == len ? 0 : -EPROTO;
}

ssize_t mpc__recv_fds(int sock, void *buf, size_t len, int *fds, int maxfds, int *nfds) {
    struct iovec iov = {buf, len};
    union {
        char buf[CMSG_SPACE(sizeof(int) * MPC_FDPASS_MAX)];
        struct cmsghdr align;
    } u;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                        .msg_controllen = sizeof u.buf};
    ssize_t n;
    do {
        n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
    } while (n < 0 && errno == EINTR);
    int e = errno;
    int got = 0;
    if (n >= 0)
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
                continue;
            int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < k; i++) {
                int fd;
                memcpy(&fd, CMSG_DATA(c) + (size_t)i * sizeof(int), sizeof fd);
                if (fds != NULL && got < maxfds)
                    fds[got++] = fd;
                else
                    close(fd);
            }
        }
    if (nfds != NULL)
        *nfds = got;
    return n < 0 ? -e : n;
}
