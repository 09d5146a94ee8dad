//! A throwaway certificate authority for TLS tests: certificates for any names, and rustls
//! clients that trust only it (with the ALPN protocols a test asks for).

use std::net::SocketAddr;
use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::client::TlsStream;

/// A CA that signs leaf certificates.
pub struct TestPki {
    issuer: Issuer<'static, KeyPair>,
    ca_der: CertificateDer<'static>,
    ca_pem: String,
}

/// One issued certificate.
pub struct Leaf {
    /// PEM chain (the leaf).
    pub cert_pem: String,
    /// PEM PKCS#8 key.
    pub key_pem: String,
    /// DER of the leaf, to compare with what a server presents.
    pub der: Vec<u8>,
}

impl Default for TestPki {
    fn default() -> Self {
        Self::new()
    }
}

impl TestPki {
    /// A new CA.
    pub fn new() -> Self {
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).expect("CA certificate");
        TestPki { ca_der: cert.der().clone(), ca_pem: cert.pem(), issuer: Issuer::new(params, key) }
    }

    /// The CA certificate, PEM.
    pub fn ca_pem(&self) -> String {
        self.ca_pem.clone()
    }

    /// A leaf certificate for `names`.
    pub fn issue(&self, names: &[&str]) -> Leaf {
        let key = KeyPair::generate().expect("leaf key");
        let params = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).expect("params");
        let cert = params.signed_by(&key, &self.issuer).expect("leaf certificate");
        Leaf { cert_pem: cert.pem(), key_pem: key.serialize_pem(), der: cert.der().to_vec() }
    }

    /// Write `leaf` to `dir/{stem}.crt` and `.key` (atomically, by rename); the two paths.
    pub fn write(leaf: &Leaf, dir: &std::path::Path, stem: &str) -> (String, String) {
        let (crt, key) = (dir.join(format!("{stem}.crt")), dir.join(format!("{stem}.key")));
        for (path, text) in [(&crt, &leaf.cert_pem), (&key, &leaf.key_pem)] {
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, text).unwrap();
            std::fs::rename(&tmp, path).unwrap();
        }
        (crt.display().to_string(), key.display().to_string())
    }

    /// A client config trusting only this CA, offering `alpn`.
    pub fn client_config(&self, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca_der.clone()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(cfg)
    }

    /// Connect to `addr` asking for `sni`, offering `alpn`.
    pub async fn connect(&self, addr: SocketAddr, sni: &str, alpn: &[&[u8]]) -> TlsStream<tokio::net::TcpStream> {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let connector = tokio_rustls::TlsConnector::from(self.client_config(alpn));
        connector.connect(ServerName::try_from(sni.to_string()).unwrap(), tcp).await.expect("TLS handshake")
    }
}

/// The leaf certificate a TLS connection was served.
pub fn served_leaf(stream: &TlsStream<tokio::net::TcpStream>) -> Vec<u8> {
    stream.get_ref().1.peer_certificates().expect("a certificate")[0].to_vec()
}

/// The ALPN protocol agreed on.
pub fn negotiated(stream: &TlsStream<tokio::net::TcpStream>) -> Option<Vec<u8>> {
    stream.get_ref().1.alpn_protocol().map(<[u8]>::to_vec)
}

/// A TLS terminator on a free loopback port in front of the plain `upstream`, serving
/// `leaf`: an engine behind TLS. Stops when the handle is aborted.
pub async fn tls_front(leaf: &Leaf, upstream: SocketAddr) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::PrivateKeyDer;
    let certs = vec![CertificateDer::from_pem_slice(leaf.cert_pem.as_bytes()).unwrap()];
    let key = PrivateKeyDer::from_pem_slice(leaf.key_pem.as_bytes()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else { return };
                let Ok(mut plain) = tokio::net::TcpStream::connect(upstream).await else { return };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    (addr, task)
}
