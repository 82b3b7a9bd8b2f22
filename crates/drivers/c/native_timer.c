/* The Outboard PCI timer's driver in the native model (native.h): the work loop calls it, one
 * call at a time, on the loop's thread; its tick vector is one of the loop's event sources.
 * No osenv call, no lock, no sleeping: the same device as timer.c, the same register rules
 * (docs/timer.md), written the way Outboard's own drivers are.
 *
 * Built in as `native-c-timer` with a score below the legacy driver's (the catalog picks it
 * only when named, or built outside the tree with a higher score):
 *
 *   cc -shared -fPIC $(pkg-config --cflags outboard-driver) -o libntimer.so native_timer.c
 *
 * (timer_regs.h, the register map it shares with timer.c, beside it)
 */
#include <stdint.h>
#include <outboard/native.h>
#include <outboard/driver.h>
#include <outboard/clock.h>

#include "timer_regs.h"

static outboard_dev *dev;
static const struct outboard_clock_sink *sink;
static uint64_t reported;

static int timer_start(outboard_dev *d, const struct outboard_clock_sink *s, uint32_t *hz)
{
    uint32_t id = 0, cmd = 0, period = 0, vectors = 0;
    int err;

    if ((err = outboard_dev_read32(d, 0, REG_ID, &id)))
        return err;
    if (id != TIMER_ID_VALUE) {
        outboard_dev_log(d, 0, "native timer: the identity register is not the timer's");
        return OUTBOARD_EIO;
    }
    if ((err = outboard_dev_config_read32(d, PCI_COMMAND, &cmd)) ||
        (err = outboard_dev_config_write32(d, PCI_COMMAND, cmd | PCI_COMMAND_MEMORY)) ||
        (err = outboard_dev_read32(d, 0, REG_PERIOD_NS, &period)))
        return err;
    if (period == 0 || period == 0xffffffffu)
        return OUTBOARD_EIO;
    /* Stopped and quiet first; then the vector; then the timer runs. */
    if ((err = outboard_dev_write32(d, 0, REG_CTRL, 0)) ||
        (err = outboard_dev_write32(d, 0, REG_STATUS, STATUS_TICK)) ||
        (err = outboard_dev_enable_irqs(d, 1, &vectors)))
        return err;
    if (vectors < 1)
        return OUTBOARD_EIO;
    /* Kept only once nothing can fail: a failed start keeps neither (native.h). No event
     * comes before start returns, so the handler finds them set. */
    dev = d;
    sink = s;
    reported = 0;
    if ((err = outboard_dev_write32(d, 0, REG_CTRL, CTRL_RUN | CTRL_IRQ_ENABLE))) {
        dev = 0;
        sink = 0;
        return err;
    }
    *hz = 1000000000u / period;
    outboard_dev_log(d, 2, "native timer: running");
    return 0;
}

/* Clear first, read second: a tick that lands between the two raises the vector again.
 * STATUS is not read first (a register read is a round trip to the device): clearing a
 * bit that is not set changes nothing, and the tick count says whether anything happened —
 * an event with no new tick reports none. */
static int timer_event(uint32_t vector)
{
    uint64_t ticks = 0;
    int err;

    if (vector != 0)
        return 0;
    if ((err = outboard_dev_write32(dev, 0, REG_STATUS, STATUS_TICK)) ||
        (err = outboard_dev_read64(dev, 0, REG_TICKS, &ticks)))
        return err;
    if (ticks > reported) {
        reported = ticks;
        sink->ticked(sink->ctx, ticks);
    }
    return 0;
}

static int timer_now(uint64_t *ns)
{
    return outboard_dev_read64(dev, 0, REG_COUNTER_NS, ns);
}

static void timer_stop(void)
{
    outboard_dev_write32(dev, 0, REG_CTRL, 0);
    dev = 0;
}

static const struct outboard_native_clock_ops timer_ops = {
    .start = timer_start,
    .event = timer_event,
    .now = timer_now,
    .stop = timer_stop,
};

static const struct outboard_pci_id timer_ids[] = {
    { TIMER_VENDOR, TIMER_DEVICE },
    { 0, 0 },
};

#ifndef OUTBOARD_DRIVER_SYMBOL
#define OUTBOARD_DRIVER_SYMBOL outboard_driver
#endif
#ifndef TIMER_DRIVER_NAME
#define TIMER_DRIVER_NAME "native-c-timer"
#endif
#ifndef TIMER_SCORE
#define TIMER_SCORE 800
#endif

const struct outboard_driver OUTBOARD_DRIVER_SYMBOL = {
    .abi_version = OUTBOARD_DRIVER_ABI,
    .size = sizeof(struct outboard_driver),
    .name = TIMER_DRIVER_NAME,
    .class_name = OUTBOARD_CLASS_CLOCK,
    .ids = timer_ids,
    .score = TIMER_SCORE,
    .class_ops = &timer_ops,
    .model = OUTBOARD_MODEL_NATIVE,
};
