//! A raw NBD client, for the tests that say what real clients would not.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// A raw NBD client, for saying what real clients would not.
pub struct Raw(pub UnixStream);

impl Raw {
    pub fn connect(path: &Path) -> Self {
        let s = UnixStream::connect(path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Self(s)
    }

    /// Reads the greeting and answers it with fixed newstyle, no zeroes.
    pub fn hello(&mut self) {
        let mut g = [0u8; 18];
        self.0.read_exact(&mut g).unwrap();
        assert_eq!(&g[..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        self.0.write_all(&3u32.to_be_bytes()).unwrap();
    }

    pub fn option(&mut self, option: u32, data: &[u8]) {
        let mut b = b"IHAVEOPT".to_vec();
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.0.write_all(&b).unwrap();
    }

    /// One option reply: (type, data).
    pub fn option_reply(&mut self) -> (u32, Vec<u8>) {
        let mut h = [0u8; 20];
        self.0.read_exact(&mut h).unwrap();
        assert_eq!(
            u64::from_be_bytes(h[..8].try_into().unwrap()),
            0x3e889045565a9
        );
        let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        let mut d = vec![0u8; len as usize];
        self.0.read_exact(&mut d).unwrap();
        (kind, d)
    }

    /// Negotiates export "disk0" with `NBD_OPT_GO` asking for block sizes; simple replies.
    pub fn go(path: &Path) -> Self {
        let mut r = Self::connect(path);
        r.hello();
        let mut d = 5u32.to_be_bytes().to_vec();
        d.extend_from_slice(b"disk0");
        d.extend_from_slice(&1u16.to_be_bytes());
        d.extend_from_slice(&3u16.to_be_bytes());
        r.option(7, &d);
        loop {
            let (kind, _) = r.option_reply();
            if kind == 1 {
                return r;
            }
            assert_eq!(kind, 3, "an info reply or the ack");
        }
    }

    pub fn request(&mut self, command: u16, cookie: u64, offset: u64, length: u32, payload: &[u8]) {
        let mut b = request_header(command, cookie, offset, length);
        b.extend_from_slice(payload);
        self.0.write_all(&b).unwrap();
    }

    /// A simple reply: (error, cookie), and `data` bytes after it.
    pub fn reply(&mut self, data: usize) -> (u32, u64, Vec<u8>) {
        let mut h = [0u8; 16];
        self.0.read_exact(&mut h).unwrap();
        assert_eq!(u32::from_be_bytes(h[..4].try_into().unwrap()), 0x67446698);
        let error = u32::from_be_bytes(h[4..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(h[8..].try_into().unwrap());
        let mut d = vec![0u8; if error == 0 { data } else { 0 }];
        self.0.read_exact(&mut d).unwrap();
        (error, cookie, d)
    }

    /// Whether the server closed the connection.
    pub fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.0.read(&mut b), Ok(0) | Err(_))
    }
}

/// A request header: command `command`, cookie, offset, length.
pub fn request_header(command: u16, cookie: u64, offset: u64, length: u32) -> Vec<u8> {
    let mut b = 0x25609513u32.to_be_bytes().to_vec();
    b.extend_from_slice(&0u16.to_be_bytes());
    b.extend_from_slice(&command.to_be_bytes());
    b.extend_from_slice(&cookie.to_be_bytes());
    b.extend_from_slice(&offset.to_be_bytes());
    b.extend_from_slice(&length.to_be_bytes());
    b
}

/// The `export` node named `nbd:NAME` in `up`'s registry (null if there is none).
pub fn export_node(up: &super::Up, name: &str) -> serde_json::Value {
    fn find(n: &serde_json::Value, name: &str) -> Option<serde_json::Value> {
        if n["kind"] == "export" && n["name"] == format!("nbd:{name}") {
            return Some(n.clone());
        }
        n["children"].as_array()?.iter().find_map(|c| find(c, name))
    }
    find(&super::registry(up), name).unwrap_or(serde_json::Value::Null)
}

/// Writes a pattern at `offset` through a fresh connection and reads it back byte-exact.
#[allow(dead_code)]
pub fn round_trip(socket: &Path, offset: u64, seed: u64) {
    let mut c = Raw::go(socket);
    let data = super::pattern(seed, 65536);
    c.request(1, 1, offset, data.len() as u32, &data);
    assert_eq!(c.reply(0).0, 0, "write");
    c.request(0, 2, offset, data.len() as u32, &[]);
    let (e, cookie, got) = c.reply(data.len());
    assert_eq!((e, cookie), (0, 2), "read");
    assert!(got == data, "read back differs");
}

/// The UNIX socket export `name` of the machine listens on (from its URI in the registry).
#[allow(dead_code)]
pub fn export_socket(up: &super::Up, name: &str) -> std::path::PathBuf {
    let node = export_node(up, name);
    std::path::PathBuf::from(
        node["props"]["uri"]
            .as_str()
            .unwrap()
            .split_once("socket=")
            .unwrap()
            .1,
    )
}
