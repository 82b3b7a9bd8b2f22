/* What both of Outboard's 16550A drivers do with the UART (PC16550D data sheet): the legacy
 * one on osenv.h (uart16550.c) and the native one on native.h (native_uart16550.c). Those
 * files hold only what differs: how a register is reached, how the interrupt handler is kept
 * apart from the rest, and who waits for received bytes.
 *
 * It drives QEMU's pci-serial (1b36:0002): one UART behind I/O BAR 0, its interrupt on INTx.
 * Both FIFOs on, the receive interrupt at 8 bytes (the character timeout brings fewer). The
 * handler drains the receive FIFO into a 4 KiB ring and refills the transmit FIFO from another.
 * With RTS/CTS flow control, RTS goes off (and the receive interrupt is held off) while the
 * ring has less than a FIFO's room, and nothing is sent while CTS is off; without it, bytes
 * the ring has no room for are dropped and counted.
 *
 * The including file defines, before it includes this one:
 *   UART_EINVAL, UART_EIO          its environment's error codes
 *   UART_FAILED()                  non-zero once a register access failed (a loop stops)
 *   static uint8_t in(unsigned reg);             reads a register
 *   static void out(unsigned reg, uint8_t v);    writes one
 *   static void uart_received(void);             bytes came in (called by the handler)
 *   static void uart_complain(const char *why);  logs an error
 * and calls what is below with the handler kept out: interrupts held off (legacy), or the
 * work loop's one call at a time (native). The state is static: one UART per process, as in
 * a driver server.
 */
#ifndef UART16550_CORE_H
#define UART16550_CORE_H

#include <stdint.h>
#include <stdio.h>
#include <outboard/char.h>
#include <outboard/driver.h>

#define UART_VENDOR 0x1b36
#define UART_DEVICE 0x0002

#define DATA 0
#define IER 1
#define IIR 2
#define FCR 2
#define LCR 3
#define MCR 4
#define LSR 5
#define MSR 6
#define SCR 7

#define IER_RDA 0x01
#define IER_THRE 0x02
#define IER_RLS 0x04
#define IER_MSI 0x08

#define IIR_NONE 0x01
#define IIR_ID 0x0e
#define IIR_RLS 0x06
#define IIR_RDA 0x04
#define IIR_TIMEOUT 0x0c
#define IIR_THRE 0x02
#define IIR_MODEM 0x00
#define IIR_FIFOS 0xc0

#define FCR_ENABLE 0x01
#define FCR_CLEAR_RX 0x02
#define FCR_CLEAR_TX 0x04
#define FCR_TRIGGER_8 0x80

#define LCR_STOP2 0x04
#define LCR_PARITY 0x08
#define LCR_EVEN 0x10
#define LCR_STICK 0x20
#define LCR_DLAB 0x80

#define MCR_DTR 0x01
#define MCR_RTS 0x02
#define MCR_OUT2 0x08

#define LSR_DR 0x01
#define LSR_OE 0x02
#define LSR_PE 0x04
#define LSR_FE 0x08
#define LSR_BI 0x10

#define MSR_CTS 0x10
#define MSR_DSR 0x20
#define MSR_RI 0x40
#define MSR_DCD 0x80

#define CLOCK_BAUD 115200u
#define FIFO 16
#define RING 4096
/* Most rounds of one interrupt, and each round takes at most a FIFO's worth of bytes: a
 * device that never says "no interrupt" is not looped on, and one that is always ready (a
 * virtual UART moves bytes at once, behind register accesses that are each a message to its
 * model) does not keep the rest of the driver out. What is left keeps the line asserted: the
 * next interrupt comes as soon as this one ends. */
#define MOST_ROUNDS 4

#define PCI_COMMAND 0x04
#define PCI_COMMAND_IO 0x1
#define PCI_BAR0 0x10

struct ring {
    unsigned char b[RING];
    unsigned head, tail; /* head - tail bytes, at tail first */
};

static struct ring rx, tx;
static unsigned in_fifo;   /* bytes written to the transmitter, not yet seen gone */
static uint8_t ier, mcr, msr;
static struct outboard_line line;
/* The divisor and LCR the device last took (0: none yet), to put back after a refusal. */
static unsigned line_div;
static uint8_t line_lcr;
static struct outboard_char_counters count;

static inline unsigned ring_len(const struct ring *r) { return r->head - r->tail; }
static inline unsigned ring_room(const struct ring *r) { return RING - ring_len(r); }

static inline void set_ier(uint8_t v)
{
    ier = v;
    out(IER, v);
}

static inline int flowing(void) { return line.flow == OUTBOARD_FLOW_RTSCTS; }

/* Fills the transmit FIFO from the ring, if the transmitter is empty and CTS lets it. */
static inline void start_sending(void)
{
    if (in_fifo || (flowing() && !(msr & MSR_CTS)))
        return;
    unsigned n = ring_len(&tx);
    if (n > FIFO)
        n = FIFO;
    for (unsigned i = 0; i < n; i++)
        out(DATA, tx.b[tx.tail++ % RING]);
    in_fifo = n;
    if (n && !(ier & IER_THRE))
        set_ier(ier | IER_THRE);
    else if (!n && (ier & IER_THRE))
        set_ier(ier & ~IER_THRE);
}

/* The receive ring's room changed: RTS and the receive interrupt follow it under flow
 * control. */
static inline void pace_receiver(void)
{
    if (!flowing())
        return;
    int room = ring_room(&rx) >= 2 * FIFO;
    uint8_t want = room ? (mcr | MCR_RTS) : (mcr & ~MCR_RTS);
    if (want != mcr) {
        mcr = want;
        out(MCR, mcr);
    }
    uint8_t ie = room ? (ier | IER_RDA) : (ier & ~IER_RDA);
    if (ie != ier)
        set_ier(ie);
}

static inline void receive(void)
{
    for (unsigned i = 0; i < FIFO && (in(LSR) & LSR_DR); i++) {
        uint8_t b = in(DATA);
        count.received++;
        if (ring_room(&rx) == 0) {
            count.dropped++;
            continue;
        }
        rx.b[rx.head++ % RING] = b;
    }
    pace_receiver();
    uart_received();
}

/* The interrupt handler's work: each pending cause, in the device's order of priority.
 * Returns whether anything was pending. */
static inline int uart_handle(void)
{
    int moved = 0;
    for (int round = 0; round < MOST_ROUNDS; round++) {
        uint8_t iir = in(IIR);
        if (iir == 0xff || (iir & IIR_NONE))
            break;
        moved = 1;
        switch (iir & IIR_ID) {
        case IIR_RLS: {
            uint8_t lsr = in(LSR);
            if (lsr & LSR_OE)
                count.overruns++;
            if (lsr & (LSR_PE | LSR_FE | LSR_BI))
                count.errors++;
            if (lsr & LSR_DR)
                receive();
            break;
        }
        case IIR_RDA:
        case IIR_TIMEOUT:
            receive();
            break;
        case IIR_THRE:
            /* The FIFO is empty: what was in it has gone. */
            count.sent += in_fifo;
            in_fifo = 0;
            start_sending();
            break;
        case IIR_MODEM:
            msr = in(MSR);
            start_sending();
            break;
        default:
            break;
        }
    }
    return moved;
}

/* The divisor for a rate, if the clock makes it within 2%. */
static inline unsigned divisor(uint32_t baud)
{
    if (baud == 0 || baud > CLOCK_BAUD)
        return 0;
    unsigned d = (CLOCK_BAUD + baud / 2) / baud;
    if (d == 0 || d > 0xffff)
        return 0;
    unsigned made = CLOCK_BAUD / d;
    unsigned off = made > baud ? made - baud : baud - made;
    return off * 50 <= baud ? d : 0;
}

/* Puts settings on the line: 0, UART_EINVAL for settings the UART cannot make, or UART_EIO if
 * it did not take them (the line then stays as it was). */
static inline int uart_program_line(const struct outboard_line *l)
{
    unsigned d = divisor(l->baud);
    if (!d || l->data_bits < 5 || l->data_bits > 8 || l->stop_bits < 1 || l->stop_bits > 2 ||
        l->parity > OUTBOARD_PARITY_SPACE || l->flow > OUTBOARD_FLOW_RTSCTS)
        return UART_EINVAL;
    uint8_t lcr = (uint8_t)(l->data_bits - 5);
    if (l->stop_bits == 2)
        lcr |= LCR_STOP2;
    switch (l->parity) {
    case OUTBOARD_PARITY_ODD: lcr |= LCR_PARITY; break;
    case OUTBOARD_PARITY_EVEN: lcr |= LCR_PARITY | LCR_EVEN; break;
    case OUTBOARD_PARITY_MARK: lcr |= LCR_PARITY | LCR_STICK; break;
    case OUTBOARD_PARITY_SPACE: lcr |= LCR_PARITY | LCR_EVEN | LCR_STICK; break;
    default: break;
    }
    out(LCR, LCR_DLAB);
    out(DATA, d & 0xff);
    out(IER, d >> 8);
    /* Read back: a device that did not take the rate or the frame says so here, not as
     * garbage on the line later. */
    unsigned kept = in(DATA) | ((unsigned)in(IER) << 8);
    out(LCR, lcr);
    uint8_t kept_lcr = in(LCR);
    if (kept != d || kept_lcr != lcr) {
        char why[96];
        snprintf(why, sizeof why, "the device kept divisor %u and LCR %#x, not %u and %#x",
                 kept, kept_lcr, d, lcr);
        uart_complain(why);
        /* The line stays as it was: the settings before are written back. */
        if (line_div) {
            out(LCR, LCR_DLAB);
            out(DATA, line_div & 0xff);
            out(IER, line_div >> 8);
            out(LCR, line_lcr);
        }
        return UART_EIO;
    }
    line_div = d;
    line_lcr = lcr;
    line = *l;
    /* Without flow control RTS stays on and the receive interrupt with it. */
    if (!flowing()) {
        mcr |= MCR_RTS;
        out(MCR, mcr);
        set_ier(ier | IER_RDA);
    }
    pace_receiver();
    msr = in(MSR);
    start_sending();
    return 0;
}

/* Checks that the device is a 16550A (a scratch register that keeps what is written, FIFOs
 * that say so), turns the FIFOs on, and quiets it with its state forgotten: it raises no
 * interrupt until uart_open. */
static inline int uart_reset(void)
{
    out(SCR, 0x5a);
    if (in(SCR) != 0x5a) {
        uart_complain("no scratch register: not a 16550");
        return UART_EIO;
    }
    out(FCR, FCR_ENABLE | FCR_CLEAR_RX | FCR_CLEAR_TX | FCR_TRIGGER_8);
    if ((in(IIR) & IIR_FIFOS) != IIR_FIFOS) {
        uart_complain("the FIFOs do not work: not a 16550A");
        return UART_EIO;
    }
    rx.head = rx.tail = tx.head = tx.tail = 0;
    in_fifo = 0;
    struct outboard_char_counters zero = { 0 };
    count = zero;
    set_ier(0);
    (void)in(LSR);
    (void)in(MSR);
    /* At most a ring's worth: a device that always says it has data is not looped on. */
    for (unsigned i = 0; i < RING && !UART_FAILED() && (in(LSR) & LSR_DR); i++)
        (void)in(DATA);
    return 0;
}

/* With its handler in place: the modem lines and interrupts on, 115200 baud 8N1 without flow
 * control. Fills *info. */
static inline int uart_open(struct outboard_char_info *info)
{
    mcr = MCR_DTR | MCR_RTS | MCR_OUT2;
    out(MCR, mcr);
    ier = IER_RDA | IER_RLS | IER_MSI;
    struct outboard_line l = { 115200, 8, OUTBOARD_PARITY_NONE, 1, OUTBOARD_FLOW_NONE };
    line_div = 0;
    int err = uart_program_line(&l);
    if (err) {
        set_ier(0);
        out(MCR, 0);
        return err;
    }
    info->max_baud = CLOCK_BAUD;
    info->fifo = FIFO;
    return 0;
}

/* Moves at most len received bytes to buf: the count. */
static inline long uart_take(unsigned char *buf, unsigned long len)
{
    long n = 0;
    while ((unsigned long)n < len && ring_len(&rx))
        buf[n++] = rx.b[rx.tail++ % RING];
    if (n)
        pace_receiver();
    return n;
}

/* Takes as many of len bytes as the ring has room for, to send: the count. */
static inline long uart_put(const unsigned char *buf, unsigned long len)
{
    long n = 0;
    while ((unsigned long)n < len && ring_room(&tx))
        tx.b[tx.head++ % RING] = buf[n++];
    start_sending();
    return n;
}

/* The settings on the line (an operation of both drivers' tables). */
static int uart_get_line(struct outboard_line *l)
{
    *l = line;
    return 0;
}

static inline void uart_fill_counters(struct outboard_char_counters *c)
{
    *c = count;
    c->modem = (uint8_t)(((msr & MSR_CTS) ? OUTBOARD_MODEM_CTS : 0) |
                         ((msr & MSR_DSR) ? OUTBOARD_MODEM_DSR : 0) |
                         ((msr & MSR_RI) ? OUTBOARD_MODEM_RI : 0) |
                         ((msr & MSR_DCD) ? OUTBOARD_MODEM_DCD : 0));
    /* Waiting on the far end: CTS off with bytes to send (the far end is backed up, whether
     * or not the driver itself applies flow control). */
    c->held = (uint8_t)(!(msr & MSR_CTS) && (ring_len(&tx) || in_fifo));
}

/* The functions both drivers take. */
static const struct outboard_pci_id uart_ids[] = {
    { UART_VENDOR, UART_DEVICE },
    { 0, 0 },
};

/* Built into Outboard, each driver's descriptor has a name of its own (the build defines
 * OUTBOARD_DRIVER_SYMBOL); built alone as a shared object it is `outboard_driver`. */
#ifndef OUTBOARD_DRIVER_SYMBOL
#define OUTBOARD_DRIVER_SYMBOL outboard_driver
#endif

/* Quiets the device: no interrupt, modem lines off. */
static inline void uart_quiet(void)
{
    set_ier(0);
    out(MCR, 0);
}

#endif
