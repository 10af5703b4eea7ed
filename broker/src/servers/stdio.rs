//! Where and how a stdio server runs: its spawn context and its confinement.

use iteron_policy::config::ServerConfig;

/// Where stdio servers run: the operator home their confinement denies, and the host ceiling
/// (a server admitted `web_egress` may open IPv4/IPv6 sockets).
#[derive(Debug, Clone)]
pub struct SpawnContext {
    /// `$ITERON_HOME`.
    pub home: std::path::PathBuf,
    /// The host ceiling.
    pub ceiling: iteron_policy::capability::CapabilitySet,
    /// Where a `web_egress` server's refused destinations are counted and audited (`None`:
    /// counted for that one start only).
    pub egress: Option<std::sync::Arc<crate::egress::Observer>>,
}

/// The confinement of a stdio server: the home denied; what its `sandbox` block grants;
/// network only when its admitted classes include `web_egress` (through the broker's egress
/// path unless `sandbox.network` is `host`; `sandbox.egress` names what it may reach above the
/// public zone); its limits or the defaults; its `run_as` (default `nobody` under a root
/// broker).
pub fn stdio_confinement(
    server: &ServerConfig,
    st: &iteron_policy::config::StdioServer,
    ctx: &SpawnContext,
) -> crate::confine::Spec {
    use iteron_policy::capability::Capability;
    let admitted = match server.policy.capabilities {
        Some(p) => ctx.ceiling.intersect(p),
        None => ctx.ceiling,
    };
    let paths = |v: &[iteron_policy::config::AbsolutePath]| {
        v.iter()
            .map(|p| std::path::PathBuf::from(p.as_str()))
            .collect()
    };
    crate::confine::Spec {
        deny: vec![ctx.home.clone()],
        readable: paths(&st.sandbox.readable),
        writable: paths(&st.sandbox.writable),
        network: admitted.contains(Capability::WebEgress),
        open_files: st
            .sandbox
            .max_open_files
            .unwrap_or(crate::confine::DEFAULT_OPEN_FILES),
        data_bytes: st
            .sandbox
            .max_memory_mb
            .map_or(crate::confine::DEFAULT_DATA_BYTES, |mb| mb << 20),
        processes: st.sandbox.max_processes,
        run_as: st.sandbox.run_as.unwrap_or_default(),
        net_mode: st.sandbox.network.unwrap_or_default(),
        egress: st.sandbox.egress.clone(),
    }
}
