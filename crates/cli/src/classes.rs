//! The classes this build serves: a driver server turns a started driver into its class's
//! dispatcher here. This is the one list in the driver server that names classes; a new class
//! adds its line.

use outboard_drivers::{Attachment, StartOptions};
use outboard_env::AnyDriver;
use outboard_server::{Dispatcher, Served};

/// Makes a class's dispatcher for a started driver of that class.
type Serve = fn(Box<dyn AnyDriver>) -> Result<Box<dyn Dispatcher>, String>;

const CLASSES: &[(&str, Serve)] = &[(
    outboard_block::CLASS,
    outboard_block_server::BlockDispatcher::serve,
)];

/// The dispatcher of `driver`'s class.
pub fn dispatcher(driver: Box<dyn AnyDriver>) -> Result<Box<dyn Dispatcher>, String> {
    let class = driver.class();
    let (_, serve) = CLASSES
        .iter()
        .find(|(c, _)| *c == class)
        .ok_or_else(|| format!("this build serves no {class} class"))?;
    serve(driver)
}

/// Starts the personality `driver` (or the best match) on the device at `at`, to be served by
/// its class's dispatcher and started again the same way after a failure.
pub fn serve(at: &Attachment, driver: Option<&str>, opts: StartOptions) -> Result<Served, String> {
    let started = outboard_drivers::start(at, driver, &opts).map_err(|e| e.to_string())?;
    let again = outboard_drivers::restarter(at, started.personality.driver, &opts);
    Ok(Served::new(dispatcher(started.driver)?, started.env).reopened_by(again))
}
