//! The restart policy: when a process that died is started again, and when the manager stops
//! trying — weighed by progress (a driver that serves between crashes is a working driver)
//! and by who ended it.

use std::time::{Duration, Instant};

/// When a crashed process is started again, and when the manager stops trying.
///
/// Progress decides: an incarnation that served (a driver server whose heartbeat moved after
/// it said it serves; a model or an export that came into service) is a working driver,
/// however often it dies, and is started again at once. Only deaths without progress count
/// against `limit`, and only those the process brought on itself (a crash, an exit, a hang):
/// a kill from outside before it came up says nothing about the driver, though it is slowed
/// down like the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartPolicy {
    /// Most deaths without progress in a row (within `window` of each other); one more and
    /// the process is given up, if they also span `span`. 0: never restart at all.
    pub limit: u32,
    /// A crash loop must last at least this long to be given up: a burst of deaths (signals
    /// from outside that look like crashes, a storm that hits each new incarnation before
    /// it comes up) passes, a driver that cannot start keeps failing past it.
    pub span: Duration,
    /// Deaths without progress older than this are forgotten.
    pub window: Duration,
    /// Delay before the second restart in a row without progress (the first is at once);
    /// doubling after that.
    pub backoff: Duration,
    /// Longest delay.
    pub max_backoff: Duration,
    /// A driver server whose loop has not turned for this long is hung: it is killed and
    /// restarted.
    pub heartbeat: Duration,
    /// A device given up is tried again after this long (`outboard restart` tries at once).
    pub retry: Duration,
    /// A standby driver server waits to take the place of one that dies (a process more,
    /// a fork, exec and start-up fewer on a restart: `crate::standby`).
    pub standby: bool,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        Self {
            limit: 5,
            span: Duration::from_secs(5),
            window: Duration::from_secs(60),
            backoff: Duration::from_millis(10),
            max_backoff: Duration::from_secs(2),
            heartbeat: Duration::from_secs(1),
            retry: Duration::from_secs(60),
            standby: true,
        }
    }
}

/// How an incarnation ended, as the restart policy weighs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Death {
    /// An operator ended it to start it again (`outboard restart`): started again at once,
    /// whatever the policy (even `restarts = 0`, which turns automatic restarts off).
    Planned,
    /// It had made progress: serving, its loop turning.
    AfterProgress,
    /// It crashed, exited or hung before making progress: the driver's own doing.
    Crash,
    /// Killed from outside (SIGKILL, SIGTERM, SIGINT, SIGHUP) before making progress.
    Killed,
}

/// The signals that end a process from outside (an operator, the OOM killer, a supervisor):
/// a death by one of them says nothing about the driver.
const KILLED_FROM_OUTSIDE: [i32; 4] = [libc::SIGKILL, libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

/// Whether an exit was the process's own failure (a crash signal, an exit code other than 0,
/// a hang the manager killed it for), not a kill from outside: what quarantine counts.
pub fn is_fault(status: Option<std::process::ExitStatus>, hung: bool) -> bool {
    use std::os::unix::process::ExitStatusExt;
    hung || match status {
        Some(s) => match s.signal() {
            Some(sig) => !KILLED_FROM_OUTSIDE.contains(&sig),
            None => s.code() != Some(0),
        },
        None => false,
    }
}

impl Death {
    /// Weighs an exit: `progressed` if it made progress, `hung` if the manager killed it for
    /// a stopped heartbeat.
    pub fn of(status: Option<std::process::ExitStatus>, progressed: bool, hung: bool) -> Self {
        use std::os::unix::process::ExitStatusExt;
        if progressed {
            return Death::AfterProgress;
        }
        match status.and_then(|s| s.signal()) {
            Some(sig) if !hung && KILLED_FROM_OUTSIDE.contains(&sig) => Death::Killed,
            _ => Death::Crash,
        }
    }
}

/// A process's crash history.
#[derive(Debug, Default, Clone)]
pub struct Restarts {
    /// Crashes without progress since the last progress, within the window: the budget.
    crashes: std::collections::VecDeque<Instant>,
    /// Deaths in a row since an incarnation last came into service: the back-off.
    streak: u32,
    /// Restarts since the machine came up.
    pub total: u64,
    /// Retries since the last give-up, none of which came into service.
    retries: u32,
}

impl Restarts {
    /// A death at `now`: how long to wait before starting it again, or `None` to give up.
    pub fn crashed(&mut self, now: Instant, p: &RestartPolicy, death: Death) -> Option<Duration> {
        if p.limit == 0 && death != Death::Planned {
            return None;
        }
        match death {
            Death::Planned | Death::AfterProgress => {
                // A working driver: at once, and the next death is a first again.
                self.crashes.clear();
                self.streak = 0;
                self.retries = 0;
                self.total += 1;
                return Some(Duration::ZERO);
            }
            Death::Crash => {
                self.crashes
                    .retain(|t| now.saturating_duration_since(*t) < p.window);
                let lasted = self
                    .crashes
                    .front()
                    .is_some_and(|first| now.saturating_duration_since(*first) >= p.span);
                if self.crashes.len() as u32 >= p.limit && lasted {
                    return None;
                }
                self.crashes.push_back(now);
            }
            Death::Killed => {}
        }
        self.streak += 1;
        self.total += 1;
        // The first restart in a row is at once. A process killed from outside again and
        // again before it came up waits `backoff` each time (a floor, not a spin: it is not
        // the driver's fault); one that crashes waits 10 ms, 20 ms, … up to the maximum.
        Some(match (self.streak, death) {
            (0 | 1, _) => Duration::ZERO,
            (_, Death::Killed) => p.backoff,
            (n, _) => p
                .backoff
                .saturating_mul(1u32 << (n - 2).min(20))
                .min(p.max_backoff),
        })
    }

    /// The incarnation came into service: back-off starts afresh (its crashes still count
    /// against the limit until one also makes progress, and retries after a give-up keep
    /// growing until one does).
    pub fn served(&mut self) {
        self.streak = 0;
    }

    /// When a process just given up is tried again: soon at first (1 s), doubling with each
    /// retry that fails, up to the policy's `retry`. An outage that ended on its own (a storm
    /// of kills) costs a second, not a minute. Where automatic restarts are off
    /// (`restarts = 0`), only the slow schedule.
    pub fn next_retry(&mut self, p: &RestartPolicy) -> Duration {
        if p.limit == 0 {
            return p.retry;
        }
        let d = Duration::from_secs(1)
            .saturating_mul(1u32 << self.retries.min(20))
            .min(p.retry);
        self.retries += 1;
        d
    }

    /// Forgets the deaths in a row (an operator's `outboard restart`: try afresh).
    pub fn forgive(&mut self) {
        self.crashes.clear();
        self.streak = 0;
    }

    /// Crashes without progress that count against the limit, as of `now`.
    pub fn failing(&self, now: Instant, p: &RestartPolicy) -> usize {
        self.crashes
            .iter()
            .filter(|t| now.saturating_duration_since(**t) < p.window)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(limit: u32) -> RestartPolicy {
        RestartPolicy {
            limit,
            window: Duration::from_secs(10),
            backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(25),
            ..RestartPolicy::default()
        }
    }

    #[test]
    fn only_crashes_without_progress_count_and_back_off_starts_at_zero() {
        let p = policy(3);
        let mut r = Restarts::default();
        let t = Instant::now();
        assert_eq!(r.crashed(t, &p, Death::Crash), Some(Duration::ZERO));
        assert_eq!(
            r.crashed(t, &p, Death::Crash),
            Some(Duration::from_millis(10))
        );
        assert_eq!(
            r.crashed(t, &p, Death::Crash),
            Some(Duration::from_millis(20))
        );
        // The limit: a fourth crash in a row without progress gives up, once the loop has
        // lasted its span (a burst within it does not).
        assert_eq!(
            r.crashed(t, &p, Death::Crash),
            Some(Duration::from_millis(25))
        );
        assert_eq!(r.crashed(t + p.span, &p, Death::Crash), None);
        assert_eq!(r.total, 4);
        // An operator's restart forgives; progress resets too.
        r.forgive();
        assert_eq!(r.crashed(t, &p, Death::Crash), Some(Duration::ZERO));
        assert_eq!(r.crashed(t, &p, Death::AfterProgress), Some(Duration::ZERO));
        assert_eq!(r.failing(t, &p), 0);
        assert_eq!(r.crashed(t, &p, Death::Crash), Some(Duration::ZERO));
        // Old ones are forgotten after the window.
        let later = t + Duration::from_secs(11);
        assert_eq!(r.failing(later, &p), 0);
    }

    #[test]
    fn kills_from_outside_are_slowed_but_never_give_a_driver_up() {
        let p = policy(2);
        let mut r = Restarts::default();
        let t = Instant::now();
        for k in 0..100 {
            let d = r.crashed(t, &p, Death::Killed).expect("never given up");
            let floor = if k == 0 { Duration::ZERO } else { p.backoff };
            assert_eq!(d, floor, "kill {k}");
        }
        // Progress resets the back-off.
        assert_eq!(r.crashed(t, &p, Death::AfterProgress), Some(Duration::ZERO));
        assert_eq!(r.crashed(t, &p, Death::Killed), Some(Duration::ZERO));
    }

    #[test]
    fn restarts_zero_means_never() {
        let mut r = Restarts::default();
        let t = Instant::now();
        assert_eq!(r.crashed(t, &policy(0), Death::AfterProgress), None);
        // Except that an operator's restart is one.
        assert_eq!(
            r.crashed(t, &policy(0), Death::Planned),
            Some(Duration::ZERO)
        );
        // And a given-up device is tried again only on the slow schedule.
        assert_eq!(r.next_retry(&policy(0)), policy(0).retry);
    }

    #[test]
    fn a_storm_of_early_deaths_is_ridden_out_and_a_give_up_retried_soon() {
        let p = policy(5);
        let mut r = Restarts::default();
        let t = Instant::now();
        // Fifty deaths before serving within a second (a storm of crash signals from
        // outside): not given up.
        for k in 0..50u64 {
            let at = t + Duration::from_millis(20 * k);
            assert!(r.crashed(at, &p, Death::Crash).is_some(), "death {k}");
        }
        // Still failing after the span: a real crash loop.
        assert_eq!(r.crashed(t + p.span, &p, Death::Crash), None);
        // Tried again after 1 s, 2 s, 4 s, … up to the slow schedule; serving resets it.
        let tries: Vec<_> = (0..8).map(|_| r.next_retry(&p)).collect();
        assert_eq!(tries[..3], [1, 2, 4].map(Duration::from_secs));
        assert_eq!(tries[7], p.retry);
        // Coming into service is not enough to start the schedule over; progress is.
        r.served();
        assert_eq!(r.next_retry(&p), p.retry);
        assert!(r.crashed(t, &p, Death::AfterProgress).is_some());
        assert_eq!(r.next_retry(&p), Duration::from_secs(1));
    }

    #[test]
    fn deaths_are_weighed_by_progress_and_signal() {
        use std::os::unix::process::ExitStatusExt;
        let sig = |s: i32| Some(std::process::ExitStatus::from_raw(s));
        let code = |c: i32| Some(std::process::ExitStatus::from_raw(c << 8));
        assert_eq!(
            Death::of(sig(libc::SIGKILL), true, false),
            Death::AfterProgress
        );
        assert_eq!(Death::of(sig(libc::SIGKILL), false, false), Death::Killed);
        assert_eq!(Death::of(sig(libc::SIGKILL), false, true), Death::Crash);
        assert_eq!(Death::of(sig(libc::SIGSEGV), false, false), Death::Crash);
        assert_eq!(Death::of(sig(libc::SIGABRT), false, false), Death::Crash);
        assert_eq!(Death::of(code(1), false, false), Death::Crash);
    }

    #[test]
    fn a_driver_killed_often_while_serving_is_never_delayed_nor_given_up() {
        let p = RestartPolicy::default();
        let mut r = Restarts::default();
        let t = Instant::now();
        for k in 0..1000 {
            let now = t + Duration::from_millis(10 * k);
            assert_eq!(
                r.crashed(now, &p, Death::AfterProgress),
                Some(Duration::ZERO),
                "kill {k}"
            );
        }
    }
}
