//! The Endpoint Picker (EPP) of the Gateway API Inference Extension: the gateway's routing
//! served to another gateway (Envoy, Istio, kgateway, …) over Envoy's ext_proc protocol.
//!
//! The other gateway sends each request's headers and body on one gRPC stream; the picker
//! runs it through the request driver ([`crate::proxy::driver`]) as an HTTP request is run —
//! the route table, API keys and limits, body caps, [`crate::proxy::plan::plan_request`], the
//! admission queue, the policy's pick with the same load and prefix signals — and answers
//! with the engine's `ip:port` in a header (and the metadata `envoy.lb`), or on the gateway's
//! behalf (an immediate response, with the status HTTP would get); the other gateway makes
//! the exchange and streams the response back through the picker, which counts it on the
//! engine that served ([`exchange`]). The messages themselves are built and read in
//! [`protocol`] (pure).
//!
//! gRPC health answers for GIE's three service names: `liveness` (the process answers),
//! `readiness` and `envoy.service.ext_proc.v3.ExternalProcessor` (ready as `/-/ready` is).

mod exchange;
pub(crate) mod protocol;

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use parking_lot::Mutex;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};
use tonic_health::ServingStatus;

use crate::config::EppConfig;
use crate::proxy::ProxyApp;

/// GIE's health service names.
const HEALTH_SERVICES: [&str; 3] = ["liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"];
/// How often readiness is re-read for the health service.
const HEALTH_EVERY: Duration = Duration::from_millis(250);
/// Largest ext_proc message accepted (a body chunk is far smaller; Envoy sends what it read).
const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// The ext_proc service: one [`exchange::serve`] task per stream.
struct Picker {
    app: Arc<ProxyApp>,
    epp: Arc<EppConfig>,
}

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        // Answers go out in order; a few may wait while Envoy reads (the body echo).
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tokio::spawn(exchange::serve(self.app.clone(), self.epp.clone(), request.into_inner(), tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// The EPP's gRPC server as a pingora background service, on a socket bound before start
/// (so `epp.listen: 127.0.0.1:0` can be printed, like the other listeners).
pub(crate) struct EppService {
    app: Arc<ProxyApp>,
    epp: Arc<EppConfig>,
    socket: Mutex<Option<TcpListener>>,
}

impl EppService {
    /// Serve `epp` on `socket` (bound, non-blocking) with the proxy's phases.
    pub(crate) fn new(app: Arc<ProxyApp>, epp: EppConfig, socket: TcpListener) -> Self {
        EppService { app, epp: Arc::new(epp), socket: Mutex::new(Some(socket)) }
    }
}

#[async_trait]
impl BackgroundService for EppService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let Some(socket) = self.socket.lock().take() else { return };
        let listener = match tokio::net::TcpListener::from_std(socket) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "epp: cannot listen");
                return;
            }
        };
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).map(|conn| {
            conn.inspect(|c| {
                // Each answer is a small frame the gateway waits on.
                let _ = c.set_nodelay(true);
            })
        });
        let (reporter, health) = tonic_health::server::health_reporter();
        let app = self.app.clone();
        let mut health_shutdown = shutdown.clone();
        tokio::spawn(async move {
            reporter.set_service_status(HEALTH_SERVICES[0], ServingStatus::Serving).await;
            loop {
                let status = match app.readiness(&app.state().active.load()).0 {
                    200 => ServingStatus::Serving,
                    _ => ServingStatus::NotServing,
                };
                for name in &HEALTH_SERVICES[1..] {
                    reporter.set_service_status(*name, status).await;
                }
                tokio::select! {
                    _ = tokio::time::sleep(HEALTH_EVERY) => {}
                    _ = health_shutdown.changed() => return,
                }
            }
        });
        let picker = Picker { app: self.app.clone(), epp: self.epp.clone() };
        let service = ExternalProcessorServer::new(picker).max_decoding_message_size(MAX_MESSAGE_BYTES);
        let served = tonic::transport::Server::builder()
            .add_service(health)
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = shutdown.changed().await;
            })
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "epp: the gRPC server stopped");
        }
    }
}
