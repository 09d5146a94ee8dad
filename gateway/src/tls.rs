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
use pingora::tls::{ClientHello, CryptoProvider, ResolvesServerCert, ServerName};
use serde::Deserialize;

use crate::error::FieldError;

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
    pub fn validate(&self, errs: &mut Vec<FieldError>) {
        for (i, pair) in self.pairs().iter().enumerate() {
            if let Err(reason) = load_pair(pair) {
                let field = if i == 0 { "tls.cert_file".to_string() } else { format!("tls.certs[{}]", i - 1) };
                errs.push(FieldError { field, value: pair.cert_file.clone(), reason });
            }
        }
    }
}

/// A loaded pair: the key rustls serves and the leaf certificate's DER for SNI matching.
#[derive(Debug)]
struct Loaded {
    key: Arc<CertifiedKey>,
}

fn load_pair(pair: &CertPair) -> Result<(Loaded, Vec<u8>), String> {
    let read = |p: &str| std::fs::read(p).map_err(|e| format!("cannot read {p}: {e}"));
    let (cert_pem, key_pem) = (read(&pair.cert_file)?, read(&pair.key_file)?);
    let (certs, key) = pingora::tls::load_certs_and_key_files(&pair.cert_file, &pair.key_file)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("no certificate in {} or no private key in {}", pair.cert_file, pair.key_file))?;
    pingora::tls::install_default_crypto_provider();
    let provider = CryptoProvider::get_default().ok_or("no TLS crypto provider")?;
    let signing = provider.key_provider.load_private_key(key).map_err(|e| format!("unusable private key: {e}"))?;
    webpki::EndEntityCert::try_from(&certs[0]).map_err(|e| format!("unusable certificate: {e}"))?;
    let key = Arc::new(CertifiedKey::new(certs, signing));
    key.keys_match().map_err(|e| format!("the key does not belong to the certificate: {e}"))?;
    let mut fingerprint = cert_pem;
    fingerprint.extend_from_slice(&key_pem);
    Ok((Loaded { key }, fingerprint))
}

/// The loaded set and the file contents it came from.
#[derive(Debug)]
struct Set {
    loaded: Vec<Loaded>,
    files: Vec<u8>,
}

/// Certificates by SNI, swappable under live listeners.
#[derive(Debug)]
pub struct CertStore {
    pairs: ArcSwap<Vec<CertPair>>,
    set: ArcSwap<Set>,
}

impl CertStore {
    /// Load every pair of `cfg` (validated beforehand).
    pub fn load(cfg: &TlsConfig) -> Result<Arc<Self>, String> {
        let pairs = cfg.pairs();
        let set = load_set(&pairs)?;
        Ok(Arc::new(CertStore { pairs: ArcSwap::from_pointee(pairs), set: ArcSwap::from_pointee(set) }))
    }

    /// Re-read the files (and take `cfg`'s pairs, which a config reload may have changed);
    /// swap in the new set when the bytes changed and all load. `Ok(true)` when swapped.
    pub fn reload_if_changed(&self, cfg: &TlsConfig) -> Result<bool, String> {
        let pairs = cfg.pairs();
        let files = fingerprint(&pairs);
        if *self.pairs.load().as_ref() == pairs && files.as_deref() == Some(self.set.load().files.as_slice()) {
            return Ok(false);
        }
        let set = load_set(&pairs)?;
        self.pairs.store(Arc::new(pairs));
        self.set.store(Arc::new(set));
        Ok(true)
    }
}

fn fingerprint(pairs: &[CertPair]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    for p in pairs {
        out.extend(std::fs::read(&p.cert_file).ok()?);
        out.extend(std::fs::read(&p.key_file).ok()?);
    }
    Some(out)
}

fn load_set(pairs: &[CertPair]) -> Result<Set, String> {
    let mut loaded = Vec::new();
    let mut files = Vec::new();
    for p in pairs {
        let (l, f) = load_pair(p).map_err(|e| format!("{}: {e}", p.cert_file))?;
        loaded.push(l);
        files.extend(f);
    }
    Ok(Set { loaded, files })
}

impl ResolvesServerCert for CertStore {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let set = self.set.load();
        let wanted = hello.server_name().and_then(|n| ServerName::try_from(n).ok());
        if let Some(name) = wanted {
            for l in &set.loaded {
                let leaf = l.key.end_entity_cert().ok()?;
                let valid = webpki::EndEntityCert::try_from(leaf)
                    .is_ok_and(|c| c.verify_is_valid_for_subject_name(&name).is_ok());
                if valid {
                    return Some(l.key.clone());
                }
            }
        }
        set.loaded.first().map(|l| l.key.clone())
    }
}
