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

mod budget;
mod exchange;
pub(crate) mod protocol;

use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
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
    /// Streams open now, against `epp.max_streams`.
    open: Arc<AtomicUsize>,
}

/// One of `epp.max_streams`, held by a stream's task for its life, and shown in
/// `switchyard_epp_streams` while held.
pub(super) struct StreamSlot(Arc<AtomicUsize>, prometheus::IntGauge);

impl StreamSlot {
    /// A slot, unless `max` are taken.
    fn take(open: &Arc<AtomicUsize>, max: usize, gauge: &prometheus::IntGauge) -> Option<StreamSlot> {
        open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1)).ok()?;
        gauge.inc();
        Some(StreamSlot(open.clone(), gauge.clone()))
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
        self.1.dec();
    }
}

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let gauge = &self.app.state().metrics.epp_streams;
        let Some(slot) = StreamSlot::take(&self.open, self.epp.max_streams, gauge) else {
            return Err(Status::resource_exhausted("switchyard epp: epp.max_streams streams are open"));
        };
        // Answers go out in order; a few may wait while Envoy reads (the body echo).
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let (app, epp) = (self.app.clone(), self.epp.clone());
        tokio::spawn(async move {
            exchange::serve(app, epp, request.into_inner(), tx).await;
            drop(slot);
        });
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
        let picker = Picker { app: self.app.clone(), epp: self.epp.clone(), open: Arc::default() };
        let service = ExternalProcessorServer::new(picker).max_decoding_message_size(MAX_MESSAGE_BYTES);
        let max_streams = u32::try_from(self.epp.max_streams).unwrap_or(u32::MAX);
        let served = tonic::transport::Server::builder()
            .max_concurrent_streams(max_streams)
            .layer(budget::BudgetLayer { state: self.app.state().clone() })
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
