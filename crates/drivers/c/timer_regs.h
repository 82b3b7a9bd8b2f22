/* The Outboard PCI timer's register map (docs/timer.md), shared by its two C drivers: the
 * legacy one (timer.c, on osenv.h) and the native one (native_timer.c, on native.h). Build
 * either with this file beside it. */
#ifndef TIMER_REGS_H
#define TIMER_REGS_H

#define TIMER_VENDOR 0x1234
#define TIMER_DEVICE 0x0b71
#define TIMER_ID_VALUE ((TIMER_DEVICE << 16) | 1)

/* BAR 0 registers. */
#define REG_ID 0x00
#define REG_CTRL 0x04
#define REG_PERIOD_NS 0x08
#define REG_COUNTER_NS 0x10
#define REG_TICKS 0x18
#define REG_STATUS 0x20

#define CTRL_RUN 0x1
#define CTRL_IRQ_ENABLE 0x2
#define STATUS_TICK 0x1

#define PCI_COMMAND 0x04
#define PCI_COMMAND_MEMORY 0x2

#endif
