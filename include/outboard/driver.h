/* Outboard: how a driver written in C describes itself.
 *
 * A C driver (a legacy driver on osenv.h) exports one descriptor, `outboard_driver`: its
 * personality (name, class, the PCI ids it drives, its score) and its class's operations.
 * Outboard matches it against devices like a built-in driver, starts it in a driver server of
 * its own, inside the legacy execution model, and serves its class to clients.
 *
 * ABI rule: OUTBOARD_DRIVER_ABI changes whenever this structure or a class's operations
 * change in a way an existing driver would misread; Outboard refuses a descriptor of another
 * version, or one whose `size` is smaller than the structure it knows, with an error that
 * names both versions.
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
#define OUTBOARD_CLASS_CLOCK "clock" /* struct outboard_clock_ops (outboard/clock.h) */
#define OUTBOARD_CLASS_CHAR  "char"  /* struct outboard_char_ops (outboard/char.h) */

struct outboard_driver {
    uint32_t abi_version;               /* OUTBOARD_DRIVER_ABI */
    uint32_t size;                      /* sizeof(struct outboard_driver) */
    const char *name;                   /* the driver's name: lower case, digits and '-' */
    const char *class_name;             /* one of OUTBOARD_CLASS_* */
    const struct outboard_pci_id *ids;  /* the functions it drives */
    uint32_t score;                     /* its bid: the highest-scoring match drives a device */
    const void *class_ops;              /* the class's operations */
};

#ifdef __cplusplus
}
#endif

#endif
