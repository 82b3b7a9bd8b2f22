/* A small driver written the way a uniprocessor kernel's drivers are, against osenv.h alone:
 * what crates/osenv/tests/c_driver.rs loads to check the interface from C. Not a device
 * driver: its "device" is whatever raises vector 0. */
#include <stdint.h>
#include <outboard/osenv.h>

static osenv_sleeprec_t irq_rec;
static volatile int irqs;
static volatile int ticks;
static osenv_sleeprec_t tick_rec;

/* Shared between process level and the handler; updated non-atomically by both. */
static volatile long shared;
static volatile long handler_adds;

static void on_irq(void *data)
{
    (void)data;
    irqs++;
    /* A read-modify-write the process level also does: safe only because a handler never
     * interleaves with process level code that has interrupts disabled. */
    shared = shared + 1;
    handler_adds++;
    osenv_wakeup(&irq_rec);
}

static void on_tick(void)
{
    ticks++;
    osenv_wakeup(&tick_rec);
}

int selftest_start(void)
{
    return osenv_irq_alloc(0, on_irq, (void *)0x5e1f, 0);
}

void selftest_stop(void)
{
    osenv_irq_free(0, on_irq, (void *)0x5e1f);
}

/* Sleeps until `want` interrupts have come; returns how many have. */
int selftest_wait_irqs(int want)
{
    while (irqs < want) {
        osenv_sleep_init(&irq_rec);
        if (irqs >= want)
            break;
        osenv_sleep(&irq_rec);
    }
    return irqs;
}

/* `rounds` non-atomic increments of `shared`, each with interrupts disabled around the read,
 * a pause and the write. Returns shared - (rounds + handler calls): 0 if nothing was lost. */
long selftest_increment(long rounds, long pause_ns)
{
    long start = shared - handler_adds;
    for (long i = 0; i < rounds; i++) {
        osenv_intr_disable();
        long v = shared;
        osenv_timer_spin(pause_ns);
        shared = v + 1;
        osenv_intr_enable();
    }
    return (shared - handler_adds) - (start + rounds);
}

/* Counts `want` ticks of a timer at `hz`, sleeping between them; returns 0 or an error. */
int selftest_ticks(int hz, int want)
{
    osenv_timer_init();
    int rc = osenv_timer_register(on_tick, hz);
    if (rc != 0)
        return rc;
    while (ticks < want) {
        osenv_sleep_init(&tick_rec);
        if (ticks >= want)
            break;
        osenv_sleep(&tick_rec);
    }
    osenv_timer_unregister(on_tick, hz);
    return 0;
}

/* Allocates and frees memory of every plain kind; returns 0, or the step that failed. */
int selftest_memory(void)
{
    for (unsigned align = 1; align <= 4096; align <<= 1) {
        uint8_t *p = osenv_mem_alloc(100, 0, align);
        if (!p || ((uintptr_t)p & (align - 1)))
            return 1;
        for (int i = 0; i < 100; i++)
            p[i] = (uint8_t)i;
        osenv_mem_free(p, 0, 100);
    }
    void *q = osenv_mem_alloc(64, OSENV_AUTO_SIZE | OSENV_NONBLOCKING, 0);
    if (!q)
        return 2;
    osenv_mem_free(q, OSENV_AUTO_SIZE, 0);
    if (osenv_mem_alloc(64, 0, 3) != 0)
        return 3; /* not a power of two */
    if (osenv_mem_alloc(0, 0, 0) != 0)
        return 4;
    osenv_log(OSENV_LOG_INFO, "selftest memory: %d alignments", 13);
    return 0;
}

/* Allocates wired memory and returns its device address (0 if refused). */
uintptr_t selftest_wired(void)
{
    void *p = osenv_mem_alloc(8192, OSENV_PHYS_WIRED, 4096);
    if (!p)
        return 0;
    oskit_addr_t phys = osenv_mem_get_phys((oskit_addr_t)p + 100);
    osenv_mem_free(p, OSENV_PHYS_WIRED, 8192);
    return phys;
}

int selftest_intr_enabled(void)
{
    return osenv_intr_enabled();
}

/* The device, as a kernel driver probes it. */
unsigned selftest_config_id(void)
{
    unsigned v = 0;
    return osenv_pci_config_read(0, 0, 0, 0, &v) == 0 ? v : 0;
}

unsigned selftest_config_absent(void)
{
    unsigned v = 0;
    osenv_pci_config_read(0, 1, 0, 0, &v);
    return v;
}

/* Sizes BAR `bar` the way a kernel does: write all ones, read the mask, put the value back.
 * Returns the size, or 0 if the BAR did not read back as it was. */
unsigned selftest_bar_size(int bar)
{
    unsigned reg = 0x10 + 4 * (unsigned)bar, old = 0, mask = 0, after = 0;
    osenv_pci_config_read(0, 0, 0, reg, &old);
    osenv_pci_config_write(0, 0, 0, reg, 0xffffffffu);
    osenv_pci_config_read(0, 0, 0, reg, &mask);
    osenv_pci_config_write(0, 0, 0, reg, old);
    osenv_pci_config_read(0, 0, 0, reg, &after);
    if (after != old)
        return 0;
    /* The low bits are flags: 2 for an I/O BAR, 4 for a memory BAR. */
    return ~(mask & ((old & 1) ? ~0x3u : ~0xfu)) + 1;
}

int selftest_config_write_id(void)
{
    return osenv_pci_config_write(0, 0, 0, 0, 0x12345678u);
}

uint32_t selftest_bar_read32(unsigned bar, size_t offset)
{
    return osenv_bar_read32(bar, offset);
}

int selftest_io_alloc(unsigned port, unsigned size)
{
    return osenv_io_alloc(port, size);
}

/* Writes the command register back as it reads: harmless to the device, but a write. */
int selftest_config_rewrite_command(void)
{
    unsigned v = 0;
    int err = osenv_pci_config_read(0, 0, 0, 0x04, &v);
    if (err)
        return err;
    return osenv_pci_config_write(0, 0, 0, 0x04, v);
}
