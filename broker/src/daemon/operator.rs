//! The operator socket's requests: status, cancel, restart, stop, the catalog, and the
//! approval queue (pending, show, decide, answer).

use super::denial::OperatorDenial;
use super::{Broker, Peer};
use crate::audit::Event;
use crate::audit::{Decision, Kind, Outcome};
use crate::ipc::proto::{self, OperatorRequest, Refusal};
use crate::mcp::elicit::FormAnswer;
use serde_json::{Value, json};
use std::time::Duration;

pub(super) async fn operator(
    broker: &Broker,
    peer: Peer,
    req: OperatorRequest,
) -> Result<Value, Refusal> {
    let not_found = || Refusal::from(OperatorDenial::UnknownServer);
    let control = |kind: Kind, server: &str| {
        broker.audit(Event {
            peer_uid: Some(peer.uid),
            peer_pid: peer.pid,
            server: Some(server.to_owned()),
            ..Event::new(kind, Decision::Allowed, Outcome::Ok)
        });
    };
    match req {
        OperatorRequest::Status(a) => {
            // What the file says now: a server removed from it is stopped and shown removed
            // (a file that does not load leaves the last good configuration in place).
            let _ = broker.registry.snapshot();
            let servers = broker
                .registry
                .status(a.server.as_deref())
                .ok_or_else(not_found)?;
            Ok(json!({
                "servers": servers,
                "interactive": broker.approvals.interactive(),
                "audit": broker.audit.state_json(),
            }))
        }
        OperatorRequest::Cancel(a) => {
            let n = broker.registry.cancel(&a.server).ok_or_else(not_found)?;
            control(Kind::OperatorCancel, &a.server);
            Ok(json!({"cancelled": n}))
        }
        OperatorRequest::Restart(a) => {
            broker
                .registry
                .restart(&a.server, false)
                .await
                .ok_or_else(not_found)?;
            control(Kind::OperatorRestart, &a.server);
            Ok(json!({}))
        }
        OperatorRequest::Stop(a) => {
            broker
                .registry
                .restart(&a.server, true)
                .await
                .ok_or_else(not_found)?;
            control(Kind::OperatorStop, &a.server);
            Ok(json!({}))
        }
        OperatorRequest::Logout(a) => {
            let outcome = broker
                .registry
                .logout_external(&a.server)
                .await
                .ok_or_else(not_found)?
                .map_err(OperatorDenial::LogoutFailed)?;
            control(Kind::OperatorLogout, &a.server);
            Ok(json!({"revoked": match outcome {
                crate::servers::ExternalLogout::NoRevokeUrl => "no_revoke_url",
                crate::servers::ExternalLogout::Revoked(r) => match r {
                    crate::oauth::Revoked::Revoked => "revoked",
                    crate::oauth::Revoked::NothingToRevoke => "nothing_to_revoke",
                    crate::oauth::Revoked::NotOffered => "no_revoke_url",
                    crate::oauth::Revoked::Failed => "failed",
                },
            }}))
        }
        OperatorRequest::Catalog => Ok(broker.catalog.snapshot_json()),
        OperatorRequest::Show(s) => broker.approvals.show(s.id, s.offset).map_err(|e| match e {
            crate::approvals::ShowError::NotWaiting => OperatorDenial::NoCallWaiting.into(),
            crate::approvals::ShowError::BadOffset { offset, len } => {
                OperatorDenial::BadOffset { offset, len }.into()
            }
        }),
        OperatorRequest::Pending(p) => {
            // Decoding refused anything over MAX_PENDING_WAIT_MS; the min only restates it.
            let wait = Duration::from_millis(p.wait_ms.min(proto::MAX_PENDING_WAIT_MS));
            Ok(json!({"pending": broker.approvals.list_wait(wait).await}))
        }
        OperatorRequest::Decide(d) => {
            // Each call is decided — and audited — on its own, also when several are named.
            if d.args_sha256.is_some() && (d.id.is_none() || !d.ids.is_empty()) {
                return Err(OperatorDenial::DigestNeedsOneId.into());
            }
            let mut decided = Vec::new();
            let mut missing = Vec::new();
            let mut last = crate::approvals::Decided::NotWaiting;
            for item in d.all() {
                // Deferred approval: a parked call is approved only with its digest.
                last = broker
                    .approvals
                    .decide_checked(item, d.approve, d.args_sha256.as_deref());
                broker.audit(Event {
                    peer_uid: Some(peer.uid),
                    peer_pid: peer.pid,
                    args_sha256: d
                        .args_sha256
                        .clone()
                        .filter(|x| iteron_policy::rules::Sha256Hex::parse(x).is_some()),
                    detail: Some(format!("pending item {item}")),
                    ..Event::new(
                        Kind::OperatorDecide,
                        if d.approve {
                            Decision::Approved
                        } else {
                            Decision::Denied
                        },
                        last.outcome(),
                    )
                });
                if last == crate::approvals::Decided::Done {
                    decided.push(item);
                } else {
                    missing.push(item);
                }
            }
            if d.id.is_some() && decided.is_empty() {
                Err(match last {
                    crate::approvals::Decided::DigestRequired => OperatorDenial::DigestRequired,
                    crate::approvals::Decided::DigestMismatch => OperatorDenial::DigestMismatch,
                    _ => OperatorDenial::NoCallWaiting,
                }
                .into())
            } else {
                Ok(json!({"decided": decided, "not_found": missing}))
            }
        }
        OperatorRequest::Answer(a) => {
            let answer = match a.action {
                proto::FormAction::Accept => FormAnswer::Accept(a.content),
                proto::FormAction::Decline => FormAnswer::Decline,
                proto::FormAction::Cancel => FormAnswer::Cancel,
            };
            let action = match &answer {
                FormAnswer::Accept(_) => Decision::Accepted,
                FormAnswer::Decline => Decision::Declined,
                FormAnswer::Cancel => Decision::Cancelled,
            };
            let result = broker.approvals.answer(a.id, answer);
            broker.audit(Event {
                peer_uid: Some(peer.uid),
                peer_pid: peer.pid,
                detail: Some(format!("form {}", a.id)),
                ..Event::new(
                    Kind::OperatorAnswer,
                    action,
                    if result.is_ok() {
                        Outcome::Ok
                    } else {
                        Outcome::Refused
                    },
                )
            });
            match result {
                Ok(()) => Ok(json!({})),
                Err(crate::approvals::AnswerError::NotWaiting) => {
                    Err(OperatorDenial::NoFormWaiting.into())
                }
                Err(crate::approvals::AnswerError::Invalid(why)) => {
                    Err(OperatorDenial::AnswerInvalid(why).into())
                }
            }
        }
        // The connection answers `hello` itself; refused rather than trusted if one ever
        // reached this point.
        OperatorRequest::Hello(_) => Err(OperatorDenial::NotAllowedHere.into()),
    }
}
