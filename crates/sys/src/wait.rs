//! Waiting for a state instead of for a time.

use std::time::{Duration, Instant};

/// Calls `cond` until it holds, for at most `limit`; returns whether it held. Re-checks
/// quickly at first and then every 50 ms, so a cheap condition is seen at once and a costly one
/// (a subprocess) is not run in a tight loop. Tests wait for the state they assert this way,
/// never for a fixed time a loaded machine may not honour.
pub fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    let mut pause = Duration::from_millis(2);
    loop {
        if cond() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_a_state_reached_and_one_never_reached() {
        let mut n = 0;
        assert!(eventually(Duration::from_secs(5), || {
            n += 1;
            n == 4
        }));
        assert!(!eventually(Duration::from_millis(20), || false));
    }
}
