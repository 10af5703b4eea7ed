//! DNS answers judged whole against one binding zone: [`judge_answer`], and the
//! [`PinnedResolver`] reqwest connects through (see the module above for why).
#![forbid(unsafe_code)]

use super::*;

/// Judge every address of one answer for `host` under `binding`: refuse the whole answer if any
/// address is rejected or above the binding zone, or if the addresses span zones.
pub fn judge_answer(host: &str, binding: Zone, addrs: &[IpAddr]) -> Result<Zone, NetError> {
    if addrs.len() > MAX_ANSWER_ADDRESSES {
        return Err(NetError::TooManyAddresses { host: host.into() });
    }
    let mut first: Option<(IpAddr, Zone)> = None;
    for &addr in addrs {
        let z = zone::classify(addr).map_err(|kind| NetError::RejectedAddress {
            host: host.into(),
            addr,
            kind,
        })?;
        if !zone::may_reach(binding, z) {
            return Err(NetError::AboveZone {
                host: host.into(),
                addr,
                zone: z,
                binding,
            });
        }
        match first {
            None => first = Some((addr, z)),
            Some(f) if f.1 != z => {
                return Err(NetError::MixedZones {
                    host: host.into(),
                    first: f,
                    other: (addr, z),
                });
            }
            Some(_) => {}
        }
    }
    first.map(|f| f.1).ok_or_else(|| NetError::Resolve {
        host: host.into(),
        reason: "no addresses".into(),
    })
}

/// A DNS resolver whose every answer is judged against one binding zone before anyone may use
/// it. It implements reqwest's resolver interface, so the validated addresses are exactly the
/// ones reqwest connects to.
#[derive(Clone)]
pub struct PinnedResolver {
    inner: TokioResolver,
    binding: Zone,
}

impl PinnedResolver {
    /// A resolver over `dns` for clients bound to `binding`.
    pub fn new(dns: &Dns, binding: Zone) -> Result<PinnedResolver, NetError> {
        Ok(PinnedResolver {
            inner: build_hickory(dns)?,
            binding,
        })
    }

    pub(super) fn with_inner(inner: TokioResolver, binding: Zone) -> PinnedResolver {
        PinnedResolver { inner, binding }
    }

    /// The binding zone.
    pub fn binding(&self) -> Zone {
        self.binding
    }

    /// Resolve `host` and judge the whole answer. Returns the validated addresses in answer
    /// order.
    pub async fn resolve_checked(&self, host: &str) -> Result<Vec<IpAddr>, NetError> {
        let shown = text::single_line_capped(host, 253);
        // An absolute name: search domains from resolv.conf must not turn one name into another.
        let query = if host.ends_with('.') {
            host.to_owned()
        } else {
            format!("{host}.")
        };
        let lookup = self
            .inner
            .lookup_ip(query.as_str())
            .await
            .map_err(|e| NetError::Resolve {
                host: shown.clone(),
                reason: if e.is_nx_domain() || e.is_no_records_found() {
                    "no such name".into()
                } else {
                    text::single_line_capped(&e.to_string(), 160)
                },
            })?;
        let addrs: Vec<IpAddr> = lookup.iter().take(MAX_ANSWER_ADDRESSES + 1).collect();
        judge_answer(&shown, self.binding, &addrs)?;
        Ok(addrs)
    }
}

impl reqwest::dns::Resolve for PinnedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let me = self.clone();
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let addrs = me.resolve_checked(&host).await?;
            // Port 0 means "the URL's port" to reqwest.
            let out: reqwest::dns::Addrs =
                Box::new(addrs.into_iter().map(|ip| SocketAddr::new(ip, 0)));
            Ok(out)
        })
    }
}

pub(super) fn build_hickory(dns: &Dns) -> Result<TokioResolver, NetError> {
    let mut opts = ResolverOpts::default();
    let config = match dns {
        Dns::System => {
            let (config, system_opts) = hickory_resolver::system_conf::read_system_conf()
                .map_err(|e| NetError::DnsConfig(text::single_line_capped(&e.to_string(), 200)))?;
            opts = system_opts;
            opts.use_hosts_file = ResolveHosts::Always;
            config
        }
        Dns::Nameservers(servers) => {
            opts.use_hosts_file = ResolveHosts::Never;
            let list = servers
                .iter()
                .map(|s| {
                    let mut udp = ConnectionConfig::udp();
                    udp.port = s.port();
                    let mut tcp = ConnectionConfig::tcp();
                    tcp.port = s.port();
                    NameServerConfig::new(s.ip(), true, vec![udp, tcp])
                })
                .collect();
            ResolverConfig::from_name_servers(list)
        }
    };
    // Answers are never cached past their TTL, and a TTL of 0 is not raised: what is judged is
    // what the server said now.
    opts.positive_min_ttl = None;
    opts.attempts = opts.attempts.min(2);
    opts.timeout = opts.timeout.min(Duration::from_secs(5));
    let mut builder = TokioResolver::builder_with_config(config, TokioRuntimeProvider::default());
    *builder.options_mut() = opts;
    builder
        .build()
        .map_err(|e| NetError::DnsConfig(text::single_line_capped(&e.to_string(), 200)))
}
