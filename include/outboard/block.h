/* Outboard block class: the C interface.
 *
 * The same calls as the Rust client library (outboard_class::BlockDevice): open a block
 * device by name (through the manager, whatever its placement) or directly on a driver
 * server; a synchronous API (read, write, flush, discard) and an asynchronous one over the
 * session's zero-copy buffer area (submit, kick, wait).
 *
 * Every function returns 0 or a negative OB_E* code; ob_strerror() describes it. Link with
 * liboutboard_capi.a and -lpthread -ldl -lm -lrt -lutil -lgcc_s.
 */
#ifndef OUTBOARD_BLOCK_H
#define OUTBOARD_BLOCK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Error codes (the block class's wire status codes). */
#define OB_OK              0
#define OB_EINVAL         -1   /* malformed request */
#define OB_EOUTOFRANGE    -2   /* blocks beyond the end of the disk */
#define OB_EREADONLY      -3   /* the disk is read-only */
#define OB_EIO            -4   /* the device reported an I/O error */
#define OB_EUNSUPPORTED   -5   /* the device does not support the operation */
#define OB_EGONE          -6   /* the device or its driver is gone */
#define OB_ERESTARTING    -7   /* the driver is restarting; retry */
#define OB_EDUPTAG        -8   /* a request with this tag is in flight */
#define OB_EBADBUFFER     -9   /* the buffer lies outside the buffer area */
#define OB_EQUEUEFULL    -10   /* no room to submit; reap completions */
#define OB_ETIMEOUT      -11   /* timed out */
#define OB_EPROTOCOL     -12   /* the peer broke the protocol */
#define OB_ENODEV        -13   /* no such device */
#define OB_EFAILED       -14   /* the device or its driver failed and was given up */
#define OB_EBUSY         -15   /* the device is in use by another client */
#define OB_EUNREACHABLE  -16   /* the manager or server is not running */
#define OB_EQUARANTINED  -17   /* this request crashed the driver repeatedly: not sent again */
#define OB_EREFUSED      -18   /* refused: a device of another class, or not allowed */

/* Operations for ob_block_submit. */
#define OB_OP_READ         1
#define OB_OP_WRITE        2
#define OB_OP_FLUSH        3
#define OB_OP_DISCARD      4
#define OB_OP_WRITE_ZEROES 5
#define OB_OP_NULL         6

typedef struct ob_block ob_block;

typedef struct {
    uint64_t capacity;     /* in blocks */
    uint32_t block_size;   /* in bytes */
    uint32_t read_only;    /* 1 if writes are refused */
    uint32_t queue_depth;  /* requests the driver keeps in flight */
    uint32_t max_transfer; /* largest transfer of one request in bytes; 0: no limit */
} ob_block_info;

typedef struct {
    uint32_t op;           /* OB_OP_* */
    uint32_t blocks;       /* number of blocks */
    uint64_t lba;          /* first block */
    uint64_t buf_offset;   /* offset of the data in the buffer area */
    uint64_t tag;          /* returned in the completion */
} ob_block_request;

typedef struct {
    uint64_t tag;
    int32_t status;        /* OB_OK or OB_E* */
    uint32_t bytes;        /* bytes transferred */
} ob_block_completion;

/* Opens device `name` through the manager at `control` (NULL: $OUTBOARD_CONTROL or the default). */
int ob_block_open(const char *control, const char *name, ob_block **out);
/* Opens device `name` directly on the driver server listening at `server`. */
int ob_block_open_server(const char *server, const char *name, ob_block **out);
/* Closes the handle (requests still in flight are abandoned by the client). */
void ob_block_close(ob_block *b);

int ob_block_get_info(const ob_block *b, ob_block_info *info);

/* Synchronous: whole blocks; `len` must be a multiple of the block size. */
int ob_block_read(ob_block *b, uint64_t lba, void *buf, size_t len);
int ob_block_write(ob_block *b, uint64_t lba, const void *buf, size_t len);
int ob_block_flush(ob_block *b);
int ob_block_discard(ob_block *b, uint64_t lba, uint32_t blocks);

/* Asynchronous, zero copy: data lives in the buffer area. */
void *ob_block_buffer(ob_block *b, size_t *size);
int ob_block_submit(ob_block *b, const ob_block_request *req);
int ob_block_kick(ob_block *b);
/* Waits up to timeout_ms for completions; returns how many were stored (>= 0) or OB_E*. */
int ob_block_wait(ob_block *b, ob_block_completion *out, size_t max, int timeout_ms);

const char *ob_strerror(int code);

#ifdef __cplusplus
}
#endif

#endif /* OUTBOARD_BLOCK_H */
