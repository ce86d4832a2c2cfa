/* util.c: error messages and debug switches shared by the whole core. */
#include "mpcore.h"

#include <stdarg.h>
#include <string.h>
#include <unistd.h>

int mpc_debug_enabled = 0;

static __thread char mpc__errbuf[512];

__attribute__((constructor)) static void mpc__util_init(void) {
    const char *d = getenv("MPCORE_DEBUG");
    mpc_debug_enabled = d != NULL && *d != '\0' && strcmp(d, "0") != 0;
}

int mpc_fail(int err, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(mpc__errbuf, sizeof mpc__errbuf, fmt, ap);
    va_end(ap);
    mpc_debug("fail(%d): %s", err, mpc__errbuf);
    return -(err < 0 ? -err : err);
}

const char *mpc_errmsg(void) { return mpc__errbuf; }

void mpc_clear_error(void) { mpc__errbuf[0] = '\0'; }
