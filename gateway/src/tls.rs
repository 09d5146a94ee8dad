//! TLS on the API listener (rustls through pingora): certificates chosen by SNI, HTTP/2
//! offered over ALPN, and certificate rotation without a restart.
//!
//! [`CertStore`] is the rustls certificate resolver. It holds every configured
//! certificate/key pair in an `ArcSwap`; a handshake takes the first pair whose leaf
//! certificate is valid for the client's SNI name (checked by webpki against the
//! certificate's subject alternative names), else the default pair (`tls.cert_file`).
//! [`CertStore::reload_if_changed`] re-reads the files (the reloader calls it every poll):
//! a changed, valid set is swapped in for new handshakes while established connections
//! carry on; an invalid one is logged and counted, and the old set stays.

use std::sync::Arc;

use arc_swap::ArcSwap;
use pingora::tls::sign::CertifiedKey;
use pingora::tls::CertificateDer;
use pingora::tls::{ClientHello, CryptoProvider, PrivateKeyDer, ResolvesServerCert, ServerName};
use rustls_pki_types::pem::PemObject;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::error::Errors;

/// `tls`: when present, `listen` speaks TLS.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificate chain of the default certificate.
    pub cert_file: String,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of the default certificate.
    pub key_file: String,
    /// More certificates, each served to clients asking (SNI) for a name it is valid for.
    #[serde(default)]
    pub certs: Vec<CertPair>,
    /// Offer HTTP/2 over ALPN (else HTTP/1.1 only).
    #[serde(default = "yes")]
    pub http2: bool,
}

fn yes() -> bool {
    true
}

/// One certificate and its key.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CertPair {
    /// PEM certificate chain.
    pub cert_file: String,
    /// PEM private key.
    pub key_file: String,
}

impl TlsConfig {
    /// Every pair, the default first.
    pub fn pairs(&self) -> Vec<CertPair> {
        let default = CertPair { cert_file: self.cert_file.clone(), key_file: self.key_file.clone() };
        std::iter::once(default).chain(self.certs.iter().cloned()).collect()
    }

    /// Field-level problems (the files are read and parsed).
    pub fn check_files(&self, errs: &mut Errors) {
        for (i, pair) in self.pairs().iter().enumerate() {
            if let Err(reason) = read_pair(pair).and_then(|(cert, key)| parse_pair(&cert, &key)) {
                let field = if i == 0 { "tls.cert_file".to_string() } else { format!("tls.certs[{}]", i - 1) };
                errs.add(field, &pair.cert_file, reason);
            }
        }
    }
}

/// The PEM bytes of a pair's certificate chain and key.
fn read_pair(pair: &CertPair) -> Result<(Vec<u8>, Vec<u8>), String> {
    let read = |p: &str| std::fs::read(p).map_err(|e| format!("cannot read {p}: {e}"));
    Ok((read(&pair.cert_file)?, read(&pair.key_file)?))
}

/// What rustls serves for a PEM chain and key, checked: a usable key that belongs to a
/// leaf certificate webpki can match names against.
fn parse_pair(cert_pem: &[u8], key_pem: &[u8]) -> Result<Arc<CertifiedKey>, String> {
    let certs = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("bad certificate PEM: {e}"))?;
    let leaf = certs.first().ok_or("no certificate in the chain file")?;
    webpki::EndEntityCert::try_from(leaf).map_err(|e| format!("unusable certificate: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| format!("no usable private key: {e}"))?;
    pingora::tls::install_default_crypto_provider();
    let provider = CryptoProvider::get_default().ok_or("no TLS crypto provider")?;
    let signing = provider.key_provider.load_private_key(key).map_err(|e| format!("unusable private key: {e}"))?;
    let key = Arc::new(CertifiedKey::new(certs, signing));
    key.keys_match().map_err(|e| format!("the key does not belong to the certificate: {e}"))?;
    Ok(key)
}

/// SHA-256 over a pair's certificate and key bytes: what a reload compares, so the store
/// never keeps a private key's PEM around (the parsed key lives in rustls' signing key only).
fn pair_digest(cert_pem: &[u8], key_pem: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    for part in [cert_pem, key_pem] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    h.finalize().into()
}

/// The certificates in force: the pairs they were read from, a digest of the bytes read,
/// and what rustls serves for each (same order, the default first).
#[derive(Debug)]
struct Set {
    pairs: Vec<CertPair>,
    digests: Vec<[u8; 32]>,
    keys: Vec<Arc<CertifiedKey>>,
}

impl Set {
    /// Read and parse `pairs`; errors name the certificate file.
    fn load(pairs: Vec<CertPair>) -> Result<Self, String> {
        let files = pairs.iter().map(read_pair).collect::<Result<Vec<_>, _>>()?;
        Self::parse(pairs, &files)
    }

    fn parse(pairs: Vec<CertPair>, files: &[(Vec<u8>, Vec<u8>)]) -> Result<Self, String> {
        let keys = pairs
            .iter()
            .zip(files)
            .map(|(p, (cert, key))| parse_pair(cert, key).map_err(|e| format!("{}: {e}", p.cert_file)))
            .collect::<Result<Vec<_>, _>>()?;
        let digests = files.iter().map(|(cert, key)| pair_digest(cert, key)).collect();
        Ok(Set { pairs, digests, keys })
    }
}

/// Certificates by SNI, swappable under live listeners.
#[derive(Debug)]
pub struct CertStore {
    set: ArcSwap<Set>,
}

impl CertStore {
    /// Load every pair of `cfg` (validated beforehand).
    pub fn load(cfg: &TlsConfig) -> Result<Arc<Self>, String> {
        Ok(Arc::new(CertStore { set: ArcSwap::from_pointee(Set::load(cfg.pairs())?) }))
    }

    /// Re-read the files (and take `cfg`'s pairs, which a config reload may have changed);
    /// swap in the new set when the bytes changed and all load. `Ok(true)` when swapped.
    pub fn reload_if_changed(&self, cfg: &TlsConfig) -> Result<bool, String> {
        let pairs = cfg.pairs();
        let files = pairs.iter().map(read_pair).collect::<Result<Vec<_>, _>>()?;
        let current = self.set.load();
        let same = current.pairs == pairs
            && current.digests.iter().copied().eq(files.iter().map(|(cert, key)| pair_digest(cert, key)));
        if same {
            return Ok(false);
        }
        self.set.store(Arc::new(Set::parse(pairs, &files)?));
        Ok(true)
    }
}

impl ResolvesServerCert for CertStore {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let set = self.set.load();
        let wanted = hello.server_name().and_then(|n| ServerName::try_from(n).ok());
        if let Some(name) = wanted {
            for key in &set.keys {
                let valid = key.end_entity_cert().is_ok_and(|leaf| {
                    webpki::EndEntityCert::try_from(leaf)
                        .is_ok_and(|c| c.verify_is_valid_for_subject_name(&name).is_ok())
                });
                if valid {
                    return Some(key.clone());
                }
            }
        }
        set.keys.first().cloned()
    }
}
