/* Outboard's osenv: the C interface a legacy driver is written against.
 *
 * It follows the OSKit/Fluke `osenv` interface: a driver written for a uniprocessor kernel
 * gets what that kernel gave it, in a user process of its own.
 *
 *  - One process-level thread runs in the driver at a time. Outboard calls the driver's
 *    entry points holding the driver's process lock; osenv_sleep gives the lock to another
 *    thread until the wakeup.
 *  - Interrupt handlers run atomically with respect to process-level code: on the thread that
 *    is in the driver, stopped by a signal as a CPU is by an interrupt, or, if no thread is
 *    in the driver, on the interrupt thread holding the process lock. While interrupts are
 *    disabled they stay pending.
 *  - Handlers run with interrupts disabled. A handler must not sleep, enable interrupts, or
 *    allocate or free vectors or timers: those calls are refused while a handler runs.
 *
 * Every call below is made from inside the driver (an entry point Outboard called, or a
 * handler). Called from anywhere else it does nothing and logs why (or returns an error),
 * except osenv_sleep_init, osenv_wakeup (a wakeup may come from any thread of the process)
 * and osenv_timer_spin, which need no driver.
 *
 * What Outboard adds or leaves out compared with the original is said at each call; the
 * summary is at the end of this file.
 */
#ifndef OUTBOARD_OSENV_H
#define OUTBOARD_OSENV_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version of this interface. It changes whenever a change here would make a driver built
 * against the old header misbehave, and OUTBOARD_DRIVER_ABI (outboard/driver.h) changes with
 * it: a driver's descriptor carries that version, so a driver built against another osenv is
 * refused when it is loaded, naming both versions. */
#define OSENV_ABI_VERSION 1

typedef size_t oskit_size_t;
typedef uintptr_t oskit_addr_t;
typedef int oskit_error_t;
typedef int oskit_bool_t;

/* Error codes (negative errno values, as OSKit's were errno-like). */
#define OSENV_OK        0
#define OSENV_EINVAL  (-22)  /* a bad argument: no such vector, size or alignment */
#define OSENV_EBUSY   (-16)  /* the vector is in use and not shared */
#define OSENV_ENOMEM  (-12)  /* no memory of the kind asked for */
#define OSENV_ENOTIN   (-1)  /* called from outside the driver (EPERM) */
#define OSENV_EPERM    (-1)  /* not the driver's to change */
#define OSENV_EIO      (-5)  /* the driver has no device, or the device did not answer */

/* --- Interrupts ------------------------------------------------------------------------- */

/* Disables interrupts: none reaches the driver until osenv_intr_enable. (A CPU's cli.) */
void osenv_intr_disable(void);

/* Enables interrupts; those that came while they were disabled run before it returns, on the
 * calling thread. (A CPU's sti.) A handler must not call it. */
void osenv_intr_enable(void);

/* Non-zero if interrupts are enabled. */
int osenv_intr_enabled(void);

/* Lets osenv_irq_alloc put a second handler on a vector that every handler agrees to share. */
#define OSENV_IRQ_SHAREABLE 0x1

/* Registers handler(data) on interrupt vector irq: the device's vectors, its MSI-X vectors,
 * else its MSI vectors, numbered from 0 (at most 48; a driver without a device may use 0-47),
 * else its INTx line as vector 0 (a level: masked as it is delivered, unmasked once the
 * vector's handlers have run, so a device that still asserts it interrupts again).
 * The handler is registered before the call returns: an interrupt the driver provokes right
 * after it (an autoprobe) reaches the handler.
 * Returns 0, OSENV_EBUSY if the vector is held and not shared by both, OSENV_EINVAL for a
 * vector the device does not have, or OSENV_EPERM from inside a handler. */
int osenv_irq_alloc(int irq, void (*handler)(void *), void *data, int flags);

/* Removes the handler registered with these arguments. An interrupt pending on the vector is
 * handled before it returns (unless the vector is held off with osenv_irq_disable: then it
 * stays pending for the handlers that remain); afterwards the handler is never called again. */
void osenv_irq_free(int irq, void (*handler)(void *), void *data);

/* Holds one vector off (at the interrupt controller) / lets it in again / says whether it
 * was raised and not yet handled. */
void osenv_irq_disable(int irq);
void osenv_irq_enable(int irq);
int osenv_irq_pending(int irq);

/* --- Sleep and wakeup ------------------------------------------------------------------- */

/* A sleep record: two words, as in the original. */
typedef struct {
    unsigned int opaque[2];
} osenv_sleeprec_t;

/* Prepares a record to sleep on (before starting what will wake it). */
void osenv_sleep_init(osenv_sleeprec_t *sr);

/* Returns at once if a wakeup reached the record since osenv_sleep_init; otherwise leaves the
 * driver (another thread may enter), waits for the wakeup and enters again. The caller's
 * interrupt-enable state is its own across the sleep. Spurious returns do not happen, but a
 * driver written for the original should loop on its own condition anyway. (In an active
 * probe, driver.h, it returns at once: nothing there would wake it.) */
void osenv_sleep(osenv_sleeprec_t *sr);

/* Wakes the thread sleeping on the record (or makes its next sleep return at once). Safe in
 * a handler. */
void osenv_wakeup(osenv_sleeprec_t *sr);

/* --- Memory ----------------------------------------------------------------------------- */

typedef unsigned int osenv_memflags_t;

/* The size is not needed at osenv_mem_free (Outboard remembers every block's). */
#define OSENV_AUTO_SIZE    0x01
/* Memory the device can reach (DMA memory, mapped in the device's IOMMU space): its device
 * address is osenv_mem_get_phys. Outboard: page-granular, zeroed. */
#define OSENV_PHYS_WIRED   0x02
/* Accepted and ignored: a driver's addresses are never its device's. A wired block is
 * contiguous for the device (one IOVA range); osenv_mem_get_phys gives a byte's address. */
#define OSENV_VIRT_EQ_PHYS 0x04
#define OSENV_PHYS_CONTIG  0x08
/* Return NULL rather than wait when no memory is available (Outboard never waits). */
#define OSENV_NONBLOCKING  0x10
/* Accepted and ignored: there is no ISA DMA. */
#define OSENV_ISADMA_MEM   0x20

/* Allocates size bytes aligned to align (a power of two, 0 meaning 1), with interrupts held
 * off while it does. NULL if none is available, the flags ask for what this driver cannot
 * have (wired memory for a driver without a device), or the arguments are bad. */
void *osenv_mem_alloc(oskit_size_t size, osenv_memflags_t flags, unsigned align);

/* Frees a block osenv_mem_alloc returned, with the same flags (size may be 0 with
 * OSENV_AUTO_SIZE). A pointer it did not return is logged and ignored. */
void osenv_mem_free(void *block, osenv_memflags_t flags, oskit_size_t size);

/* The device address of a byte of wired memory; 0 if va is not in a wired block. */
oskit_addr_t osenv_mem_get_phys(oskit_addr_t va);

/* --- Log and panic ---------------------------------------------------------------------- */

#define OSENV_LOG_EMERG   0
#define OSENV_LOG_ALERT   1
#define OSENV_LOG_CRIT    2
#define OSENV_LOG_ERR     3
#define OSENV_LOG_WARNING 4
#define OSENV_LOG_NOTICE  5
#define OSENV_LOG_INFO    6
#define OSENV_LOG_DEBUG   7

/* Logs a printf-style message at a level (into the driver server's structured log, with the
 * device's name). Messages longer than 1,023 bytes are cut. */
void osenv_log(int priority, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void osenv_vlog(int priority, const char *fmt, va_list ap);

/* Logs the message and ends the driver server (abort): a crash like any other, after which
 * Outboard restarts the driver and its clients resume. Never returns. */
void osenv_panic(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
void osenv_vpanic(const char *fmt, va_list ap) __attribute__((noreturn));

/* --- Timers ----------------------------------------------------------------------------- */

/* Prepares the timer calls (nothing to do in Outboard; kept for the original's order). */
void osenv_timer_init(void);

/* Calls func at freq hertz (1 to 100,000), at interrupt level: like a handler, atomic with
 * respect to process-level code and held off while interrupts are disabled. Ticks the driver
 * could not take in time coalesce into one call. Returns 0, OSENV_EINVAL for a bad frequency,
 * OSENV_EBUSY when the driver has 16 timers, or OSENV_EPERM from a handler or an active probe
 * (driver.h). (The original returned nothing.) */
int osenv_timer_register(void (*func)(void), int freq);

/* Stops the timer registered with func and freq. A tick already pending may still run. */
void osenv_timer_unregister(void (*func)(void), int freq);

/* Waits nanosec nanoseconds without leaving the driver or enabling interrupts. */
void osenv_timer_spin(long nanosec);

/* --- The device: PCI configuration, I/O ports, BAR registers ----------------------------
 *
 * A driver has exactly one device, a PCI function, presented as bus 0, device 0, function 0.
 * Every access runs with interrupts held off (it may be a message to a device model). */

/* Reads the configuration dword at `port` (a multiple of 4 below 4096, else OSENV_EINVAL)
 * into *data. Another
 * bus, device or function reads as all ones (an empty slot) and returns 0. BARs are
 * presented: an I/O BAR i reads as port 0x1000*(i+1) | 1; after the driver wrote all ones to a
 * BAR, it reads the BAR's size mask (BAR sizing), until it writes another value. Returns 0,
 * or OSENV_EIO (and all ones) if the device cannot be read. */
int osenv_pci_config_read(char bus, char device, char function, unsigned port, unsigned *data);

/* Writes a configuration dword, through the function's configuration policy (the command
 * register's decode, bus-master and INTx bits, MSI/MSI-X control and the like; not the IDs,
 * not the BARs). A BAR write only starts or ends sizing: the BAR itself is not moved.
 * Returns 0, OSENV_EPERM if refused, or OSENV_EIO. */
int osenv_pci_config_write(char bus, char device, char function, unsigned port, unsigned data);

/* Non-zero if ports [port, port+size) lie in one of the device's I/O BARs and are not
 * allocated. */
oskit_bool_t osenv_io_avail(oskit_addr_t port, oskit_size_t size);

/* Allocates ports for the driver's accessors. Returns 0, OSENV_EBUSY (not in an I/O BAR, or
 * overlapping an allocation) or OSENV_EIO (no device). */
oskit_error_t osenv_io_alloc(oskit_addr_t port, oskit_size_t size);

/* Frees a range exactly as it was allocated. */
void osenv_io_free(oskit_addr_t port, oskit_size_t size);

/* Port accessors (in place of inb/outb): only within allocated ranges. A read elsewhere or of
 * a device that failed returns all ones; a write there is dropped and logged. */
uint8_t osenv_io_read8(unsigned port);
uint16_t osenv_io_read16(unsigned port);
uint32_t osenv_io_read32(unsigned port);
void osenv_io_write8(unsigned port, uint8_t value);
void osenv_io_write16(unsigned port, uint16_t value);
void osenv_io_write32(unsigned port, uint32_t value);

/* BAR register accessors (in place of osenv_mem_map_phys and pointer accesses: a BAR may be
 * reached over vfio-user, where there is nothing to map). Little-endian, as PCI is. A read
 * outside the BAR or of a device that failed returns all ones; a write returns 0 or
 * OSENV_EIO. */
uint8_t osenv_bar_read8(unsigned bar, oskit_size_t offset);
uint16_t osenv_bar_read16(unsigned bar, oskit_size_t offset);
uint32_t osenv_bar_read32(unsigned bar, oskit_size_t offset);
uint64_t osenv_bar_read64(unsigned bar, oskit_size_t offset);
int osenv_bar_write8(unsigned bar, oskit_size_t offset, uint8_t value);
int osenv_bar_write16(unsigned bar, oskit_size_t offset, uint16_t value);
int osenv_bar_write32(unsigned bar, oskit_size_t offset, uint32_t value);
int osenv_bar_write64(unsigned bar, oskit_size_t offset, uint64_t value);

/* --- Left out, and added ------------------------------------------------------------------
 *
 * Left out: osenv_mem_map_phys, osenv_mem_get_virt and osenv_mem_phys_max (a driver in a
 * process has no physical address space: its device's registers are reached through the BAR
 * accessors, its DMA memory is wired memory), osenv_pci_config_init (there is always exactly
 * one function), the RTC calls and the ISA bus calls.
 * Added: OSENV_ABI_VERSION; error returns from osenv_timer_register; osenv_vpanic; the port
 * and BAR accessors; interrupts numbered as the device's vectors (MSI-X, MSI, else INTx as
 * vector 0) instead of ISA IRQ lines.
 */

#ifdef __cplusplus
}
#endif

#endif /* OUTBOARD_OSENV_H */
