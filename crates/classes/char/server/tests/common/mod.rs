//! What the char server's tests share: the pci-serial model on a line, served over vfio-user
//! from a thread, and a C 16550 driver on it (the legacy one on osenv, or the native one) in a
//! driver server of this process.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use outboard_char_server::CharDispatcher;
use outboard_devices::serial::Serial;
use outboard_devices::serial_line::Line;
use outboard_drivers::legacy::descriptor::{builtin_native_uart16550, builtin_uart16550};
use outboard_drivers::legacy::serial::LegacyChar;
use outboard_drivers::native_c::char::NativeCChar;
use outboard_hw::PciFunction;
use outboard_server::DriverHost;

/// A connected pair of stream sockets: a line's near end (the model's) and its far end.
pub fn socket_pair() -> (std::os::fd::OwnedFd, std::os::fd::OwnedFd) {
    rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::STREAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .unwrap()
}

/// A serial line served as device `tty0` at [`Served::sock`] until [`Served::stop`].
pub struct Served {
    /// The driver server's socket.
    pub sock: PathBuf,
    host_stop: Arc<AtomicBool>,
    host: JoinHandle<Result<outboard_server::HostStats, outboard_server::HostError>>,
    /// Set by [`Served::stop`]: the model (and whatever else the test hangs on it) ends.
    pub model_stop: Arc<AtomicBool>,
    model: JoinHandle<Result<(), outboard_vfio_user::ServerError>>,
}

/// Which of the two C 16550 drivers serves the line.
#[allow(dead_code)] // not every test binary that shares this module runs both
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Uart {
    /// `uart16550`, on osenv (a reader thread sleeping in the driver, an interrupt thread).
    Legacy,
    /// `native-c-uart16550`, called by the server's work loop.
    Native,
}

/// Serves `line` with the model at a socket in `dir`, driver `uart` on it in a driver server.
pub fn serve_with(dir: &Path, line: Line, uart: Uart) -> Served {
    let model_sock = dir.join("uart.sock");
    let mut server = outboard_vfio_user::Server::bind(
        &model_sock,
        Serial::new(line).unwrap(),
        outboard_vfio_user::ServerOptions::default(),
    )
    .unwrap();
    let model_stop = Arc::new(AtomicBool::new(false));
    let s = model_stop.clone();
    let model = std::thread::spawn(move || server.run(&s));

    let spec = format!("vfio-user:{}", model_sock.display())
        .parse()
        .unwrap();
    let f = PciFunction::open(&spec).unwrap();
    let env = outboard_env::DeviceEnv::for_function(&f);
    let served = match uart {
        Uart::Legacy => {
            let c = builtin_uart16550().unwrap();
            let driver = LegacyChar::start("uart16550", &c, "tty0", f).unwrap();
            CharDispatcher::served(driver, env)
        }
        Uart::Native => {
            let c = builtin_native_uart16550().unwrap();
            let driver = NativeCChar::start("native-c-uart16550", &c, "tty0", f).unwrap();
            CharDispatcher::served(driver, env)
        }
    };
    let sock = dir.join("char.sock");
    let (host_stop, host) = DriverHost::bind(&sock, vec![served]).unwrap().spawn();
    Served {
        sock,
        host_stop,
        host,
        model_stop,
        model,
    }
}

impl Served {
    /// Stops the driver server, then the model.
    pub fn stop(self) {
        self.host_stop.store(true, Ordering::Release);
        self.host.join().unwrap().unwrap();
        self.model_stop.store(true, Ordering::Release);
        self.model.join().unwrap().unwrap();
    }
}
