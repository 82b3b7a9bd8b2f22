/* The Outboard PCI timer's driver, written the way a uniprocessor kernel's drivers are:
 * against osenv.h alone, interrupt driven, its state in static variables guarded by the
 * legacy model's rules (one thread in the driver; the handler atomic with respect to it).
 *
 * The device (docs/timer.md): a periodic tick on MSI-X vector 0, a TICKS register counting
 * whole periods since the timer was started, a STATUS.TICK bit set on every tick (the
 * interrupt is raised when it rises; the driver clears it), and a free-running nanosecond
 * counter. The handler clears STATUS.TICK first and reads TICKS second, so a tick that lands
 * between the two is counted now and raises the interrupt again: none is lost.
 */
#include <stdint.h>
#include <outboard/osenv.h>
#include <outboard/driver.h>
#include <outboard/clock.h>

#include "timer_regs.h"

static const struct outboard_clock_sink *sink;
static uint64_t reported;
static unsigned long spurious;

static void timer_intr(void *data)
{
    (void)data;
    uint32_t status = osenv_bar_read32(0, REG_STATUS);
    if (status == 0xffffffffu || !(status & STATUS_TICK)) {
        spurious++;
        return;
    }
    osenv_bar_write32(0, REG_STATUS, STATUS_TICK);
    uint64_t ticks = osenv_bar_read64(0, REG_TICKS);
    if (ticks != UINT64_MAX && ticks > reported) {
        reported = ticks;
        sink->ticked(sink->ctx, ticks);
    }
}

static int timer_start(const struct outboard_clock_sink *s, uint32_t *hz)
{
    unsigned cmd;
    int err;

    uint32_t id = osenv_bar_read32(0, REG_ID);
    if (id != TIMER_ID_VALUE) {
        osenv_log(OSENV_LOG_ERR, "timer: identity register reads %#x, not %#x", id,
                  TIMER_ID_VALUE);
        return OSENV_EIO;
    }
    err = osenv_pci_config_read(0, 0, 0, PCI_COMMAND, &cmd);
    if (err)
        return err;
    err = osenv_pci_config_write(0, 0, 0, PCI_COMMAND, cmd | PCI_COMMAND_MEMORY);
    if (err)
        return err;

    uint32_t period = osenv_bar_read32(0, REG_PERIOD_NS);
    if (period == 0 || period == 0xffffffffu)
        return OSENV_EIO;

    sink = s;
    reported = 0;
    /* The device stopped and quiet first, then the handler, then the timer: the first tick
     * finds its handler (osenv_irq_alloc is synchronous). */
    osenv_bar_write32(0, REG_CTRL, 0);
    osenv_bar_write32(0, REG_STATUS, STATUS_TICK);
    err = osenv_irq_alloc(0, timer_intr, 0, 0);
    if (err) {
        osenv_log(OSENV_LOG_ERR, "timer: vector 0: error %d", err);
        return err;
    }
    osenv_bar_write32(0, REG_CTRL, CTRL_RUN | CTRL_IRQ_ENABLE);
    *hz = 1000000000u / period;
    osenv_log(OSENV_LOG_INFO, "timer: running at %u Hz (period %u ns)", *hz, period);
    return 0;
}

static int timer_now(uint64_t *ns)
{
    uint64_t t = osenv_bar_read64(0, REG_COUNTER_NS);
    if (t == UINT64_MAX)
        return OSENV_EIO;
    *ns = t;
    return 0;
}

/* The active probe (driver.h): the device's ids matched; is it one this driver can drive?
 * It looks at configuration space only (a probe reaches no register): the revision, and BAR 0
 * sized the way a kernel sizes it, which must be a memory BAR holding the register map. A
 * build may ask for a later revision (TIMER_MIN_REVISION) or bid another score than the
 * descriptor's (TIMER_PROBE_SCORE). */
#define PCI_CLASS_REVISION 0x08
#define PCI_BAR0 0x10
#define TIMER_REGS_BYTES (REG_STATUS + 4)
#ifndef TIMER_MIN_REVISION
#define TIMER_MIN_REVISION 1 /* the first the device has had (docs/timer.md) */
#endif

static void say(char *why, uint32_t size, const char *text)
{
    uint32_t i = 0;
    for (; size > 0 && i + 1 < size && text[i]; i++)
        why[i] = text[i];
    if (size > 0)
        why[i] = 0;
}

static int timer_probe(uint32_t *score, char *why, uint32_t why_size)
{
    unsigned class_rev = 0, bar = 0, mask = 0;
    int err = osenv_pci_config_read(0, 0, 0, PCI_CLASS_REVISION, &class_rev);
    if (err)
        return err;
    if ((class_rev & 0xff) < TIMER_MIN_REVISION) {
        say(why, why_size, "the timer's revision is older than this driver supports");
        return OSENV_EINVAL;
    }
    if ((err = osenv_pci_config_read(0, 0, 0, PCI_BAR0, &bar)) ||
        (err = osenv_pci_config_write(0, 0, 0, PCI_BAR0, 0xffffffffu)) ||
        (err = osenv_pci_config_read(0, 0, 0, PCI_BAR0, &mask)) ||
        (err = osenv_pci_config_write(0, 0, 0, PCI_BAR0, bar)))
        return err;
    if (bar & 1) {
        say(why, why_size, "BAR 0 is an I/O BAR; the timer's registers are memory");
        return OSENV_EINVAL;
    }
    if ((mask & ~0xfu) == 0 || ~(mask & ~0xfu) + 1 < TIMER_REGS_BYTES) {
        say(why, why_size, "BAR 0 is too small for the timer's registers");
        return OSENV_EINVAL;
    }
#ifdef TIMER_PROBE_SCORE
    *score = TIMER_PROBE_SCORE;
#else
    (void)score;
#endif
    return 0;
}

static const struct outboard_clock_ops timer_ops = {
    .start = timer_start,
    .now = timer_now,
};

static const struct outboard_pci_id timer_ids[] = {
    { TIMER_VENDOR, TIMER_DEVICE },
    { 0, 0 },
};

/* Built into Outboard under the symbol outboard_builtin_timer; built as a shared object, the
 * same descriptor is exported as `outboard_driver`, the symbol Outboard looks for:
 *
 *   cc -shared -fPIC $(pkg-config --cflags outboard-driver) -o libtimer.so timer.c
 *
 * The name and the score may be chosen at build time (a second build beside the built-in one
 * needs another name; a higher score makes the catalog prefer it). */
#ifndef OUTBOARD_DRIVER_SYMBOL
#define OUTBOARD_DRIVER_SYMBOL outboard_driver
#endif
#ifndef TIMER_DRIVER_NAME
#define TIMER_DRIVER_NAME "legacy-timer"
#endif
#ifndef TIMER_SCORE
#define TIMER_SCORE 1000
#endif

const struct outboard_driver OUTBOARD_DRIVER_SYMBOL = {
    .abi_version = OUTBOARD_DRIVER_ABI,
    .size = sizeof(struct outboard_driver),
    .name = TIMER_DRIVER_NAME,
    .class_name = OUTBOARD_CLASS_CLOCK,
    .ids = timer_ids,
    .score = TIMER_SCORE,
    .class_ops = &timer_ops,
    .probe = timer_probe,
};
