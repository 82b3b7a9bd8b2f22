/* Outboard: the native execution model for drivers written in C.
 *
 * A native driver is written the way Outboard's own Rust drivers are, not the way a
 * uniprocessor kernel's are: it has no process lock, no interrupt thread, no sleeping. The
 * driver server's work loop calls it one call at a time, never two at once: the class's
 * `start`, then `event` whenever one of its device's interrupt vectors fired, and the class's
 * other operations between. The calls come from the loop's thread, except a restarted device's
 * `start` (and a `stop` of a driver thrown away before it served), which may come from a
 * helper thread: keep no per-thread state. A call must not block; waiting is the loop's job.
 *
 * It reaches its one device through the handle `start` receives; every call below takes it.
 * The handle is valid until the driver's `stop` returns. When the device is given up (lost,
 * failed, stalled) `stop` is not called and every call that returns a code fails with
 * OUTBOARD_EIO. When `start` fails, `stop` is not called either: `start` undoes its own work
 * and keeps neither the handle nor the sink.
 *
 * A native driver declares `.model = OUTBOARD_MODEL_NATIVE` in its `struct outboard_driver`
 * (driver.h) and its class's native operations (clock.h: struct outboard_native_clock_ops;
 * char.h: struct outboard_native_char_ops).
 * It uses no osenv.h call, with one exception: its active probe, if it has one (driver.h),
 * runs in osenv's look-only probe environment like any C driver's, and reads configuration
 * space with osenv_pci_config_read.
 *
 * Every call returns 0 or a negative OUTBOARD_E* code (the same values as osenv.h's).
 */
#ifndef OUTBOARD_NATIVE_H
#define OUTBOARD_NATIVE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define OUTBOARD_OK       0
#define OUTBOARD_EPERM   (-1)   /* not the driver's to change (the configuration policy) */
#define OUTBOARD_EIO     (-5)   /* the device did not answer, or was given up */
#define OUTBOARD_ENOMEM  (-12)  /* no DMA memory */
#define OUTBOARD_EBUSY   (-16)  /* already done: interrupts are enabled once */
#define OUTBOARD_EINVAL  (-22)  /* a bad argument: no such BAR, offset, size or vector */

/* A native driver's device. */
typedef struct outboard_dev outboard_dev;

/* The device's PCI configuration space, as every Outboard driver sees it: reads of its own
 * function; writes through its configuration policy (the command register's decode and
 * bus-master bits, a capability's control fields; identity and BARs are refused with
 * OUTBOARD_EPERM). `offset` is a multiple of 4 below 4096. */
int outboard_dev_config_read32(outboard_dev *dev, uint32_t offset, uint32_t *value);
int outboard_dev_config_write32(outboard_dev *dev, uint32_t offset, uint32_t value);

/* Registers of memory BAR `bar` (0-5), at `offset` (naturally aligned, inside the BAR), 8, 16,
 * 32 or 64 bits wide. An I/O BAR is refused here (OUTBOARD_EINVAL): its registers are ports,
 * reached with the calls below. */
int outboard_dev_read8(outboard_dev *dev, uint32_t bar, uint64_t offset, uint8_t *value);
int outboard_dev_read16(outboard_dev *dev, uint32_t bar, uint64_t offset, uint16_t *value);
int outboard_dev_read32(outboard_dev *dev, uint32_t bar, uint64_t offset, uint32_t *value);
int outboard_dev_read64(outboard_dev *dev, uint32_t bar, uint64_t offset, uint64_t *value);
int outboard_dev_write8(outboard_dev *dev, uint32_t bar, uint64_t offset, uint8_t value);
int outboard_dev_write16(outboard_dev *dev, uint32_t bar, uint64_t offset, uint16_t value);
int outboard_dev_write32(outboard_dev *dev, uint32_t bar, uint64_t offset, uint32_t value);
int outboard_dev_write64(outboard_dev *dev, uint32_t bar, uint64_t offset, uint64_t value);

/* Ports of I/O BAR `bar` (0-5): `offset` counts from the BAR's first port (naturally aligned,
 * inside the BAR), 8, 16 or 32 bits wide, as a CPU's in and out instructions. The driver
 * never needs the port numbers the BAR was given; a memory BAR is refused here
 * (OUTBOARD_EINVAL). Each access is one access of the device, in program order. */
int outboard_dev_io_read8(outboard_dev *dev, uint32_t bar, uint64_t offset, uint8_t *value);
int outboard_dev_io_read16(outboard_dev *dev, uint32_t bar, uint64_t offset, uint16_t *value);
int outboard_dev_io_read32(outboard_dev *dev, uint32_t bar, uint64_t offset, uint32_t *value);
int outboard_dev_io_write8(outboard_dev *dev, uint32_t bar, uint64_t offset, uint8_t value);
int outboard_dev_io_write16(outboard_dev *dev, uint32_t bar, uint64_t offset, uint16_t value);
int outboard_dev_io_write32(outboard_dev *dev, uint32_t bar, uint64_t offset, uint32_t value);

/* Enables up to `count` interrupt vectors (1-48) of the device, MSI-X if it has it, else MSI,
 * else INTx (one vector), and stores how many in *enabled. From then on vector n firing is
 * the call event(n) on the loop's thread (INTx is unmasked again when it returns). Once per
 * driver: a second call is OUTBOARD_EBUSY. */
int outboard_dev_enable_irqs(outboard_dev *dev, uint32_t count, uint32_t *enabled);

/* DMA memory: `size` bytes (1 byte to 64 MiB), page-aligned, zeroed, mapped for the device
 * at *iova and for the driver at *va, until freed (or the driver stops). */
int outboard_dev_dma_alloc(outboard_dev *dev, uint64_t size, void **va, uint64_t *iova);
/* Frees what outboard_dev_dma_alloc returned at `va`: OUTBOARD_EINVAL for anything else. */
int outboard_dev_dma_free(outboard_dev *dev, void *va);

/* Logs `message` in the driver server's log, under the driver's name, at `level`
 * (0 error, 1 warning, 2 information, 3 debug). */
void outboard_dev_log(outboard_dev *dev, int level, const char *message);

#ifdef __cplusplus
}
#endif

#endif /* OUTBOARD_NATIVE_H */
