/* Thread-local scratch buffers for the ops (see qtts_scratch.h). */
#include <pthread.h>
#include <stdlib.h>

#include "qtts_ops.h"
#include "qtts_scratch.h"

static pthread_key_t scratch_keys[QTTS_SCRATCH_SLOTS];
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_keys_ok;
static _Thread_local void * scratch_ptr[QTTS_SCRATCH_SLOTS];
static _Thread_local size_t scratch_cap[QTTS_SCRATCH_SLOTS];

/* free() itself is the destructor: nothing of this library runs at thread exit. */
static void scratch_keys_init(void) {
    int ok = 1;
    for (int i = 0; i < QTTS_SCRATCH_SLOTS; i++) ok &= pthread_key_create(&scratch_keys[i], free) == 0;
    scratch_keys_ok = ok;
}

void * qtts_scratch_get(int slot, size_t bytes) {
    GGML_ASSERT(slot >= 0 && slot < QTTS_SCRATCH_SLOTS);
    if (bytes > scratch_cap[slot]) {
        size_t cap = (bytes + bytes / 4 + 4095) & ~(size_t)4095;
        free(scratch_ptr[slot]);
        scratch_ptr[slot] = aligned_alloc(64, cap);
        GGML_ASSERT(scratch_ptr[slot] != NULL && "qtts ops: out of memory for a scratch buffer");
        scratch_cap[slot] = cap;
        pthread_once(&scratch_once, scratch_keys_init);
        if (scratch_keys_ok) pthread_setspecific(scratch_keys[slot], scratch_ptr[slot]);
    }
    return scratch_ptr[slot];
}
