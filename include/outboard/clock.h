/* Outboard's clock class: what a C clock driver provides.
 *
 * A clock driver counts its device's periodic ticks and reports the running total to the sink
 * Outboard gives it at start; Outboard completes the waits of the clock's clients as the count
 * moves, and asks the driver for the device's own time when a client reads it. A legacy
 * driver's calls are made inside the driver (the process lock held, as osenv.h describes); a
 * native driver's (struct outboard_native_clock_ops, below) by the work loop (native.h).
 */
#ifndef OUTBOARD_CLOCK_H
#define OUTBOARD_CLOCK_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Where ticks go. `ticked` may be called at interrupt level (from a handler) and at process
 * level; `total` is the ticks since the driver started (it never goes down: a smaller total
 * than one reported before is ignored). */
struct outboard_clock_sink {
    void *ctx;
    void (*ticked)(void *ctx, uint64_t total);
};

struct outboard_clock_ops {
    /* Brings the device up and starts ticking; ticks are reported to sink (which lives as long
     * as the driver). Stores the tick rate in *hz (1 to 100,000). Returns 0, or a negative
     * osenv error code and the driver is not started. */
    int (*start)(const struct outboard_clock_sink *sink, uint32_t *hz);
    /* Stores the device's own time in nanoseconds in *ns. Returns 0 or a negative osenv error
     * code. */
    int (*now)(uint64_t *ns);
};

/* A native clock driver (native.h; `.model = OUTBOARD_MODEL_NATIVE` in its descriptor): the
 * work loop calls these, one at a time, on its thread. */
struct outboard_dev;
struct outboard_native_clock_ops {
    /* Brings `dev` up (its interrupts enabled with outboard_dev_enable_irqs) and starts
     * ticking, as `start` above; `dev` and `sink` stay valid until `stop` returns. On failure
     * it undoes its own work and keeps neither (`stop` will not be called). */
    int (*start)(struct outboard_dev *dev, const struct outboard_clock_sink *sink, uint32_t *hz);
    /* Interrupt vector `vector` fired: handle it (report ticks to the sink). Returns 0, or a
     * negative code when the device failed (the driver is then given up and started again). */
    int (*event)(uint32_t vector);
    /* As `now` above. */
    int (*now)(uint64_t *ns);
    /* Stops the device before the driver goes. Not called after the device was given up
     * (lost, failed, stalled, or `event` failed), nor after a failed `start`. */
    void (*stop)(void);
};

#ifdef __cplusplus
}
#endif

#endif
