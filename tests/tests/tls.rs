//! TLS on the API listener: certificates by SNI, HTTP/2 over ALPN, rotation of the files
//! without dropping connections, and a bad rotation that keeps the old certificate.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::json;
use switchyard_testkit::pki::{negotiated, served_leaf, TestPki};
use switchyard_testkit::*;

fn completion(authority: &str, stream: bool) -> hyper::Request<Full<Bytes>> {
    let body = json!({"model": "m", "prompt": "p", "stream": stream}).to_string();
    hyper::Request::post(format!("https://{authority}/v1/completions"))
        .header("content-type", "application/json")
        .header("host", authority)
        .body(Full::new(Bytes::from(body)))
        .unwrap()
}

async fn tls_gateway(pki: &TestPki, engine: &FaultEngine) -> (GatewayProc, std::path::PathBuf, Vec<u8>, Vec<u8>) {
    let dir = scratch_dir("tls");
    let (a, b) = (pki.issue(&["a.test"]), pki.issue(&["b.test", "*.b.test"]));
    let (a_crt, a_key) = TestPki::write(&a, &dir, "a");
    let (b_crt, b_key) = TestPki::write(&b, &dir, "b");
    let g = GatewayProc::start(
        &GatewayConfigBuilder::new()
            .backends([engine.url()])
            .policy("least_load")
            .tls(&a_crt, &a_key)
            .sni_cert(&b_crt, &b_key),
    );
    wait_scraped(&g, 1).await;
    (g, dir, a.der, b.der)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_picks_the_certificate_by_sni_and_speaks_http2_over_alpn() {
    let pki = TestPki::new();
    let engine = FaultEngine::start(Fault::Healthy).await;
    let (g, _dir, a_der, b_der) = tls_gateway(&pki, &engine).await;

    for (sni, want) in [("a.test", &a_der), ("b.test", &b_der), ("x.b.test", &b_der)] {
        let tls = pki.connect(g.addr, sni, &[b"http/1.1"]).await;
        assert_eq!(&served_leaf(&tls), want, "certificate served for {sni}");
    }

    // ALPN h2: HTTP/2 over TLS, a streamed completion.
    let tls = pki.connect(g.addr, "a.test", &[b"h2", b"http/1.1"]).await;
    assert_eq!(negotiated(&tls).as_deref(), Some(&b"h2"[..]));
    let (mut h2, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls)).await.unwrap();
    tokio::spawn(conn);
    let resp = h2.send_request(completion("a.test", true)).await.unwrap();
    assert_eq!((resp.status(), resp.version()), (hyper::StatusCode::OK, hyper::Version::HTTP_2));
    let text = String::from_utf8(resp.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");

    // ALPN http/1.1 only: HTTP/1.1 over TLS.
    let tls = pki.connect(g.addr, "b.test", &[b"http/1.1"]).await;
    assert_eq!(negotiated(&tls).as_deref(), Some(&b"http/1.1"[..]));
    let (mut h1, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.unwrap();
    tokio::spawn(conn);
    let resp = h1.send_request(completion("b.test", false)).await.unwrap();
    assert_eq!((resp.status(), resp.version()), (hyper::StatusCode::OK, hyper::Version::HTTP_11));

    // Plain HTTP on the TLS port is refused (no silent downgrade).
    let (reply, _) = raw_exchange(g.addr, b"GET /-/healthz HTTP/1.1\r\nHost: x\r\n\r\n", Duration::from_secs(3)).await;
    assert!(!reply.contains("200 OK"), "{reply}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_rotate_without_dropping_connections() {
    let pki = TestPki::new();
    let engine = FaultEngine::start(Fault::Healthy).await;
    let (g, dir, a_der, _) = tls_gateway(&pki, &engine).await;

    // A keep-alive connection made with the old certificate.
    let tls = pki.connect(g.addr, "a.test", &[b"http/1.1"]).await;
    assert_eq!(served_leaf(&tls), a_der);
    let (mut old_conn, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.unwrap();
    tokio::spawn(conn);
    let resp = old_conn.send_request(completion("a.test", false)).await.unwrap();
    assert_eq!(resp.status(), 200);
    resp.into_body().collect().await.unwrap();

    // The Secret is renewed: new handshakes get the new certificate within the poll.
    let renewed = pki.issue(&["a.test"]);
    TestPki::write(&renewed, &dir, "a");
    let start = Instant::now();
    loop {
        let tls = pki.connect(g.addr, "a.test", &[b"http/1.1"]).await;
        if served_leaf(&tls) == renewed.der {
            break;
        }
        assert!(start.elapsed() < PATIENCE, "the renewed certificate was not picked up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The connection made before the rotation still works.
    let resp = old_conn.send_request(completion("a.test", false)).await.unwrap();
    assert_eq!(resp.status(), 200);
    resp.into_body().collect().await.unwrap();

    // A broken renewal (a key that does not match) is refused; the renewed one stays.
    let other = pki.issue(&["a.test"]);
    std::fs::write(dir.join("a.key"), &other.key_pem).unwrap();
    let start = Instant::now();
    loop {
        let m = scrape(g.admin).await;
        let refused = m.iter().any(|s| {
            s.name == "switchyard_certificate_reloads_total"
                && s.labels.get("result").map(String::as_str) == Some("error")
                && matches!(s.value, SeriesValue::Scalar(v) if v >= 1.0)
        });
        if refused {
            break;
        }
        assert!(start.elapsed() < PATIENCE, "the broken renewal was not noticed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let tls = pki.connect(g.addr, "a.test", &[b"http/1.1"]).await;
    assert_eq!(served_leaf(&tls), renewed.der, "the last good certificate is still served");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_backends_are_verified_against_the_configured_ca() {
    let pki = TestPki::new();
    let engine = FaultEngine::start(Fault::Healthy).await;
    let (front, _task) = switchyard_testkit::pki::tls_front(&pki.issue(&["localhost"]), engine.addr).await;
    let dir = scratch_dir("upstream-tls");
    let ca = dir.join("ca.crt");
    std::fs::write(&ca, pki.ca_pem()).unwrap();
    let backend = format!("https://localhost:{}", front.port());
    let trusting =
        GatewayProc::start(&GatewayConfigBuilder::new().backends([&backend]).policy("least_load").upstream_ca(&ca));
    wait_scraped(&trusting, 1).await;
    let r = post(trusting.addr, "/v1/completions", &json!({"model": "m", "prompt": "p"})).await;
    assert_eq!(r.status, 200, "through TLS to the engine");
    r.text().await;
    let posts = engine.posts();
    assert_eq!(posts, 1);

    // Without the CA the engine's certificate is not trusted: never up, nothing sent.
    let other = TestPki::new();
    let untrusted_ca = dir.join("other-ca.crt");
    std::fs::write(&untrusted_ca, other.ca_pem()).unwrap();
    // Scrapes fail (and would mark it down); declared models and a long scrape interval let
    // the proxy itself try, and refuse, the connection.
    let doubting = GatewayProc::start(
        &GatewayConfigBuilder::new()
            .backend_serving(&backend, &["m"])
            .scrape_interval_ms(60000)
            .stale_after_ms(60000)
            .down_after_failures(100)
            .upstream_ca(&untrusted_ca),
    );
    let r = post(doubting.addr, "/v1/completions", &json!({"model": "m", "prompt": "p"})).await;
    assert_eq!(r.status, 502, "the engine's certificate is not trusted");
    // The first scrape (refused at the handshake too) may still be under way on a busy machine.
    eventually("the scrape fails on the untrusted certificate", async || {
        backends(&doubting).await["backends"][0]["scrape_error"] != serde_json::Value::Null
    })
    .await;
    assert_eq!(engine.posts(), posts, "nothing reached the engine over an unverified connection");
}

/// HTTP/2 over TLS waits for the client's preface inside pingora's h2 handshake, with no
/// deadline of its own (#24, high 2): a client that completes TLS, picks `h2` and sends 10
/// of the preface's 24 bytes is closed by the header deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_client_that_stalls_in_its_preface_is_closed_by_the_header_deadline() {
    use tokio::io::AsyncWriteExt;
    let pki = TestPki::new();
    let engine = FaultEngine::start(Fault::Healthy).await;
    let dir = scratch_dir("tls-preface");
    let (crt, key) = TestPki::write(&pki.issue(&["a.test"]), &dir, "a");
    let g = GatewayProc::start(
        &GatewayConfigBuilder::new()
            .backends([engine.url()])
            .tls(&crt, &key)
            .section("limits", "{ header_read_timeout_ms: 500 }"),
    );
    wait_scraped(&g, 1).await;
    let mut tls = pki.connect(g.addr, "a.test", &[b"h2"]).await;
    assert_eq!(negotiated(&tls).as_deref(), Some(&b"h2"[..]));
    let opened = Instant::now();
    tls.write_all(&b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"[..10]).await.unwrap();
    tls.flush().await.unwrap();
    // What arrives before the close is the server's SETTINGS.
    let closed = closed_after(&mut tls, opened).await.expect("a TLS h2 connection stalled in its preface was kept");
    assert!(closed >= Duration::from_millis(450), "closed before the deadline: {closed:?}");
    assert!(metric(&scrape(g.admin).await, "switchyard_header_timeouts_total") >= 1.0);
    // A client that sends its preface is served as before.
    let tls = pki.connect(g.addr, "a.test", &[b"h2"]).await;
    let (mut h2, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls)).await.unwrap();
    tokio::spawn(conn);
    let resp = h2.send_request(completion("a.test", false)).await.unwrap();
    assert_eq!(resp.status(), hyper::StatusCode::OK);
}
