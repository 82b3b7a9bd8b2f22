/* A 16550A UART driver in Outboard's native model (native.h): the driver server's work loop
 * calls it one call at a time and none of its calls waits, so it needs no lock, no interrupt
 * hold-off and no sleeping reader -- its interrupt is the call `event`, and a reader that
 * finds nothing gets 0 and is asked again after the next event.
 *
 * What it does with the UART (registers, FIFOs, rings, flow control) is uart16550_core.h,
 * shared with the legacy driver on osenv (uart16550.c); this file is the native part: ports
 * through outboard_dev_io_*, the interrupt enabled with outboard_dev_enable_irqs, and a
 * device that stops answering reported as a failed call (the driver is then given up and
 * started again on its device).
 */
#include <stdint.h>
#include <outboard/native.h>
#include <outboard/driver.h>
#include <outboard/char.h>

#define UART_EINVAL OUTBOARD_EINVAL
#define UART_EIO OUTBOARD_EIO
/* Set when a register access failed since the call began (below). */
#define UART_FAILED() (failed)

static outboard_dev *dev;
static const struct outboard_char_sink *sink;
/* A register access failed since the call began: the call fails with OUTBOARD_EIO. */
static int failed;

static uint8_t in(unsigned reg)
{
    uint8_t v = 0xff;
    if (outboard_dev_io_read8(dev, 0, reg, &v))
        failed = 1;
    return v;
}

static void out(unsigned reg, uint8_t v)
{
    if (outboard_dev_io_write8(dev, 0, reg, v))
        failed = 1;
}

static void uart_received(void) {}

static void uart_complain(const char *why) { outboard_dev_log(dev, 0, why); }

#include "uart16550_core.h"

/* What a call that touched the device answers: its own result, or OUTBOARD_EIO if a register
 * access failed on the way. */
static long answer(long result)
{
    if (failed) {
        failed = 0;
        return OUTBOARD_EIO;
    }
    return result;
}

static int uart_start(outboard_dev *d, const struct outboard_char_sink *s,
                      struct outboard_char_info *info)
{
    uint32_t bar, cmd, vectors = 0;
    int decoding = 0;
    dev = d;
    failed = 0;
    int err = outboard_dev_config_read32(dev, PCI_BAR0, &bar);
    if (!err && !(bar & 1)) {
        outboard_dev_log(dev, 0, "BAR 0 is not an I/O BAR");
        err = OUTBOARD_EIO;
    }
    if (!err)
        err = outboard_dev_config_read32(dev, PCI_COMMAND, &cmd);
    if (!err && !(cmd & PCI_COMMAND_IO)) {
        err = outboard_dev_config_write32(dev, PCI_COMMAND, cmd | PCI_COMMAND_IO);
        decoding = !err;
    }
    if (!err)
        err = (int)answer(uart_reset());
    /* Quiet first (uart_reset), then the interrupt, then the device's interrupts on. */
    if (!err)
        err = outboard_dev_enable_irqs(dev, 1, &vectors);
    if (!err) {
        sink = s;
        err = (int)answer(uart_open(info));
    }
    if (!err) {
        outboard_dev_log(dev, 2, "a 16550A on I/O BAR 0, 115200 baud 8N1");
        return 0;
    }
    /* Undone as far as it went: quiet (the vector Outboard enabled goes with the device), the
     * port decoding off again if this turned it on, and neither the handle nor the sink kept. */
    uart_quiet();
    if (decoding)
        (void)outboard_dev_config_write32(dev, PCI_COMMAND, cmd);
    failed = 0;
    dev = 0;
    sink = 0;
    return err;
}

static int uart_event(uint32_t vector)
{
    (void)vector;
    int moved = uart_handle();
    int err = (int)answer(0);
    if (moved && !err)
        sink->moved(sink->ctx);
    return err;
}

static long uart_read(void *buf, unsigned long len) { return answer(uart_take(buf, len)); }

static long uart_write(const void *buf, unsigned long len) { return answer(uart_put(buf, len)); }

static int uart_set_line(const struct outboard_line *l)
{
    return (int)answer(uart_program_line(l));
}

static void uart_counters(struct outboard_char_counters *c) { uart_fill_counters(c); }

static void uart_stop(void)
{
    uart_quiet();
    failed = 0;
    dev = 0;
}

static const struct outboard_native_char_ops uart_ops = {
    .start = uart_start,
    .event = uart_event,
    .read = uart_read,
    .write = uart_write,
    .get_line = uart_get_line,
    .set_line = uart_set_line,
    .counters = uart_counters,
    .stop = uart_stop,
};

/* Built into Outboard as outboard_builtin_native_uart16550; built alone as a shared object
 * it exports `outboard_driver`:
 *
 *   cc -shared -fPIC $(pkg-config --cflags outboard-driver) -o libnuart.so native_uart16550.c
 */
#ifndef UART_DRIVER_NAME
#define UART_DRIVER_NAME "native-c-uart16550"
#endif
#ifndef UART_SCORE
#define UART_SCORE 800
#endif

const struct outboard_driver OUTBOARD_DRIVER_SYMBOL = {
    .abi_version = OUTBOARD_DRIVER_ABI,
    .size = sizeof(struct outboard_driver),
    .name = UART_DRIVER_NAME,
    .class_name = OUTBOARD_CLASS_CHAR,
    .ids = uart_ids,
    .score = UART_SCORE,
    .class_ops = &uart_ops,
    .model = OUTBOARD_MODEL_NATIVE,
};
