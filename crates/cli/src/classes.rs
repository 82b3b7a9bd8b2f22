//! The classes this build knows: a driver server turns a started driver into its class's
//! dispatcher here, and `up` shows each class's commands. This is the one list in the command
//! line that names classes; a new class adds its lines.

use outboard_drivers::{Attachment, StartOptions};
use outboard_env::AnyDriver;
use outboard_server::{Dispatcher, Served};

/// Makes a class's dispatcher for a started driver of that class.
type Serve = fn(Box<dyn AnyDriver>) -> Result<Box<dyn Dispatcher>, outboard_env::WrongClass>;

const CLASSES: &[(&str, Serve)] = &[
    (
        outboard_block::CLASS,
        outboard_block_server::BlockDispatcher::serve,
    ),
    (
        outboard_rng::CLASS,
        outboard_rng_server::EntropyDispatcher::serve,
    ),
    (
        outboard_net::CLASS,
        outboard_net_server::NetDispatcher::serve,
    ),
    (
        outboard_clock::CLASS,
        outboard_clock_server::ClockDispatcher::serve,
    ),
    (
        outboard_char::CLASS,
        outboard_char_server::CharDispatcher::serve,
    ),
];

/// The dispatcher of `driver`'s class.
pub fn dispatcher(driver: Box<dyn AnyDriver>) -> Result<Box<dyn Dispatcher>, String> {
    let class = driver.class();
    let (_, serve) = CLASSES
        .iter()
        .find(|(c, _)| *c == class)
        .ok_or_else(|| format!("this build serves no {class} class"))?;
    serve(driver).map_err(|e| e.to_string())
}

/// Starts the personality `driver` (or the best match) on the device at `at`, to be served by
/// its class's dispatcher and started again the same way after a failure.
pub fn serve(at: &Attachment, driver: Option<&str>, opts: StartOptions) -> Result<Served, String> {
    let started = outboard_drivers::start(at, driver, &opts).map_err(|e| e.to_string())?;
    let again = outboard_drivers::restarter(at, started.personality.driver, &opts);
    Ok(Served::new(dispatcher(started.driver)?, started.env).reopened_by(again))
}

/// Commands to try on class device `name`, as `up` suggests them.
pub fn try_lines(class: &str, name: &str) -> Vec<String> {
    match class {
        outboard_block::CLASS => vec![
            format!("outboard blk info {name}"),
            format!("echo hello | outboard blk write {name} --offset 4096"),
            format!("outboard blk read {name} --offset 4096 --length 6"),
        ],
        outboard_rng::CLASS => vec![format!("outboard rng read {name} --length 16 --hex")],
        outboard_clock::CLASS => vec![
            format!("outboard clock {name}"),
            format!("outboard clock {name} --ticks 1000"),
        ],
        outboard_char::CLASS => vec![
            format!("outboard char info {name}"),
            format!("echo hello | outboard char write {name}"),
            format!("outboard tty {name}"),
        ],
        _ => Vec::new(),
    }
}
