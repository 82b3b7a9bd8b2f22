/* Outboard: how a driver written in C describes itself.
 *
 * A C driver exports one descriptor, `outboard_driver`: its personality (name, class, the PCI
 * ids it drives, its score, its active probe), the execution model it is written for (a
 * legacy driver on osenv.h, or a native one on native.h) and its class's operations. Outboard
 * matches it against devices like a built-in driver, starts it in a driver server of its own,
 * in its execution model, and serves its class to clients.
 *
 * ABI rule: OUTBOARD_DRIVER_ABI changes whenever this structure or a class's operations
 * change in a way an existing driver would misread; Outboard refuses a descriptor of another
 * version, with an error that names both versions, or one whose `size` is smaller than the
 * version's first structure (up to `class_ops`). Fields appended within a version are read
 * only when `size` covers them: a driver built before one was added reads as it did.
 */
#ifndef OUTBOARD_DRIVER_H
#define OUTBOARD_DRIVER_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version of this descriptor and of the class operations below it. */
#define OUTBOARD_DRIVER_ABI 1

/* A PCI identity the driver takes. A list ends with an entry whose vendor is 0. */
struct outboard_pci_id {
    uint16_t vendor;
    uint16_t device;
};

/* The classes a C driver may serve, and the operations table each expects in `class_ops`. */
#define OUTBOARD_CLASS_CLOCK "clock" /* struct outboard_clock_ops (outboard/clock.h); native:
                                        struct outboard_native_clock_ops */
#define OUTBOARD_CLASS_CHAR  "char"  /* struct outboard_char_ops (outboard/char.h); native:
                                        struct outboard_native_char_ops */

struct outboard_driver {
    uint32_t abi_version;               /* OUTBOARD_DRIVER_ABI */
    uint32_t size;                      /* sizeof(struct outboard_driver) */
    const char *name;                   /* the driver's name: lower case, digits and '-' */
    const char *class_name;             /* one of OUTBOARD_CLASS_* */
    const struct outboard_pci_id *ids;  /* the functions it drives */
    uint32_t score;                     /* its bid: the highest-scoring match drives a device */
    const void *class_ops;              /* the class's operations */

    /* Fields below were appended within version 1: a descriptor whose `size` does not cover
     * one is read without it (a driver built before it keeps working, as it was).
     *
     * The driver's active probe, or NULL (its score is then its bid). Called for a device
     * its `ids` took, before any driver is started on it, to look closer: *score holds
     * `score` on entry; return 0 to bid *score (any value, 0 included), or a negative
     * OSENV_E* code to decline the device, having written why (NUL-terminated, at most
     * why_size bytes) into `why` (any other value declines it too). The highest bid among all drivers wins the device.
     *
     * It runs inside osenv like the driver's other operations, but on a copy of the
     * device's standard configuration space (256 bytes) as it was when the device was
     * found: configuration reads and BAR sizing work; configuration writes are refused
     * (OSENV_EPERM), ports and BAR registers read as all ones, interrupt vectors and wired
     * memory are refused. A probe changes nothing on the device. It may run in a process
     * of its own (the manager never runs a library's code) and again in the driver's
     * server before `start`, possibly while the same code drives another device: it keeps
     * nothing in the driver's statics. */
    int (*probe)(uint32_t *score, char *why, uint32_t why_size);

    /* The execution model the driver is written for: OUTBOARD_MODEL_LEGACY (osenv.h, the
     * default, and what a descriptor without this field is) or OUTBOARD_MODEL_NATIVE
     * (native.h: called by the work loop, one call at a time, never blocking). It says which
     * operations table `class_ops` is: clock.h's outboard_clock_ops for a legacy clock,
     * outboard_native_clock_ops for a native one; char.h's outboard_char_ops for a legacy
     * char driver, outboard_native_char_ops for a native one. */
    uint32_t model;
};

#define OUTBOARD_MODEL_LEGACY 0
#define OUTBOARD_MODEL_NATIVE 1

#ifdef __cplusplus
}
#endif

#endif
