/* Outboard's char class: what a C serial-line driver provides.
 *
 * A char driver buffers what its device receives and what it is given to send, and calls the
 * sink Outboard gives it at start whenever something moved (bytes arrived, bytes left the
 * device, the modem lines changed) -- from its interrupt handler, typically. Outboard calls the
 * operations inside the driver (the process lock held, as osenv.h describes), from the driver
 * server's loop and from a reader thread of its own: `read` with `wait` set is where a reader
 * sleeps (osenv_sleep), letting the other thread in, until the handler wakes it. Once started,
 * `read`, `write`, `set_line` and `counters` are called with interrupts held off
 * (osenv_intr_enabled() is 0), as a kernel's upper half calls a driver at spltty: those raised
 * meanwhile run when the driver enables interrupts or as the call returns.
 *
 * A native char driver (native.h; `.model = OUTBOARD_MODEL_NATIVE` in its descriptor) provides
 * struct outboard_native_char_ops instead, at the end of this file: no sleeping reader, no
 * interrupt thread; the work loop calls it, one call at a time.
 */
#ifndef OUTBOARD_CHAR_H
#define OUTBOARD_CHAR_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Where the driver says something moved; may be called at interrupt level. */
struct outboard_char_sink {
    void *ctx;
    void (*moved)(void *ctx);
};

#define OUTBOARD_PARITY_NONE  0
#define OUTBOARD_PARITY_ODD   1
#define OUTBOARD_PARITY_EVEN  2
#define OUTBOARD_PARITY_MARK  3
#define OUTBOARD_PARITY_SPACE 4

#define OUTBOARD_FLOW_NONE   0 /* bytes the driver has no room for are dropped and counted */
#define OUTBOARD_FLOW_RTSCTS 1 /* RTS off while the driver has no room; send only while CTS */

/* A line's settings. */
struct outboard_line {
    uint32_t baud;      /* bits per second */
    uint8_t data_bits;  /* 5 to 8 */
    uint8_t parity;     /* OUTBOARD_PARITY_* */
    uint8_t stop_bits;  /* 1 or 2 */
    uint8_t flow;       /* OUTBOARD_FLOW_* */
};

#define OUTBOARD_MODEM_CTS 0x1
#define OUTBOARD_MODEM_DSR 0x2
#define OUTBOARD_MODEM_RI  0x4
#define OUTBOARD_MODEM_DCD 0x8

/* What the line has done since the driver started. */
struct outboard_char_counters {
    uint64_t sent;      /* bytes the device has sent (gone from its transmitter) */
    uint64_t received;  /* bytes the device has received */
    uint32_t dropped;   /* received bytes the driver had no room for */
    uint32_t overruns;  /* bytes the device lost to a full receive FIFO */
    uint32_t errors;    /* parity and framing errors and breaks */
    uint8_t modem;      /* OUTBOARD_MODEM_* lines now */
    uint8_t held;       /* non-zero while sending waits on the far end (CTS off, bytes to send) */
    uint8_t reserved[2];
};

/* What the device is. */
struct outboard_char_info {
    uint32_t max_baud;  /* the fastest rate it makes */
    uint32_t fifo;      /* bytes in its FIFOs */
};

struct outboard_char_ops {
    /* Brings the device up (115200 baud 8N1, no flow control), reports to sink (which lives
     * as long as the driver) and fills *info. Returns 0 or a negative osenv error code. */
    int (*start)(const struct outboard_char_sink *sink, struct outboard_char_info *info);
    /* Moves at most len received bytes to buf. With wait, sleeps until there is at least one;
     * without, returns 0 if there is none. Returns the count, or OSENV_EIO once the driver is
     * stopped (a sleeping reader is woken for it). */
    long (*read)(void *buf, unsigned long len, int wait);
    /* Takes as many of the len bytes at buf as it has room for, to send; never sleeps.
     * Returns the count (0 if it has no room now). */
    long (*write)(const void *buf, unsigned long len);
    /* The settings now. Returns 0. */
    int (*get_line)(struct outboard_line *line);
    /* Applies settings Outboard checked (rate 1 to max_baud, 5-8 data bits, 1-2 stop bits).
     * Returns 0, or OSENV_EINVAL if the device cannot make them (the line unchanged). */
    int (*set_line)(const struct outboard_line *line);
    /* Fills in the counters. Outboard asks again only after the sink was called, or after a
     * write or new settings: a driver calls the sink whenever a counter or a modem line moved. */
    void (*counters)(struct outboard_char_counters *c);
    /* Quiets the device and wakes sleeping readers; the driver is not used again. */
    void (*stop)(void);
};

/* A native char driver's operations: the driver server's work loop calls them one at a time,
 * on its thread (native.h), and none of them may block. The loop calls `event` when one of
 * the device's interrupt vectors fired, and after every call it looks at what moved: it hands
 * received bytes to the readers that wait (`read`), gives the driver more to send (`write`) and
 * completes the writes whose bytes the device sent (`counters`). The driver may call the sink
 * when something moved, as a legacy driver does; the loop needs no such word, since nothing
 * moves in a native driver but inside a call. */
struct outboard_dev;
struct outboard_native_char_ops {
    /* Brings `dev` up (its interrupts enabled with outboard_dev_enable_irqs) at 115200 baud
     * 8N1 without flow control, and fills *info; `dev` and `sink` stay valid until `stop`
     * returns. On failure it undoes its own work and keeps neither (`stop` will not be
     * called). Returns 0 or a negative OUTBOARD_E* code. */
    int (*start)(struct outboard_dev *dev, const struct outboard_char_sink *sink,
                 struct outboard_char_info *info);
    /* Interrupt vector `vector` fired: handle it (move bytes between the device and the
     * driver's buffers). Returns 0, or a negative code when the device failed (the driver is
     * then given up and started again). */
    int (*event)(uint32_t vector);
    /* Moves at most len received bytes to buf; never waits. Returns the count (0 if none has
     * come), or a negative code when the device failed. */
    long (*read)(void *buf, unsigned long len);
    /* As outboard_char_ops's: takes what it has room for, returns the count. */
    long (*write)(const void *buf, unsigned long len);
    /* As outboard_char_ops's. */
    int (*get_line)(struct outboard_line *line);
    /* As outboard_char_ops's; OUTBOARD_EINVAL if the device cannot make the settings. */
    int (*set_line)(const struct outboard_line *line);
    /* As outboard_char_ops's. Called often, between the calls above: keep it cheap (it
     * needs no device access: the driver counts as things move). */
    void (*counters)(struct outboard_char_counters *c);
    /* Quiets the device before the driver goes. Not called after the device was given up
     * (lost, failed, stalled, or a call failed), nor after a failed `start`. */
    void (*stop)(void);
};

#ifdef __cplusplus
}
#endif

#endif
