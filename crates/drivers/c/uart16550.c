/* A 16550A UART driver, written the way a uniprocessor kernel's serial drivers are: against
 * osenv.h alone, interrupt driven, its state in static variables guarded by the legacy model's
 * rules -- one thread in the driver at a time, the handler atomic with respect to it
 * (process-level code that shares state with the handler holds interrupts off around it),
 * readers sleeping until the handler wakes them.
 *
 * What it does with the UART (registers, FIFOs, rings, flow control) is uart16550_core.h,
 * shared with the native driver (native_uart16550.c); this file is the legacy part: ports
 * through osenv, the handler registered with osenv_irq_alloc, interrupts held off around
 * what the handler shares, a reader that sleeps.
 */
#include <stdint.h>
#include <outboard/osenv.h>
#include <outboard/driver.h>
#include <outboard/char.h>

#define UART_EINVAL OSENV_EINVAL
#define UART_EIO OSENV_EIO
/* A port access cannot fail here: osenv answers all ones for a device that went away. */
#define UART_FAILED() 0

static unsigned base;
static const struct outboard_char_sink *sink;
static osenv_sleeprec_t reader;
static int reader_sleeps, stopped;

static uint8_t in(unsigned reg) { return osenv_io_read8(base + reg); }
static void out(unsigned reg, uint8_t v) { osenv_io_write8(base + reg, v); }

static void uart_received(void)
{
    if (reader_sleeps)
        osenv_wakeup(&reader);
}

static void uart_complain(const char *why) { osenv_log(OSENV_LOG_ERR, "uart16550: %s", why); }

#include "uart16550_core.h"

static void uart_intr(void *data)
{
    (void)data;
    if (uart_handle())
        sink->moved(sink->ctx);
}

static int uart_set_line(const struct outboard_line *l)
{
    int was = osenv_intr_enabled();
    osenv_intr_disable();
    int err = uart_program_line(l);
    if (was)
        osenv_intr_enable();
    return err;
}

static int uart_start(const struct outboard_char_sink *s, struct outboard_char_info *info)
{
    unsigned bar, cmd;
    int err = osenv_pci_config_read(0, 0, 0, PCI_BAR0, &bar);
    if (err)
        return err;
    if (!(bar & 1)) {
        osenv_log(OSENV_LOG_ERR, "uart16550: BAR 0 is not an I/O BAR (%#x)", bar);
        return OSENV_EIO;
    }
    base = bar & ~3u;
    if (!osenv_io_avail(base, 8))
        return OSENV_EBUSY;
    err = osenv_io_alloc(base, 8);
    if (err)
        return err;
    err = osenv_pci_config_read(0, 0, 0, PCI_COMMAND, &cmd);
    if (!err)
        err = osenv_pci_config_write(0, 0, 0, PCI_COMMAND, cmd | PCI_COMMAND_IO);
    if (!err)
        err = uart_reset();
    if (err)
        goto fail;
    sink = s;
    stopped = reader_sleeps = 0;
    /* Quiet first (uart_reset), then the handler, then the interrupts: the first one finds
     * its handler. */
    err = osenv_irq_alloc(0, uart_intr, 0, OSENV_IRQ_SHAREABLE);
    if (err) {
        osenv_log(OSENV_LOG_ERR, "uart16550: interrupt: error %d", err);
        goto fail;
    }
    int was = osenv_intr_enabled();
    osenv_intr_disable();
    err = uart_open(info);
    if (was)
        osenv_intr_enable();
    if (err) {
        osenv_irq_free(0, uart_intr, 0);
        goto fail;
    }
    osenv_log(OSENV_LOG_INFO, "uart16550: a 16550A at ports %#x, 115200 baud 8N1", base);
    return 0;
fail:
    osenv_io_free(base, 8);
    return err;
}

static long uart_read(void *buf, unsigned long len, int wait)
{
    osenv_intr_disable();
    while (!stopped && ring_len(&rx) == 0 && wait) {
        osenv_sleep_init(&reader);
        reader_sleeps = 1;
        osenv_sleep(&reader);
        reader_sleeps = 0;
    }
    if (stopped) {
        osenv_intr_enable();
        return OSENV_EIO;
    }
    long n = uart_take(buf, len);
    osenv_intr_enable();
    return n;
}

static long uart_write(const void *buf, unsigned long len)
{
    osenv_intr_disable();
    long n = uart_put(buf, len);
    osenv_intr_enable();
    return n;
}

static void uart_counters(struct outboard_char_counters *c)
{
    osenv_intr_disable();
    uart_fill_counters(c);
    osenv_intr_enable();
}

static void uart_stop(void)
{
    osenv_intr_disable();
    stopped = 1;
    uart_quiet();
    if (reader_sleeps)
        osenv_wakeup(&reader);
    osenv_intr_enable();
    osenv_irq_free(0, uart_intr, 0);
}

static const struct outboard_char_ops uart_ops = {
    .start = uart_start,
    .read = uart_read,
    .write = uart_write,
    .get_line = uart_get_line,
    .set_line = uart_set_line,
    .counters = uart_counters,
    .stop = uart_stop,
};

/* Built into Outboard as outboard_builtin_uart16550; built alone as a shared object it
 * exports `outboard_driver`:
 *
 *   cc -shared -fPIC $(pkg-config --cflags outboard-driver) -o libuart.so uart16550.c
 */
#ifndef UART_DRIVER_NAME
#define UART_DRIVER_NAME "uart16550"
#endif
#ifndef UART_SCORE
#define UART_SCORE 1000
#endif

const struct outboard_driver OUTBOARD_DRIVER_SYMBOL = {
    .abi_version = OUTBOARD_DRIVER_ABI,
    .size = sizeof(struct outboard_driver),
    .name = UART_DRIVER_NAME,
    .class_name = OUTBOARD_CLASS_CHAR,
    .ids = uart_ids,
    .score = UART_SCORE,
    .class_ops = &uart_ops,
};
