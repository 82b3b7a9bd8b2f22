//! The legacy execution model (the Fluke thesis's `osenv`): drivers written for a uniprocessor
//! kernel run unmodified in a user process.
//!
//! Such a driver assumes what a uniprocessor kernel gives it:
//!
//! - **one process-level thread in the driver at a time** ([`Cpu::enter`] takes the process
//!   lock; many threads may call into the driver, one runs in it);
//! - **interrupts atomic with respect to process level**: an interrupt handler never runs
//!   beside process-level code of the same driver, only instead of it;
//! - **`intr_disable`/`intr_enable`** hold interrupts off and let them in again, as `cli`/`sti`;
//! - **`sleep`/`wakeup`**: a process-level thread that waits gives the driver up to another
//!   ([`Cpu::sleep`] releases the process lock) and takes it back when woken;
//! - **synchronous `irq_alloc`/`irq_free`**: a handler is registered before `irq_alloc` returns,
//!   and an interrupt pending at `irq_free` is handled before it returns.
//!
//! Interrupts are delivered like a CPU's ([`Cpu::raise`], called by the interrupt thread
//! ([`delivery`]) when a device's eventfd or a timer fires):
//!
//! - **uncontested**: no thread is in the driver; the interrupt thread takes the process lock
//!   and runs the handler itself — unless a thread is waiting to enter, which then takes the
//!   interrupt at its entry (so a storm of interrupts never keeps process level out);
//! - **contested**: a thread is in the driver; it is stopped with a signal and runs the handler
//!   at once on its own stack (a CPU taking an interrupt), unless it has interrupts disabled,
//!   when the interrupt stays pending until it enables them (or leaves the driver).
//!
//! Handlers run with interrupts disabled. Anything an `osenv` call does that could be
//! re-entered by a handler (allocation, logging, a message to a vfio-user device model) runs
//! with interrupts held off ([`Cpu::without_interrupts`]), as the thesis requires of
//! allocations: a handler interrupting the thread inside the allocator would otherwise corrupt
//! it.
//!
//! Every rule has a test that fails when the rule is broken (`tests.rs`).

mod delivery;
mod signal;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

pub use delivery::{InterruptThread, SourceKey, Sources};
pub use signal::STOP_SIGNAL;

/// The number of interrupt vectors of one legacy driver (device vectors and timers together).
pub const VECTORS: u32 = 64;

/// An interrupt handler: what `osenv_irq_alloc` registers (a C function and its argument, or a
/// closure in Rust tests). It runs with interrupts disabled, on whichever thread delivers the
/// interrupt, and must not block.
pub type Handler = Arc<dyn Fn() + Send + Sync>;

/// A handler registered on a vector, and who registered it (so `irq_free` removes that one).
struct Registered {
    vector: u32,
    id: u64,
    handler: Handler,
    shareable: bool,
}

/// Why a vector could not be allocated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IrqError {
    /// The vector is not one this driver has.
    #[error("interrupt vector {0} does not exist (a driver has vectors 0 to 63)")]
    NoSuchVector(u32),
    /// Someone holds the vector and one of the two did not ask to share it.
    #[error("interrupt vector {0} is in use and not shareable")]
    Busy(u32),
    /// Asked from inside an interrupt handler, which must not change the handlers.
    #[error("interrupt handlers cannot be changed from inside a handler")]
    InHandler,
}

/// Counts of how interrupts were delivered (for tests and the clock benchmark).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DeliveryStats {
    /// Interrupts the interrupt thread handled itself (no thread was in the driver).
    pub uncontested: u64,
    /// Interrupts a thread in the driver was stopped for.
    pub contested: u64,
    /// Interrupts left for a thread waiting to enter, which took them at its entry.
    pub left_for_entry: u64,
    /// Interrupts that found interrupts disabled and waited for them to be enabled.
    pub deferred: u64,
    /// Interrupts raised on a vector with no handler (dropped, as a CPU drops a spurious one).
    pub spurious: u64,
    /// Handler calls.
    pub handled: u64,
}

/// The virtual CPU of one legacy driver: its process lock, its interrupt flag, its pending
/// vectors and its handlers.
pub struct Cpu {
    /// The thread id holding the process lock (0: none).
    holder: AtomicU32,
    /// The process lock is a ticket lock: each thread that enters takes the next ticket and
    /// gets in when `serving` reaches it, so threads get in in the order they came. A lock
    /// anyone may grab as it comes free lets a thread that leaves and enters again in a loop
    /// (a reader with bytes to take) keep another (the server's loop) out for seconds.
    tickets: AtomicU32,
    /// The ticket that holds the lock, or may take it now. Also the futex word waiters sleep on.
    serving: AtomicU32,
    /// Threads waiting for the process lock (a release wakes them only if there are any).
    waiters: AtomicU32,
    /// The holder's interrupt flag: false while a handler runs or the driver disabled them.
    enabled: AtomicBool,
    /// Vectors raised and not yet handled.
    pending: AtomicU64,
    /// Vectors held off one by one (`osenv_irq_disable`).
    masked: AtomicU64,
    /// A stop signal is on its way to the holder: at most one is queued at a time (real-time
    /// signals do not merge, and a holder with interrupts off would otherwise collect one per
    /// raise). Cleared by whoever then reads the pending bits: the signal's handler, an entry,
    /// a leave.
    kicked: AtomicBool,
    /// The holder runs handlers, not process-level code (an uncontested delivery): it takes
    /// what is raised meanwhile as it leaves, and is not signalled.
    at_interrupt_level: AtomicBool,
    /// A handler is running (on whichever thread): the calls a handler must not make
    /// (allocating or freeing vectors, sleeping, enabling interrupts) are refused.
    in_handler: AtomicBool,
    /// Handlers; changed only by the process-lock holder with interrupts disabled, read only
    /// by the holder (a handler runs on the holder's thread, or on the interrupt thread holding
    /// the lock), so the lock is never contended and never taken by an interrupted owner.
    handlers: Mutex<Vec<Registered>>,
    next_id: AtomicU64,
    stats: Stats,
    /// What the layer above keeps per driver (the `osenv` calls' timers, memory, device).
    context: std::sync::OnceLock<Box<dyn std::any::Any + Send + Sync>>,
    /// Per vector, what ends its delivery after its handlers ran (a level-triggered line's
    /// unmask, as a CPU's end-of-interrupt to its interrupt controller).
    end_of_interrupt: std::sync::OnceLock<Vec<(u32, EndOfInterrupt)>>,
}

/// What ends a vector's delivery: see [`Cpu::set_end_of_interrupt`].
pub type EndOfInterrupt = Box<dyn Fn() + Send + Sync>;

#[derive(Default)]
struct Stats {
    uncontested: AtomicU64,
    contested: AtomicU64,
    left_for_entry: AtomicU64,
    deferred: AtomicU64,
    spurious: AtomicU64,
    handled: AtomicU64,
}

impl std::fmt::Debug for Cpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cpu")
            .field("holder", &self.holder.load(SeqCst))
            .field("enabled", &self.enabled.load(SeqCst))
            .field("pending", &self.pending.load(SeqCst))
            .finish()
    }
}

thread_local! {
    /// The calling thread's id, asked of the kernel once (0: not yet).
    static TID: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

fn my_tid() -> u32 {
    TID.with(|t| {
        if t.get() == 0 {
            t.set(rustix::thread::gettid().as_raw_nonzero().get() as u32);
        }
        t.get()
    })
}

/// Runs `f` on the legacy driver the calling thread is in — at process level, or in a handler
/// on whichever thread runs it — or returns `None` if it is in none. This is how the `osenv`
/// C calls, which take no driver argument, find theirs.
pub fn with_current<R>(f: impl FnOnce(&Cpu) -> R) -> Option<R> {
    signal::current().filter(|c| c.is_inside()).map(f)
}

fn bit(vector: u32) -> u64 {
    1u64 << vector
}

/// A sleep record (`osenv_sleeprec_t`, two words): the first is the futex word a sleeper
/// waits on, set by the wakeup; the second is unused, kept for the C layout.
#[derive(Debug, Default)]
#[repr(C)]
pub struct SleepRec {
    woken: AtomicU32,
    _reserved: AtomicU32,
}

impl SleepRec {
    /// A record no wakeup has reached yet (`osenv_sleep_init`).
    pub const fn new() -> Self {
        Self {
            woken: AtomicU32::new(0),
            _reserved: AtomicU32::new(0),
        }
    }

    /// Makes the record ready to sleep on again.
    pub fn init(&self) {
        self.woken.store(0, SeqCst);
    }

    /// Wakes the thread sleeping on the record, or lets its next sleep return at once
    /// (`osenv_wakeup`). Safe in an interrupt handler: one store and one system call.
    pub fn wakeup(&self) {
        self.woken.store(1, SeqCst);
        // Every thread asleep on it (the kernel takes the count as an int: u32::MAX is -1,
        // which wakes one).
        let _ = rustix::thread::futex::wake(
            &self.woken,
            rustix::thread::futex::Flags::PRIVATE,
            i32::MAX as u32,
        );
    }

    /// Whether a wakeup reached it since [`SleepRec::init`].
    pub fn woken(&self) -> bool {
        self.woken.load(SeqCst) != 0
    }
}

impl Cpu {
    /// A CPU with nobody in the driver and no handler (a thread that enters finds interrupts
    /// enabled). Installs the stop signal's handler for the process (once).
    pub fn new() -> Arc<Self> {
        signal::install();
        Arc::new(Self {
            holder: AtomicU32::new(0),
            tickets: AtomicU32::new(0),
            serving: AtomicU32::new(0),
            waiters: AtomicU32::new(0),
            enabled: AtomicBool::new(false),
            pending: AtomicU64::new(0),
            masked: AtomicU64::new(0),
            kicked: AtomicBool::new(false),
            at_interrupt_level: AtomicBool::new(false),
            in_handler: AtomicBool::new(false),
            handlers: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            stats: Stats::default(),
            context: std::sync::OnceLock::new(),
            end_of_interrupt: std::sync::OnceLock::new(),
        })
    }

    /// Gives the CPU the layer above's per-driver state, once; false if it had one.
    pub fn set_context(&self, context: Box<dyn std::any::Any + Send + Sync>) -> bool {
        self.context.set(context).is_ok()
    }

    /// Sets, once, what ends each listed vector's delivery: called after the vector's handlers
    /// ran, still at interrupt level (a level-triggered line is unmasked there, so that one
    /// still asserted interrupts again). False if they were set before.
    pub fn set_end_of_interrupt(&self, ends: Vec<(u32, EndOfInterrupt)>) -> bool {
        self.end_of_interrupt.set(ends).is_ok()
    }

    /// The layer above's per-driver state, if it is a `T`.
    pub fn context<T: 'static>(&self) -> Option<&T> {
        self.context.get().and_then(|c| c.downcast_ref())
    }

    /// How interrupts were delivered so far.
    pub fn stats(&self) -> DeliveryStats {
        DeliveryStats {
            uncontested: self.stats.uncontested.load(SeqCst),
            contested: self.stats.contested.load(SeqCst),
            left_for_entry: self.stats.left_for_entry.load(SeqCst),
            deferred: self.stats.deferred.load(SeqCst),
            spurious: self.stats.spurious.load(SeqCst),
            handled: self.stats.handled.load(SeqCst),
        }
    }

    /// Enters the driver at process level: waits for the process lock, then runs with
    /// interrupts enabled (taking any that are pending first). The guard leaves on drop.
    pub fn enter(self: &Arc<Self>) -> Inside {
        let inside = self.enter_masked();
        self.enabled.store(true, SeqCst);
        self.take_pending();
        inside
    }

    /// Enters the driver at process level with interrupts held off, as a kernel's upper half
    /// calls a driver at a raised priority (`spltty`): the call runs before any interrupt,
    /// and those raised meanwhile run when the driver enables interrupts or as the thread
    /// leaves. A device that always has work (a virtual UART moves bytes at once) interrupts
    /// again as soon as a handler ends; entered with interrupts on, a thread would spend its
    /// stay in handlers and its own call would hardly move.
    pub fn enter_masked(self: &Arc<Self>) -> Inside {
        let tid = my_tid();
        assert_ne!(
            self.holder.load(SeqCst),
            tid,
            "a thread entered a legacy driver it is already in"
        );
        assert!(
            signal::current().is_none(),
            "a thread is in one legacy driver at a time"
        );
        signal::unblock();
        signal::set_current(Arc::as_ptr(self));
        self.lock(tid);
        self.kicked.store(false, SeqCst);
        Inside {
            cpu: self.clone(),
            tid,
            _not_send: std::marker::PhantomData,
        }
    }

    /// Whether the calling thread is in the driver (holds the process lock).
    pub fn is_inside(&self) -> bool {
        self.holder.load(SeqCst) == my_tid()
    }

    /// Waits for the process lock, in turn.
    fn lock(&self, tid: u32) {
        // Counted as waiting before it holds a ticket: an interrupt raised meanwhile is left
        // for it rather than spun on (a ticket taken makes the raiser's `try_lock` fail).
        self.waiters.fetch_add(1, SeqCst);
        let mine = self.tickets.fetch_add(1, SeqCst);
        loop {
            let now = self.serving.load(SeqCst);
            if now == mine {
                break;
            }
            // Returns at once if the ticket served changed meanwhile (EAGAIN), or on a
            // signal (EINTR): either way, look again.
            let _ = rustix::thread::futex::wait(
                &self.serving,
                rustix::thread::futex::Flags::PRIVATE,
                now,
                None,
            );
        }
        // In before it stops counting as waiting: an interrupt raised meanwhile finds a
        // waiter, and is left for it.
        self.holder.store(tid, SeqCst);
        self.waiters.fetch_sub(1, SeqCst);
    }

    /// Takes the process lock if nobody holds it and nobody waits for it.
    fn try_lock(&self, tid: u32) -> bool {
        let now = self.serving.load(SeqCst);
        if self
            .tickets
            .compare_exchange(now, now.wrapping_add(1), SeqCst, SeqCst)
            .is_err()
        {
            return false;
        }
        self.holder.store(tid, SeqCst);
        true
    }

    /// Lets the next ticket in.
    fn release(&self) {
        self.holder.store(0, SeqCst);
        self.serving.fetch_add(1, SeqCst);
        if self.waiters.load(SeqCst) > 0 {
            // Every waiter looks; the one whose ticket is served goes in. (The kernel takes
            // the count as an int: u32::MAX would be -1, and wake one.)
            let _ = rustix::thread::futex::wake(
                &self.serving,
                rustix::thread::futex::Flags::PRIVATE,
                i32::MAX as u32,
            );
        }
    }

    /// Releases the process lock. An interrupt raised while the holder had interrupts disabled
    /// (or while it was leaving) has no one else to run it: the leaver takes the lock back and
    /// runs it, unless another thread has entered meanwhile (that one takes it at its entry).
    fn unlock(&self, tid: u32) {
        self.enabled.store(false, SeqCst);
        loop {
            self.release();
            self.kicked.store(false, SeqCst);
            // A thread waiting to enter takes what is pending at its entry: taking the lock
            // back here for every interrupt of a storm would keep it out for good.
            if self.deliverable() == 0 || self.waiters.load(SeqCst) > 0 {
                return;
            }
            if !self.try_lock(tid) {
                return;
            }
            self.at_interrupt_level.store(true, SeqCst);
            self.run_pending();
            self.at_interrupt_level.store(false, SeqCst);
        }
    }

    /// Vectors pending and not masked.
    fn deliverable(&self) -> u64 {
        self.pending.load(SeqCst) & !self.masked.load(SeqCst)
    }

    /// Runs every deliverable pending vector's handlers, with interrupts disabled. The caller
    /// holds the process lock and has interrupts disabled.
    fn run_pending(&self) {
        loop {
            let mask = !self.masked.load(SeqCst);
            let taken = self.pending.fetch_and(!mask, SeqCst) & mask;
            if taken == 0 {
                return;
            }
            let outer = self.in_handler.swap(true, SeqCst);
            for v in 0..VECTORS {
                if taken & bit(v) != 0 {
                    self.call_handlers(v);
                }
            }
            self.in_handler.store(outer, SeqCst);
        }
    }

    /// Whether an interrupt handler of this driver is running.
    pub fn in_handler(&self) -> bool {
        self.in_handler.load(SeqCst)
    }

    fn call_handlers(&self, vector: u32) {
        // Never contended (see `handlers`); a poisoned list still holds the handlers.
        let list = match self.handlers.try_lock() {
            Ok(l) => l,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                // Cannot happen while the rules hold; keep the interrupt rather than lose it.
                self.pending.fetch_or(bit(vector), SeqCst);
                return;
            }
        };
        let mut any = false;
        for r in list.iter().filter(|r| r.vector == vector) {
            any = true;
            self.stats.handled.fetch_add(1, SeqCst);
            // A handler that panics has left the driver in a state nobody can vouch for, and
            // unwinding would leave the process lock held: the server ends, like a crash, and
            // is restarted.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (r.handler)())).is_err() {
                std::process::abort();
            }
        }
        if !any {
            self.stats.spurious.fetch_add(1, SeqCst);
        }
        if let Some(ends) = self.end_of_interrupt.get() {
            for (_, end) in ends.iter().filter(|(v, _)| *v == vector) {
                end();
            }
        }
    }

    /// With interrupts enabled, runs what is pending: the point at which a CPU takes an
    /// interrupt. Loops so that one raised while the handlers ran is not left behind.
    fn take_pending(&self) {
        while self.enabled.load(SeqCst) && self.deliverable() != 0 {
            self.enabled.store(false, SeqCst);
            self.run_pending();
            self.enabled.store(true, SeqCst);
        }
    }

    /// Raises `vector` (the interrupt thread, when a device's eventfd or a timer fired; tests).
    /// Uncontested, the caller runs the handlers itself under the process lock; contested, the
    /// thread in the driver is signalled and runs them, or keeps them pending while it has
    /// interrupts disabled.
    pub fn raise(&self, vector: u32) {
        if vector >= VECTORS {
            return;
        }
        self.pending.fetch_or(bit(vector), SeqCst);
        let tid = my_tid();
        loop {
            if self.masked.load(SeqCst) & bit(vector) != 0 {
                self.stats.deferred.fetch_add(1, SeqCst);
                return;
            }
            let held = self.holder.load(SeqCst);
            if held == tid {
                // Raised from inside the driver (a test, or a handler raising another vector):
                // taken now if interrupts are enabled, else when they are.
                self.take_pending();
                return;
            }
            if held == 0 && self.waiters.load(SeqCst) > 0 {
                // A thread is about to enter: it takes the interrupt at its entry, as a CPU
                // takes one before the interrupted process's next instruction. Taking the lock
                // first instead would let a storm keep process level out for good.
                self.stats.left_for_entry.fetch_add(1, SeqCst);
                return;
            }
            if held == 0 {
                if !self.try_lock(tid) {
                    continue;
                }
                self.stats.uncontested.fetch_add(1, SeqCst);
                // The handlers' osenv calls find this driver as the thread's own.
                let before = signal::swap_current(self);
                self.at_interrupt_level.store(true, SeqCst);
                self.run_pending();
                self.at_interrupt_level.store(false, SeqCst);
                self.unlock(tid);
                signal::swap_current(before);
                return;
            }
            if self.at_interrupt_level.load(SeqCst) {
                // The holder runs handlers: it takes this one as it leaves.
                return;
            }
            if self.kicked.swap(true, SeqCst) {
                // A signal is on its way; its handler reads the pending bits after it arrives.
                return;
            }
            self.stats.contested.fetch_add(1, SeqCst);
            match signal::stop(held) {
                Ok(()) => return,
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                    // The signal queue is full (a limit shared by the user's processes): try
                    // again shortly.
                    self.kicked.store(false, SeqCst);
                    std::thread::yield_now();
                }
                // The holder's thread is gone: the lock's next holder takes the interrupt at
                // entry, or the leaver does; look again.
                Err(_) => self.kicked.store(false, SeqCst),
            }
        }
    }

    /// Called by the stop signal's handler on the thread it interrupted.
    fn interrupted(&self) {
        self.kicked.store(false, SeqCst);
        if self.holder.load(SeqCst) != my_tid() {
            // It left the driver before the signal arrived: the lock's next holder or the
            // leaver runs the interrupt.
            return;
        }
        if !self.enabled.load(SeqCst) {
            self.stats.deferred.fetch_add(1, SeqCst);
            return;
        }
        self.take_pending();
    }
}

/// A thread in the driver at process level ([`Cpu::enter`]). What `osenv` lets such a
/// thread do is here; dropping it leaves the driver.
pub struct Inside {
    cpu: Arc<Cpu>,
    tid: u32,
    /// The process lock and the signal's target are the entering thread: a guard moved to
    /// another thread would leave for the wrong one.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl std::fmt::Debug for Inside {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inside").field("tid", &self.tid).finish()
    }
}

impl Inside {
    /// The CPU this thread is in.
    pub fn cpu(&self) -> &Arc<Cpu> {
        &self.cpu
    }
}

impl std::ops::Deref for Inside {
    type Target = Cpu;
    fn deref(&self) -> &Cpu {
        &self.cpu
    }
}

/// What a thread in the driver may do (through [`Inside`], or [`with_current`] for the C
/// calls). Called by a thread that is not in the driver, they act on nothing reliable: the
/// `osenv` layer checks first.
impl Cpu {
    /// `osenv_intr_disable`: holds every interrupt off until [`Cpu::intr_enable`].
    pub fn intr_disable(&self) {
        self.enabled.store(false, SeqCst);
    }

    /// `osenv_intr_enable`: lets interrupts in again, running those that waited first.
    pub fn intr_enable(&self) {
        if self.in_handler() {
            // A handler runs with interrupts off until it returns; enabling them would let
            // the next one nest inside it.
            return;
        }
        self.enabled.store(true, SeqCst);
        self.take_pending();
    }

    /// `osenv_intr_enabled`.
    pub fn intr_enabled(&self) -> bool {
        self.enabled.load(SeqCst)
    }

    /// Runs `f` with interrupts held off, restoring the flag after (and taking what waited, if
    /// it was enabled): for anything a handler could re-enter.
    pub fn without_interrupts<R>(&self, f: impl FnOnce() -> R) -> R {
        let was = self.enabled.swap(false, SeqCst);
        let r = f();
        if was {
            self.intr_enable();
        }
        r
    }

    /// `osenv_sleep`: returns at once if a wakeup reached `rec` since its `init`; otherwise
    /// leaves the driver (another thread may enter), waits for the wakeup and enters again.
    /// The interrupt flag is the thread's own across the sleep.
    pub fn sleep(&self, rec: &SleepRec) {
        if self.in_handler() {
            // A handler must not sleep: it would give the driver away in the middle of the
            // process-level code it interrupted. The call returns at once.
            return;
        }
        let was = self.enabled.load(SeqCst);
        while !rec.woken() {
            self.unlock(my_tid());
            // Returns at once if the wakeup came in between (the word is no longer 0).
            let _ = rustix::thread::futex::wait(
                &rec.woken,
                rustix::thread::futex::Flags::PRIVATE,
                0,
                None,
            );
            self.lock(my_tid());
            // Back in: interrupts raised while it was out run now if it runs with them on.
            self.enabled.store(was, SeqCst);
            self.take_pending();
        }
    }

    /// `osenv_irq_alloc`: registers `handler` on `vector` before returning, so an interrupt
    /// the driver provokes right after (an autoprobe) reaches it. A vector is shared only if
    /// every handler on it asked to share. Returns an id for [`Cpu::irq_free`].
    pub fn irq_alloc(
        &self,
        vector: u32,
        handler: Handler,
        shareable: bool,
    ) -> Result<u64, IrqError> {
        if vector >= VECTORS {
            return Err(IrqError::NoSuchVector(vector));
        }
        if self.in_handler() {
            return Err(IrqError::InHandler);
        }
        self.without_interrupts(|| {
            let mut list = self.handlers.lock().unwrap_or_else(|p| p.into_inner());
            let mut others = list.iter().filter(|r| r.vector == vector).peekable();
            let free = others.peek().is_none();
            let shared_by_all = shareable && others.all(|r| r.shareable);
            if !(free || shared_by_all) {
                return Err(IrqError::Busy(vector));
            }
            let id = self.next_id.fetch_add(1, SeqCst);
            list.push(Registered {
                vector,
                id,
                handler,
                shareable,
            });
            Ok(id)
        })
    }

    /// `osenv_irq_free`: an interrupt pending on the vector is handled (by this handler too)
    /// before the handler goes; after it returns the handler is never called again.
    pub fn irq_free(&self, vector: u32, id: u64) {
        if vector >= VECTORS || self.in_handler() {
            return;
        }
        let was = self.enabled.swap(false, SeqCst);
        // A masked vector's interrupt waits at the controller, pending for the handlers that
        // stay (it is spurious if none does).
        if self.masked.load(SeqCst) & bit(vector) == 0
            && self.pending.fetch_and(!bit(vector), SeqCst) & bit(vector) != 0
        {
            let outer = self.in_handler.swap(true, SeqCst);
            self.call_handlers(vector);
            self.in_handler.store(outer, SeqCst);
        }
        self.handlers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|r| !(r.vector == vector && r.id == id));
        if was {
            self.intr_enable();
        }
    }

    /// `osenv_irq_disable`: holds one vector off (at the interrupt controller).
    pub fn irq_disable(&self, vector: u32) {
        if vector < VECTORS {
            self.masked.fetch_or(bit(vector), SeqCst);
        }
    }

    /// `osenv_irq_enable`: lets one vector in again; one that waited runs when interrupts are
    /// enabled.
    pub fn irq_enable(&self, vector: u32) {
        if vector < VECTORS {
            self.masked.fetch_and(!bit(vector), SeqCst);
            self.take_pending();
        }
    }

    /// `osenv_irq_pending`: whether the vector was raised and not yet handled.
    pub fn irq_pending(&self, vector: u32) -> bool {
        vector < VECTORS && self.pending.load(SeqCst) & bit(vector) != 0
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        self.cpu.unlock(self.tid);
        signal::set_current(std::ptr::null());
    }
}
