/* Outboard's clock class: what a C clock driver provides.
 *
 * A clock driver counts its device's periodic ticks and reports the running total to the sink
 * Outboard gives it at start; Outboard completes the waits of the clock's clients as the count
 * moves, and asks the driver for the device's own time when a client reads it. Both calls are
 * made inside the driver (the process lock held, as osenv.h describes).
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

#ifdef __cplusplus
}
#endif

#endif
