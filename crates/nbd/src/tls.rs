//! TLS for exports (`NBD_OPT_STARTTLS`), with rustls: a certificate chain and its key, in PEM.

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
