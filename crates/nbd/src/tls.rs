//! TLS for exports (`NBD_OPT_STARTTLS`): with certificates (rustls: a chain and its key in PEM,
//! optionally client certificates an authority signed), or with pre-shared keys (OpenSSL, since
//! rustls has no external PSKs: the keys file of nbdkit and GnuTLS's `psktool`).

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::NbdError;

/// A server's TLS configuration from PEM files: the certificate chain (leaf first) and its
/// private key; with `verify_peer` (a PEM file of certificate authorities), every client must
/// present a certificate one of them signed, as qemu-nbd's and nbdkit's `verify-peer` do.
pub fn server_config(
    cert: &Path,
    key: &Path,
    verify_peer: Option<&Path>,
) -> Result<Arc<rustls::ServerConfig>, NbdError> {
    let setup = |what: &Path, e: &dyn std::fmt::Display| {
        NbdError::Setup(format!("{}: {e}", what.display()))
    };
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| setup(cert, &e))?
        .collect::<Result<_, _>>()
        .map_err(|e| setup(cert, &e))?;
    if chain.is_empty() {
        return Err(setup(cert, &"no certificate in it"));
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| setup(key, &e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| NbdError::Setup(e.to_string()))?;
    let builder = match verify_peer {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_file_iter(ca).map_err(|e| setup(ca, &e))? {
                roots
                    .add(c.map_err(|e| setup(ca, &e))?)
                    .map_err(|e| setup(ca, &e))?;
            }
            if roots.is_empty() {
                return Err(setup(ca, &"no certificate authority in it"));
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()
            .map_err(|e| setup(ca, &e))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = builder
        .with_single_cert(chain, key)
        .map_err(|e| NbdError::Setup(format!("certificate and key: {e}")))?;
    Ok(Arc::new(config))
}

/// How an export's TLS authenticates.
#[derive(Clone)]
pub enum Tls {
    /// Certificates, with rustls.
    Certificates(Arc<rustls::ServerConfig>),
    /// Pre-shared keys, with OpenSSL.
    Psk(PskKeys),
}

/// Pre-shared keys by identity, and the OpenSSL context that checks clients against them.
#[derive(Clone)]
pub struct PskKeys {
    ctx: openssl::ssl::SslContext,
    /// How many identities the file holds.
    pub identities: usize,
}

/// Parses a keys file: one `identity:hexkey` per line (nbdkit's `--tls-psk` format, written by
/// GnuTLS's `psktool`); blank lines and `#` comments are skipped.
pub fn parse_psk(text: &str) -> Result<std::collections::HashMap<String, Vec<u8>>, String> {
    let mut keys = std::collections::HashMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = |why: &str| format!("line {}: {why}", n + 1);
        let (id, hex) = line
            .split_once(':')
            .ok_or_else(|| at("expected identity:hexkey"))?;
        if id.is_empty() || id.len() > 128 {
            return Err(at("an identity of 1 to 128 bytes"));
        }
        if hex.is_empty() || hex.len() % 2 != 0 || hex.len() > 2 * 256 {
            return Err(at("a key of 1 to 256 bytes, in hexadecimal"));
        }
        // Checked before it is cut in pairs: a pair boundary inside a multi-byte character
        // would not be a character boundary.
        if !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(at("the key is not hexadecimal"));
        }
        let key = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
            .collect::<Result<Vec<u8>, _>>()
            .map_err(|_| at("the key is not hexadecimal"))?;
        if keys.insert(id.to_string(), key).is_some() {
            return Err(at(&format!("identity {id:?} appears twice")));
        }
    }
    if keys.is_empty() {
        return Err("no key in it".into());
    }
    Ok(keys)
}

impl PskKeys {
    /// Reads a keys file (see [`parse_psk`]).
    pub fn from_file(path: &Path) -> Result<Self, NbdError> {
        let setup = |e: &dyn std::fmt::Display| NbdError::Setup(format!("{}: {e}", path.display()));
        let text = std::fs::read_to_string(path).map_err(|e| setup(&e))?;
        let keys = parse_psk(&text).map_err(|e| setup(&e))?;
        let identities = keys.len();
        let mut b = openssl::ssl::SslContext::builder(openssl::ssl::SslMethod::tls_server())
            .map_err(|e| setup(&e))?;
        b.set_min_proto_version(Some(openssl::ssl::SslVersion::TLS1_2))
            .map_err(|e| setup(&e))?;
        // TLS 1.2: PSK suites with forward secrecy first; TLS 1.3 uses the key with the
        // SHA-256 suites.
        b.set_cipher_list("ECDHE-PSK:DHE-PSK:PSK")
            .map_err(|e| setup(&e))?;
        b.set_psk_server_callback(move |_ssl, identity, out| {
            let key = identity
                .and_then(|i| std::str::from_utf8(i).ok())
                .and_then(|i| keys.get(i));
            match key {
                Some(k) if k.len() <= out.len() => {
                    out[..k.len()].copy_from_slice(k);
                    Ok(k.len())
                }
                // An unknown identity: 0 bytes of key fails the handshake.
                _ => Ok(0),
            }
        });
        Ok(Self {
            ctx: b.build(),
            identities,
        })
    }

    /// Runs the TLS handshake on `s`.
    pub fn accept<S: std::io::Read + std::io::Write>(
        &self,
        s: S,
    ) -> Result<openssl::ssl::SslStream<S>, NbdError> {
        let ssl =
            openssl::ssl::Ssl::new(&self.ctx).map_err(|e| NbdError::Setup(format!("TLS: {e}")))?;
        ssl.accept(s).map_err(|e| {
            let why = match e {
                openssl::ssl::HandshakeError::SetupFailure(e) => e.to_string(),
                openssl::ssl::HandshakeError::Failure(m)
                | openssl::ssl::HandshakeError::WouldBlock(m) => m.error().to_string(),
            };
            NbdError::Protocol(format!("TLS-PSK handshake: {why}"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psk_files_parse_and_bad_ones_say_where() {
        let k = parse_psk("# keys\nalice:0123456789abcdef\n\nbob:ff00\n").unwrap();
        assert_eq!(k["alice"], [0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef]);
        assert_eq!(k["bob"], [0xff, 0x00]);
        for (bad, says) in [
            ("alice\n", "line 1: expected"),
            ("alice:xyz0\n", "not hexadecimal"),
            ("alice:0\u{e9}0\n", "not hexadecimal"),
            ("alice:abc\n", "in hexadecimal"),
            (":00\n", "an identity"),
            ("a:00\na:01\n", "line 2: identity \"a\" appears twice"),
            ("# nothing\n", "no key"),
        ] {
            let e = parse_psk(bad).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }
}
