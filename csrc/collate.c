/* collate.c: the copying half of collation: samples' bytes laid end to
 * end in a batch's block.  Deciding what goes where (walking the samples'
 * structure) is the binding's (py_collate.c), since samples are Python
 * objects; the bytes are moved here. */
#include "mpcore.h"

#include <string.h>

void mpc_gather(void *dst, void *const *src, size_t piece, size_t n) {
    char *d = dst;
    switch (piece) { /* the common small pieces, without a call per piece */
    case 8:
        for (size_t i = 0; i < n; i++)
            memcpy(d + 8 * i, src[i], 8);
        return;
    case 4:
        for (size_t i = 0; i < n; i++)
            memcpy(d + 4 * i, src[i], 4);
        return;
    default:
        for (size_t i = 0; i < n; i++)
            memcpy(d + piece * i, src[i], piece);
    }
}
