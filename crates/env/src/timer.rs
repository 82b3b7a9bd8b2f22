//! Timers as event sources (`outboard_sys::timer`): a timerfd on the monotonic clock, so a
//! sleeping work loop wakes exactly when something is due instead of polling.

pub use outboard_sys::timer::Timer;
