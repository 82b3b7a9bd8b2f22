//! Each rule of the legacy model, checked so that breaking the rule fails a test. Every wait
//! has a time-out (a thread that might block is joined with one); the only signals sent are the model's own, to this process's threads.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use rustix::event::{eventfd, EventfdFlags};

use super::*;

const LONG: Duration = Duration::from_secs(5);

fn until(what: &str, mut ok: impl FnMut() -> bool) {
    let end = Instant::now() + LONG;
    while !ok() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Joins a test thread, failing (instead of hanging) if it does not finish in time.
fn join<T>(h: std::thread::JoinHandle<T>) -> T {
    until("a thread to finish", || h.is_finished());
    h.join().expect("the thread panicked")
}

/// Starts a thread that runs `before`, enters the driver, and then does process-level work that
/// never leaves it nor enables anything — only a delivered stop signal can run a handler now —
/// until `calls` moves or the time-out. Returns once the thread is inside; joining the handle
/// gives the calls seen while still inside and the thread's id.
fn spinner_inside(
    cpu: &Arc<Cpu>,
    calls: &Arc<AtomicU64>,
    before: impl FnOnce() + Send + 'static,
) -> std::thread::JoinHandle<(u64, u32)> {
    let go = Arc::new(Barrier::new(2));
    let (c, g, n) = (cpu.clone(), go.clone(), calls.clone());
    let worker = std::thread::spawn(move || {
        before();
        let inside = c.enter();
        g.wait();
        let end = Instant::now() + LONG;
        while n.load(SeqCst) == 0 && Instant::now() < end {
            std::hint::spin_loop();
        }
        let ran_inside = n.load(SeqCst);
        drop(inside);
        (ran_inside, my_tid())
    });
    go.wait();
    worker
}

/// A handler that records each call and the thread it ran on.
fn recorder() -> (Handler, Arc<AtomicU64>, Arc<AtomicU32>) {
    let calls = Arc::new(AtomicU64::new(0));
    let on = Arc::new(AtomicU32::new(0));
    let (c, o) = (calls.clone(), on.clone());
    let h: Handler = Arc::new(move || {
        o.store(my_tid(), SeqCst);
        c.fetch_add(1, SeqCst);
    });
    (h, calls, on)
}

#[test]
fn uncontested_the_raising_thread_runs_the_handler_under_the_process_lock() {
    let cpu = Cpu::new();
    let (h, calls, on) = recorder();
    let seen_locked = Arc::new(AtomicBool::new(false));
    let (c2, s2) = (cpu.clone(), seen_locked.clone());
    let check: Handler = Arc::new(move || s2.store(c2.is_inside(), SeqCst));
    {
        let inside = cpu.enter();
        inside.irq_alloc(3, h, true).unwrap();
        inside.irq_alloc(3, check, true).unwrap();
    }
    let c = cpu.clone();
    let raiser = join(std::thread::spawn(move || {
        c.raise(3);
        my_tid()
    }));
    assert_eq!(calls.load(SeqCst), 1);
    assert_eq!(on.load(SeqCst), raiser, "run by the raising thread");
    assert!(seen_locked.load(SeqCst), "the handler ran holding the lock");
    assert_eq!(cpu.stats().uncontested, 1);
}

#[test]
fn contested_the_thread_in_the_driver_is_stopped_and_runs_the_handler_at_once() {
    let cpu = Cpu::new();
    let (h, calls, on) = recorder();
    cpu.enter().irq_alloc(5, h, false).unwrap();
    let worker = spinner_inside(&cpu, &calls, || {});
    cpu.raise(5);
    let (ran_inside, inside_tid) = join(worker);
    assert_eq!(ran_inside, 1, "the handler ran while the thread was inside");
    assert_eq!(calls.load(SeqCst), 1);
    assert_eq!(on.load(SeqCst), inside_tid, "on the thread in the driver");
    assert_eq!(cpu.stats().contested, 1);
}

#[test]
fn disabled_interrupts_stay_pending_until_enabled_then_run_on_the_enabling_thread() {
    let cpu = Cpu::new();
    let (h, calls, on) = recorder();
    let inside = cpu.enter();
    inside.irq_alloc(7, h, false).unwrap();
    inside.intr_disable();
    assert!(!inside.intr_enabled());
    let c = cpu.clone();
    join(std::thread::spawn(move || c.raise(7)));
    // Give a stray delivery every chance to happen.
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(calls.load(SeqCst), 0, "held off while disabled");
    assert!(inside.irq_pending(7));
    inside.intr_enable();
    assert_eq!(calls.load(SeqCst), 1, "run by intr_enable");
    assert_eq!(on.load(SeqCst), my_tid());
    assert!(!inside.irq_pending(7));
}

#[test]
fn a_pending_interrupt_left_behind_by_a_leaving_thread_is_run_as_it_leaves() {
    let cpu = Cpu::new();
    let (h, calls, _) = recorder();
    let inside = cpu.enter();
    inside.irq_alloc(1, h, false).unwrap();
    inside.intr_disable();
    let c = cpu.clone();
    join(std::thread::spawn(move || c.raise(1)));
    assert_eq!(calls.load(SeqCst), 0);
    drop(inside);
    assert_eq!(calls.load(SeqCst), 1, "nobody else would have run it");
}

#[test]
fn irq_alloc_is_synchronous_an_autoprobe_right_after_it_is_not_missed() {
    // An autoprobe: register, make the device interrupt at once, look whether it did.
    let cpu = Cpu::new();
    let thread = InterruptThread::spawn(cpu.clone()).unwrap();
    let bell = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).unwrap();
    let device = rustix::io::dup(&bell).unwrap();
    thread.attach(bell, 9).unwrap();
    for round in 0..200 {
        let (h, calls, _) = recorder();
        let inside = cpu.enter();
        let id = inside.irq_alloc(9, h, false).unwrap();
        rustix::io::write(&device, &1u64.to_ne_bytes()).unwrap();
        let end = Instant::now() + LONG;
        while calls.load(SeqCst) == 0 {
            assert!(
                Instant::now() < end,
                "round {round}: the probe's interrupt was missed"
            );
            std::hint::spin_loop();
        }
        inside.irq_free(9, id);
    }
    assert_eq!(
        cpu.stats().spurious,
        0,
        "no interrupt found its handler missing"
    );
}

#[test]
fn irq_free_handles_a_pending_interrupt_before_it_returns_and_never_after() {
    let cpu = Cpu::new();
    let (h, calls, _) = recorder();
    let inside = cpu.enter();
    let id = inside.irq_alloc(4, h, false).unwrap();
    inside.intr_disable();
    let c = cpu.clone();
    join(std::thread::spawn(move || c.raise(4)));
    assert_eq!(calls.load(SeqCst), 0);
    inside.irq_free(4, id);
    assert_eq!(calls.load(SeqCst), 1, "handled before irq_free returned");
    inside.intr_enable();
    drop(inside);
    cpu.raise(4);
    assert_eq!(calls.load(SeqCst), 1, "never called after irq_free");
    assert_eq!(cpu.stats().spurious, 1);
}

#[test]
fn a_vector_is_shared_only_when_every_handler_asks_to_share_it() {
    let cpu = Cpu::new();
    let inside = cpu.enter();
    let (a, ca, _) = recorder();
    let (b, cb, _) = recorder();
    let (x, _, _) = recorder();
    inside.irq_alloc(2, a, true).unwrap();
    inside.irq_alloc(2, b, true).unwrap();
    assert_eq!(
        inside.irq_alloc(2, x.clone(), false),
        Err(IrqError::Busy(2))
    );
    inside.irq_alloc(6, x.clone(), false).unwrap();
    assert_eq!(inside.irq_alloc(6, x.clone(), true), Err(IrqError::Busy(6)));
    assert_eq!(
        inside.irq_alloc(64, x, true),
        Err(IrqError::NoSuchVector(64))
    );
    drop(inside);
    cpu.raise(2);
    assert_eq!(
        (ca.load(SeqCst), cb.load(SeqCst)),
        (1, 1),
        "both handlers of a shared line"
    );
}

#[test]
fn a_masked_vector_waits_for_irq_enable() {
    let cpu = Cpu::new();
    let (h, calls, _) = recorder();
    let inside = cpu.enter();
    inside.irq_alloc(8, h, false).unwrap();
    inside.irq_disable(8);
    drop(inside);
    cpu.raise(8);
    assert_eq!(calls.load(SeqCst), 0);
    let inside = cpu.enter();
    assert!(inside.irq_pending(8));
    inside.irq_enable(8);
    assert_eq!(calls.load(SeqCst), 1);
}

#[test]
fn sleep_lets_another_thread_in_and_a_wakeup_from_a_handler_brings_the_sleeper_back() {
    let cpu = Cpu::new();
    let rec = Arc::new(SleepRec::new());
    let r = rec.clone();
    let wake: Handler = Arc::new(move || r.wakeup());
    cpu.enter().irq_alloc(0, wake, false).unwrap();
    let asleep = Arc::new(AtomicBool::new(false));
    let (c, r, a) = (cpu.clone(), rec.clone(), asleep.clone());
    let sleeper = std::thread::spawn(move || {
        let inside = c.enter();
        r.init();
        a.store(true, SeqCst);
        inside.sleep(&r);
        assert!(
            inside.cpu().is_inside(),
            "back in the driver after the sleep"
        );
        assert!(inside.intr_enabled(), "its own interrupt flag back");
    });
    until("the sleeper to sleep", || asleep.load(SeqCst));
    // While it sleeps another thread can enter the driver (the process lock is free).
    let c = cpu.clone();
    join(std::thread::spawn(move || drop(c.enter())));
    cpu.raise(0);
    join(sleeper);
    // A wakeup that came first makes the next sleep return at once.
    let (c, r) = (cpu.clone(), rec.clone());
    join(std::thread::spawn(move || {
        let inside = c.enter();
        r.init();
        r.wakeup();
        inside.sleep(&r);
    }));
}

#[test]
fn without_interrupts_holds_them_off_and_takes_them_after() {
    let cpu = Cpu::new();
    let (h, calls, _) = recorder();
    let inside = cpu.enter();
    inside.irq_alloc(11, h, false).unwrap();
    let c = cpu.clone();
    inside.without_interrupts(|| {
        join(std::thread::spawn(move || c.raise(11)));
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(calls.load(SeqCst), 0, "held off inside");
    });
    assert_eq!(calls.load(SeqCst), 1, "taken once the flag came back");
}

/// The atomicity rule under stress: threads enter and leave the driver, sleep and wake, and
/// raise interrupts from outside while an interrupt thread delivers timer ticks. The handler
/// and process-level code each mark when they run; neither may ever see the other running,
/// two process-level threads are never in at once, both delivery paths run, and nothing raised
/// is left pending at the end.
#[test]
fn handlers_never_interleave_with_process_level_code_under_stress() {
    let cpu = Cpu::new();
    let process_level = Arc::new(AtomicUsize::new(0));
    let in_handler = Arc::new(AtomicBool::new(false));
    let violations = Arc::new(AtomicU64::new(0));
    let handled = Arc::new(AtomicU64::new(0));
    // Handler runs on a worker: a contested delivery (the thread in the driver stopped).
    let on_worker = Arc::new(AtomicU64::new(0));
    let workers_tids: Arc<Vec<AtomicU32>> = Arc::new((0..3).map(|_| AtomicU32::new(0)).collect());
    let rec = Arc::new(SleepRec::new());
    let (p, ih, v, hd, r, ow, wt) = (
        process_level.clone(),
        in_handler.clone(),
        violations.clone(),
        handled.clone(),
        rec.clone(),
        on_worker.clone(),
        workers_tids.clone(),
    );
    let handler: Handler = Arc::new(move || {
        // Process-level code is stopped (contested) or outside (uncontested): the count of
        // threads running process-level code in the driver cannot move while this runs.
        if ih.swap(true, SeqCst) {
            v.fetch_add(1, SeqCst);
        }
        let before = p.load(SeqCst);
        for _ in 0..200 {
            std::hint::spin_loop();
        }
        if p.load(SeqCst) != before {
            v.fetch_add(1, SeqCst);
        }
        hd.fetch_add(1, SeqCst);
        let me = my_tid();
        if wt.iter().any(|t| t.load(SeqCst) == me) {
            ow.fetch_add(1, SeqCst);
        }
        r.wakeup();
        ih.store(false, SeqCst);
    });
    cpu.enter().irq_alloc(12, handler.clone(), true).unwrap();
    cpu.enter().irq_alloc(13, handler, true).unwrap();
    let ticker = InterruptThread::spawn(cpu.clone()).unwrap();
    let tick = rustix::time::timerfd_create(
        rustix::time::TimerfdClockId::Monotonic,
        rustix::time::TimerfdFlags::CLOEXEC | rustix::time::TimerfdFlags::NONBLOCK,
    )
    .unwrap();
    let every = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 50_000,
    };
    rustix::time::timerfd_settime(
        &tick,
        rustix::time::TimerfdTimerFlags::empty(),
        &rustix::time::Itimerspec {
            it_interval: every,
            it_value: every,
        },
    )
    .unwrap();
    ticker.attach(tick, 13).unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..3 {
        let (c, p, ih, v, r, s, wt) = (
            cpu.clone(),
            process_level.clone(),
            in_handler.clone(),
            violations.clone(),
            rec.clone(),
            stop.clone(),
            workers_tids.clone(),
        );
        workers.push(std::thread::spawn(move || {
            wt[w].store(my_tid(), SeqCst);
            let mut rounds = 0u64;
            while !s.load(SeqCst) {
                let inside = c.enter();
                if p.fetch_add(1, SeqCst) != 0 {
                    v.fetch_add(1, SeqCst); // two process-level threads in at once
                }
                for i in 0..500 {
                    if ih.load(SeqCst) {
                        v.fetch_add(1, SeqCst); // a handler running beside process level
                    }
                    if i == 250 && w == 0 && rounds.is_multiple_of(4) {
                        inside.intr_disable();
                    }
                    if i == 400 && !inside.intr_enabled() {
                        inside.intr_enable();
                    }
                }
                p.fetch_sub(1, SeqCst);
                if w == 1 && rounds.is_multiple_of(8) {
                    // Sleep until a handler's wakeup; the lock goes to others meanwhile.
                    r.init();
                    inside.sleep(&r);
                }
                drop(inside);
                rounds += 1;
            }
            rounds
        }));
    }
    let (c, s) = (cpu.clone(), stop.clone());
    let raiser = std::thread::spawn(move || {
        while !s.load(SeqCst) {
            c.raise(12);
            std::thread::yield_now();
        }
    });
    std::thread::sleep(Duration::from_millis(600));
    stop.store(true, SeqCst);
    join(raiser);
    // The sleeper may be waiting for one more wakeup: ticks keep coming until it is out.
    let rounds: Vec<u64> = workers.into_iter().map(join).collect();
    drop(ticker);
    let st = cpu.stats();
    assert_eq!(violations.load(SeqCst), 0, "atomicity broken: {st:?}");
    assert!(
        rounds.iter().all(|&r| r > 0),
        "every worker got in: {rounds:?}"
    );
    assert!(
        on_worker.load(SeqCst) > 0 && st.uncontested > 0,
        "both paths ran: {} handler runs on a thread in the driver, {st:?}",
        on_worker.load(SeqCst)
    );
    assert!(handled.load(SeqCst) > 0);
    assert_eq!(
        cpu.pending.load(SeqCst),
        0,
        "nothing raised was left pending: {st:?}"
    );
}

#[test]
fn a_thread_is_in_one_driver_at_a_time() {
    let (a, b) = (Cpu::new(), Cpu::new());
    let refused = join(std::thread::spawn(move || {
        let _in_a = a.enter();
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(b.enter()))).is_err()
    }));
    assert!(
        refused,
        "entering a second driver from inside one is refused"
    );
}

#[test]
fn a_thread_that_blocked_the_stop_signal_still_takes_contested_interrupts() {
    let cpu = Cpu::new();
    let (h, calls, _) = recorder();
    cpu.enter().irq_alloc(10, h, false).unwrap();
    // A daemon's worker thread often blocks every signal.
    let worker = spinner_inside(&cpu, &calls, || {
        // SAFETY: a zeroed then filled set, changing only this thread's mask.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_BLOCK, &all, std::ptr::null_mut());
        }
    });
    cpu.raise(10);
    assert_eq!(join(worker).0, 1);
}

#[test]
fn a_handler_cannot_change_handlers_sleep_or_enable_interrupts() {
    // Each would change what the interrupted code relies on; changing the handler table from
    // a handler would also deadlock on it. Refused, not hung (the raise is joined with a
    // time-out).
    let cpu = Cpu::new();
    let refused = Arc::new(AtomicBool::new(false));
    let (c, r) = (cpu.clone(), refused.clone());
    let h: Handler = Arc::new(move || {
        let alloc = c.irq_alloc(20, Arc::new(|| {}), false);
        c.irq_free(1, 1);
        c.sleep(&SleepRec::new());
        c.intr_enable();
        r.store(
            alloc == Err(IrqError::InHandler) && !c.intr_enabled() && c.in_handler(),
            SeqCst,
        );
    });
    cpu.enter().irq_alloc(1, h, false).unwrap();
    let c = cpu.clone();
    join(std::thread::spawn(move || c.raise(1)));
    assert!(refused.load(SeqCst));
    assert!(!cpu.in_handler());
    let c = cpu.clone();
    join(std::thread::spawn(move || c.raise(1)));
    assert_eq!(cpu.stats().handled, 2, "the handler stayed registered");
}

#[test]
fn a_vectors_end_of_interrupt_runs_after_its_handlers_and_only_for_it() {
    let cpu = Cpu::new();
    let (h, calls, _) = recorder();
    let seen = Arc::new(AtomicU64::new(u64::MAX));
    let (c2, s2) = (calls.clone(), seen.clone());
    assert!(cpu.set_end_of_interrupt(vec![(
        4,
        Box::new(move || s2.store(c2.load(SeqCst), SeqCst))
    )]));
    assert!(
        !cpu.set_end_of_interrupt(Vec::new()),
        "the ends were set twice"
    );
    cpu.enter().irq_alloc(4, h.clone(), false).unwrap();
    cpu.enter().irq_alloc(5, h, false).unwrap();
    cpu.raise(5);
    assert_eq!(seen.load(SeqCst), u64::MAX, "vector 5 has no end");
    cpu.raise(4);
    assert_eq!(seen.load(SeqCst), 2, "the end ran before the handler");
}

#[test]
fn a_thread_waiting_to_enter_is_not_starved_by_an_interrupt_storm() {
    // A level-triggered device whose interrupt is pending again as soon as its handler ends
    // (a UART whose transmitter empties at once, behind slow register accesses).
    // A CPU still runs the interrupted process between interrupts; so here a thread waiting to
    // enter the driver gets in after at most the handler running as it began to wait, and
    // takes the pending interrupt itself at its entry.
    let cpu = Cpu::new();
    let storm_tid = Arc::new(AtomicU32::new(0));
    let on_storm = Arc::new(AtomicU64::new(0));
    let finished = Arc::new(AtomicU64::new(0));
    let (t, s, f) = (storm_tid.clone(), on_storm.clone(), finished.clone());
    let slow: Handler = Arc::new(move || {
        if my_tid() == t.load(SeqCst) {
            s.fetch_add(1, SeqCst);
        }
        let end = Instant::now() + Duration::from_millis(2);
        while Instant::now() < end {
            std::hint::spin_loop();
        }
        f.fetch_add(1, SeqCst);
    });
    cpu.enter().irq_alloc(1, slow, false).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (c, st, t, f, s) = (
        cpu.clone(),
        stop.clone(),
        storm_tid.clone(),
        finished.clone(),
        on_storm.clone(),
    );
    // The interrupt thread: a handler it ran itself ends with the line unmasked, and the line,
    // still asserted, is back at its next poll at once; one run by a thread in the driver ends
    // with the same, and the interrupt thread hears of it a little later.
    let storm = std::thread::spawn(move || {
        t.store(my_tid(), SeqCst);
        let end = Instant::now() + 2 * LONG;
        while !st.load(SeqCst) && Instant::now() < end {
            let (done, mine) = (f.load(SeqCst), s.load(SeqCst));
            c.raise(1);
            if s.load(SeqCst) > mine {
                continue;
            }
            while f.load(SeqCst) == done && !st.load(SeqCst) && Instant::now() < end {
                std::hint::spin_loop();
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    });
    until("the storm to run handlers", || on_storm.load(SeqCst) > 3);
    let mut worst = 0;
    for _ in 0..20 {
        let before = on_storm.load(SeqCst);
        let inside = cpu.enter();
        worst = worst.max(on_storm.load(SeqCst) - before);
        drop(inside);
        std::thread::sleep(Duration::from_millis(1));
    }
    stop.store(true, SeqCst);
    join(storm);
    assert!(
        worst <= 2,
        "a thread waiting to enter saw {worst} handlers run on the interrupt thread first"
    );
}

#[test]
fn threads_get_in_in_the_order_they_came() {
    // A thread that leaves and enters again at once (a reader with bytes to take) does not go
    // in ahead of one that was already waiting (the server's loop).
    let cpu = Cpu::new();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let inside = cpu.enter();
    let (c, o) = (cpu.clone(), order.clone());
    let waiter = std::thread::spawn(move || {
        let _in = c.enter();
        o.lock().unwrap().push("waiter");
    });
    until("the waiter to wait", || cpu.waiters.load(SeqCst) == 1);
    drop(inside);
    {
        let _again = cpu.enter();
        order.lock().unwrap().push("again");
    }
    join(waiter);
    assert_eq!(*order.lock().unwrap(), ["waiter", "again"]);
}

#[test]
fn a_thread_that_enters_masked_runs_before_interrupts_which_run_as_it_leaves() {
    let cpu = Cpu::new();
    let (h, calls, on) = recorder();
    cpu.enter().irq_alloc(2, h, false).unwrap();
    let inside = cpu.enter_masked();
    assert!(!inside.intr_enabled());
    let c = cpu.clone();
    join(std::thread::spawn(move || c.raise(2)));
    assert_eq!(calls.load(SeqCst), 0, "a handler ran inside a masked entry");
    drop(inside);
    assert_eq!(
        calls.load(SeqCst),
        1,
        "the interrupt did not run as the thread left"
    );
    assert_eq!(on.load(SeqCst), my_tid(), "run by the leaving thread");
}
