#!/usr/bin/env python3
"""Iteron MCP conformance gate: runs the pinned official client conformance suite.

Every (protocol version, scenario) pair runs as its own suite invocation with its own
output directory:

    node <suite> client --command "<shim> <client>" --scenario S --spec-version V \
         -o <pair dir>/out --timeout MS

Extension scenarios marked "gate": true in scenarios.json run with the OAuth ones, once
each, under the pseudo-version "extension" and without --spec-version (they are off the
spec timeline; the suite picks their wire). Their cells are the report's "extensions"
section, one per scenario, checked against the document like the matrix.

The runner reads each pair's checks.json, collapses repeated check ids most-severe-first,
writes one JSON report (runs, checks, version x transport matrix, gate verdict) and exits

    0  the gate passes,
    1  the gate fails (the reasons are printed and stored in the report),
    2  the invocation or an input file is invalid (nothing is run or no report is written).

Usage:
    python3 run.py --client /abs/path/to/client --report out.json \
        [--baseline baseline.json] [--versions 2025-06-18,2025-11-25,2026-07-28] \
        [--scenarios a,b] [--include-auth] [--jobs 2] [--timeout-ms 30000] \
        [--work-dir DIR] [--write-expected-passing]

Python 3.11 standard library only. The suite and its Node 22 runtime come from
`npm ci` in this directory (package.json / package-lock.json).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as _dt
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUITE_PACKAGE = "@modelcontextprotocol/conformance"
REPORT_FORMAT = "iteron-mcp-conformance-report/1"

# Most severe first. The brief's order is FAILURE > WARNING > (SUCCESS, INFO, SKIPPED);
# the tail is ordered too so that a collapsed id is deterministic: an id that passed
# somewhere and was skipped elsewhere reads as passed.
SEVERITY = {"FAILURE": 0, "WARNING": 1, "SUCCESS": 2, "INFO": 3, "SKIPPED": 4}
FAILING = frozenset({"FAILURE", "WARNING"})
PASSING = frozenset({"SUCCESS", "INFO"})
SUMMARY_LIMIT = 300
OUTPUT_LIMIT = 4000
SCOPES = ("core", "auth", "extension")
MATRIX_KEY = {"core": "http", "auth": "http-oauth"}
# The pseudo-version of gated extension scenarios: the suite runs them off the spec timeline
# (no --spec-version; it picks the wire itself), and the report keeps them apart from the
# per-version matrix, in its "extensions" section.
EXTENSION = "extension"
# Problems a whole-scenario ("*") baseline entry may cover. Runner errors and a suite exit
# status that the checks do not explain ("suite-exit") are never covered.
SCENARIO_PROBLEMS = frozenset({"zero-checks", "no-success", "timeout", "client-exit", "check"})

ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]+")
LISTING_RE = re.compile(r"^\s*-\s+(\S+)\s+\[([^\]]*)\]\s*$")
CLIENT_EXIT_RE = re.compile(r"Client exited with code (-?\d+)")
CLIENT_TIMEOUT_RE = re.compile(r"Client timed out after (\d+)ms")
NOT_APPLICABLE_RE = re.compile(r"SKIPPED: scenario '[^']*' is not applicable")


class ConfigError(Exception):
    """An invalid invocation or input file; the runner exits 2."""


# --------------------------------------------------------------------------------------
# Text helpers


def one_line(text: str, limit: int = SUMMARY_LIMIT) -> str:
    """Single line, no ANSI or control characters, at most `limit` characters."""
    text = ANSI_RE.sub("", text)
    text = CONTROL_RE.sub(" ", text)
    text = " ".join(text.split())
    if len(text) > limit:
        text = text[: limit - 1].rstrip() + "\u2026"
    return text


def bounded(text: str, limit: int = OUTPUT_LIMIT) -> str:
    """Keep the head and the tail of a long output, with ANSI sequences removed."""
    text = ANSI_RE.sub("", text)
    if len(text) <= limit:
        return text
    half = limit // 2
    omitted = len(text) - 2 * half
    return f"{text[:half]}\n[... {omitted} characters omitted ...]\n{text[-half:]}"


def read_bounded(path: Path, limit: int = OUTPUT_LIMIT) -> str:
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size <= 4 * limit:
                data = fh.read()
            else:
                head = fh.read(2 * limit)
                fh.seek(size - 2 * limit)
                data = head + b"\n[...]\n" + fh.read()
    except OSError:
        return ""
    return bounded(data.decode("utf-8", "replace"), limit)


# --------------------------------------------------------------------------------------
# scenarios.json


def load_catalog(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read scenario catalog: {exc}") from exc
    return validate_catalog(doc, str(path))


def validate_catalog(doc, where: str = "scenarios.json") -> dict:
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: top level must be an object")
    suite = doc.get("suite")
    if not (isinstance(suite, dict) and suite.get("package") == SUITE_PACKAGE
            and isinstance(suite.get("version"), str) and suite["version"]):
        raise ConfigError(f"{where}: 'suite' must name {SUITE_PACKAGE} and a version")
    versions = doc.get("versions")
    if not (isinstance(versions, list) and versions
            and all(isinstance(v, str) and v for v in versions)
            and len(set(versions)) == len(versions)):
        raise ConfigError(f"{where}: 'versions' must be a non-empty list of distinct strings")
    rows = doc.get("scenarios")
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"{where}: 'scenarios' must be a non-empty list")
    scenarios: dict[str, dict] = {}
    for row in rows:
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: every scenario must be an object")
        sid = row.get("id")
        if not isinstance(sid, str) or not sid:
            raise ConfigError(f"{where}: scenario without an id")
        if sid in scenarios:
            raise ConfigError(f"{where}: duplicate scenario {sid!r}")
        if row.get("scope") not in SCOPES:
            raise ConfigError(f"{where}: {sid}: scope must be one of {', '.join(SCOPES)}")
        if row.get("transport") != "http":
            raise ConfigError(f"{where}: {sid}: transport must be 'http'")
        vers = row.get("versions")
        if not (isinstance(vers, list) and all(isinstance(v, str) and v for v in vers)):
            raise ConfigError(f"{where}: {sid}: versions must be a list of strings")
        if row["scope"] == "extension" and vers:
            raise ConfigError(f"{where}: {sid}: extension scenarios carry no versions")
        if row["scope"] != "extension" and not vers:
            raise ConfigError(f"{where}: {sid}: a non-extension scenario needs versions")
        if not isinstance(row.get("allow_client_error"), bool):
            raise ConfigError(f"{where}: {sid}: allow_client_error must be true or false")
        gate = row.get("gate", False)
        if not isinstance(gate, bool):
            raise ConfigError(f"{where}: {sid}: gate must be true or false")
        if gate and row["scope"] != "extension":
            raise ConfigError(f"{where}: {sid}: only extension scenarios carry 'gate' (the "
                              "others are gated by their versions)")
        extra = set(row) - {"id", "scope", "transport", "versions", "allow_client_error",
                            "gate"}
        if extra:
            raise ConfigError(f"{where}: {sid}: unknown keys {sorted(extra)}")
        scenarios[sid] = {
            "id": sid,
            "scope": row["scope"],
            "transport": "http",
            "versions": list(vers),
            "allow_client_error": row["allow_client_error"],
            "gate": gate,
        }
    return {"suite": dict(suite), "versions": list(versions), "scenarios": scenarios}


def applicable(catalog: dict, version: str, scenario: str) -> bool:
    meta = catalog["scenarios"].get(scenario)
    if meta and version == EXTENSION:
        return meta["gate"]
    return bool(meta) and version in catalog["versions"] and version in meta["versions"]


def gated_extensions(catalog: dict) -> list[dict]:
    """The extension scenarios the gate runs (scenarios.json order)."""
    return [m for m in catalog["scenarios"].values() if m["gate"]]


# --------------------------------------------------------------------------------------
# `list --client` drift


def parse_listing(text: str) -> dict[str, list[str]]:
    """Scenario -> versions from `conformance list --client`; extensions map to []."""
    found: dict[str, list[str]] = {}
    for line in ANSI_RE.sub("", text).splitlines():
        m = LISTING_RE.match(line)
        if not m:
            continue
        tags = [t.strip() for t in m.group(2).split(",") if t.strip()]
        found[m.group(1)] = [] if tags == ["extension"] else tags
    return found


def compare_listing(listing: dict[str, list[str]], catalog: dict) -> list[str]:
    """Differences between the installed suite's listing and scenarios.json."""
    if not listing:
        return ["suite listing: `list --client` printed no scenarios"]
    problems = []
    known = catalog["scenarios"]
    for sid, versions in listing.items():
        if sid not in known:
            problems.append(f"suite listing: scenario {sid} {versions or '[extension]'} "
                            "is not in scenarios.json")
        elif sorted(versions) != sorted(known[sid]["versions"]):
            problems.append(f"suite listing: scenario {sid} applies to "
                            f"{versions or '[extension]'} but scenarios.json says "
                            f"{known[sid]['versions'] or '[extension]'}")
    for sid in known:
        if sid not in listing:
            problems.append(f"suite listing: scenario {sid} from scenarios.json is missing "
                            "from the installed suite")
    return problems


# --------------------------------------------------------------------------------------
# Selection


def split_list(value: str | None) -> list[str] | None:
    if value is None:
        return None
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise ConfigError("an empty list was given")
    if len(set(items)) != len(items):
        raise ConfigError(f"duplicate entries in {value!r}")
    return items


def select_pairs(catalog: dict, versions: list[str] | None, scenarios: list[str] | None,
                 include_auth: bool) -> list[tuple[str, dict]]:
    """Ordered (version, scenario meta) pairs to run.

    Gated extension scenarios (all OAuth) run with the auth scenarios, once each, under the
    pseudo-version "extension"; `--versions` may name it like a version.
    """
    all_versions = catalog["versions"]
    known = list(all_versions) + [EXTENSION]
    versions = versions or known
    for v in versions:
        if v not in known:
            raise ConfigError(f"unknown version {v!r}; known: {', '.join(known)}")
    metas = catalog["scenarios"]
    if scenarios is not None:
        for sid in scenarios:
            if sid not in metas:
                raise ConfigError(f"unknown scenario {sid!r} (not in scenarios.json)")
            if metas[sid]["scope"] == "extension" and not metas[sid]["gate"]:
                raise ConfigError(f"scenario {sid!r} is an extension scenario the gate does "
                                  "not run (no \"gate\": true in scenarios.json)")
        chosen = [metas[s] for s in metas if s in scenarios]
    else:
        scopes = {"core", "auth", "extension"} if include_auth else {"core"}
        chosen = [m for m in metas.values() if m["scope"] in scopes]
    pairs = [(v, m) for v in versions for m in chosen
             if v in m["versions"] or (v == EXTENSION and m["gate"])]
    if scenarios is not None:
        hit = {m["id"] for _, m in pairs}
        for sid in scenarios:
            if sid not in hit:
                raise ConfigError(f"scenario {sid!r} applies to none of the selected "
                                  f"versions ({', '.join(versions)})")
    if not pairs:
        raise ConfigError("the selection contains no (version, scenario) pair")
    return pairs


# --------------------------------------------------------------------------------------
# checks.json


class CheckFileError(Exception):
    pass


def parse_checks(data) -> list[dict]:
    """Validate a decoded checks.json (a JSON array of ConformanceCheck objects)."""
    if not isinstance(data, list):
        raise CheckFileError("checks.json is not a JSON array")
    out = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise CheckFileError(f"checks.json entry {i} is not an object")
        cid = item.get("id")
        status = item.get("status")
        if not isinstance(cid, str) or not cid:
            raise CheckFileError(f"checks.json entry {i} has no id")
        if status not in SEVERITY:
            raise CheckFileError(f"checks.json entry {i} ({cid}) has unknown status {status!r}")
        out.append(item)
    return out


def summarize(check: dict) -> str:
    """Bounded single-line reason for a check that did not pass."""
    parts = []
    msg = check.get("errorMessage")
    if isinstance(msg, str) and msg.strip():
        parts.append(msg)
    else:
        desc = check.get("description")
        if isinstance(desc, str) and desc.strip():
            parts.append(desc)
        details = check.get("details")
        if details not in (None, {}, []):
            try:
                parts.append("details: " + json.dumps(details, sort_keys=True,
                                                      ensure_ascii=False))
            except (TypeError, ValueError):
                parts.append("details: " + str(details))
    return one_line(" | ".join(parts)) if parts else ""


def collapse_checks(raw: list[dict], version: str, transport: str,
                    scenario: str) -> list[dict]:
    """One record per check id, in first-seen order, with the most severe status."""
    order: list[str] = []
    groups: dict[str, list[dict]] = {}
    for item in raw:
        cid = item["id"]
        if cid not in groups:
            groups[cid] = []
            order.append(cid)
        groups[cid].append(item)
    out = []
    for cid in order:
        items = groups[cid]
        worst = min(items, key=lambda c: SEVERITY[c["status"]])
        counts: dict[str, int] = {}
        for c in items:
            counts[c["status"]] = counts.get(c["status"], 0) + 1
        summary = None
        if worst["status"] not in PASSING:
            summary = summarize(worst)
            same = counts[worst["status"]]
            if len(items) > 1:
                summary = one_line(f"({same} of {len(items)} {worst['status']}) {summary}")
        name = worst.get("name")
        variants = collapse_variants(items)
        out.append({
            "version": version,
            "transport": transport,
            "scenario": scenario,
            "id": cid,
            "name": name if isinstance(name, str) else "",
            "status": worst["status"],
            "summary": summary,
            "occurrences": len(items),
            "statuses": dict(sorted(counts.items(), key=lambda kv: SEVERITY[kv[0]])),
        })
        if len(variants) > 1:
            out[-1]["variants"] = variants
    return out


def collapse_variants(items: list[dict]) -> list[dict]:
    """Per distinct check name under one id: the most severe status, first-seen order.

    Several checks share one id and differ by name (for example one
    `sep-2243-client-includes-standard-headers` per HTTP method); the variants keep that
    detail, and expected_passing entries may name one.
    """
    order: list[str] = []
    worst: dict[str, str] = {}
    for c in items:
        name = c.get("name") if isinstance(c.get("name"), str) else ""
        if name not in worst:
            order.append(name)
            worst[name] = c["status"]
        elif SEVERITY[c["status"]] < SEVERITY[worst[name]]:
            worst[name] = c["status"]
    return [{"name": n, "status": worst[n]} for n in order]


def find_checks_files(out_dir: Path) -> list[Path]:
    if not out_dir.is_dir():
        return []
    return sorted(p for p in out_dir.rglob("checks.json") if p.is_file())


# --------------------------------------------------------------------------------------
# Baseline


def empty_baseline() -> dict:
    return {"expected_failures": [], "expected_passing": []}


def validate_baseline(doc, catalog: dict, where: str = "baseline") -> dict:
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: top level must be an object")
    extra = set(doc) - {"expected_failures", "expected_passing"}
    if extra:
        raise ConfigError(f"{where}: unknown keys {sorted(extra)}")
    fails = doc.get("expected_failures")
    passes = doc.get("expected_passing")
    if not isinstance(fails, list) or not isinstance(passes, list):
        raise ConfigError(f"{where}: 'expected_failures' and 'expected_passing' must be lists")

    def common(entry, kind, i, allowed):
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: {kind}[{i}] is not an object")
        unknown = set(entry) - allowed
        if unknown:
            raise ConfigError(f"{where}: {kind}[{i}] has unknown keys {sorted(unknown)}")
        for key in ("version", "scenario", "check"):
            if not isinstance(entry.get(key), str) or not entry[key].strip():
                raise ConfigError(f"{where}: {kind}[{i}] needs a non-empty {key!r}")
        if not applicable(catalog, entry["version"], entry["scenario"]):
            raise ConfigError(f"{where}: {kind}[{i}]: scenario {entry['scenario']!r} does not "
                              f"run at version {entry['version']!r} (see scenarios.json)")
        return (entry["version"], entry["scenario"], entry["check"])

    out_fails, seen = [], set()
    for i, entry in enumerate(fails):
        key = common(entry, "expected_failures", i, {"version", "scenario", "check", "reason"})
        reason = entry.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise ConfigError(f"{where}: expected_failures[{i}] ({'/'.join(key)}) needs a "
                              "non-empty reason")
        if key in seen:
            raise ConfigError(f"{where}: duplicate expected failure {'/'.join(key)}")
        seen.add(key)
        out_fails.append({"version": key[0], "scenario": key[1], "check": key[2],
                          "reason": reason.strip()})
    whole = {(v, s) for v, s, c in seen if c == "*"}
    for v, s, c in seen:
        if c != "*" and (v, s) in whole:
            raise ConfigError(f"{where}: {v}/{s}/{c} is already covered by the whole-scenario "
                              "entry '*'")

    out_passes, seen_p = [], set()
    for i, entry in enumerate(passes):
        key = common(entry, "expected_passing", i, {"version", "scenario", "check", "name"})
        if key[2] == "*":
            raise ConfigError(f"{where}: expected_passing[{i}] must name a check id, not '*'")
        name = entry.get("name")
        if "name" in entry and (not isinstance(name, str) or not name.strip()):
            raise ConfigError(f"{where}: expected_passing[{i}] has an empty 'name'")
        if key in seen or (key[0], key[1], "*") in seen:
            raise ConfigError(f"{where}: {'/'.join(key)} is listed both as expected failure "
                              "and as expected passing")
        full = key + (name,)
        if full in seen_p:
            raise ConfigError(f"{where}: duplicate expected passing {'/'.join(key)}"
                              + (f" ({name})" if name else ""))
        seen_p.add(full)
        item = {"version": key[0], "scenario": key[1], "check": key[2]}
        if name is not None:
            item["name"] = name
        out_passes.append(item)
    return {"expected_failures": out_fails, "expected_passing": out_passes}


def load_baseline(path: Path, catalog: dict) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read baseline: {exc}") from exc
    return validate_baseline(doc, catalog, str(path))


def format_baseline(baseline: dict) -> str:
    """Stable JSON text: one entry per line, sorted by version, scenario, check."""

    def key(e):
        return (e["version"], e["scenario"], e["check"], e.get("name") or "")

    def entry_line(e, keys):
        return "    " + json.dumps({k: e[k] for k in keys if k in e}, ensure_ascii=False)

    fails = sorted(baseline["expected_failures"], key=key)
    passes = sorted(baseline["expected_passing"], key=key)
    lines = ["{", '  "expected_failures": [']
    lines.append(",\n".join(entry_line(e, ("version", "scenario", "check", "reason"))
                            for e in fails))
    lines.append("  ],")
    lines.append('  "expected_passing": [')
    lines.append(",\n".join(entry_line(e, ("version", "scenario", "check", "name"))
                            for e in passes))
    lines.append("  ]")
    lines.append("}")
    return "\n".join(line for line in lines if line != "") + "\n"


def expected_passing_from_runs(runs: list[dict], old: list[dict],
                               failures: list[dict] = ()) -> list[dict]:
    """New expected_passing: passing checks of the runs, plus old entries for pairs not run.

    A passing id gets one entry; when its occurrences carry several names, each passing
    variant also gets an entry with its name, so that a variant that stops passing (for
    example a method whose headers are no longer exercised) is noticed. Checks that an
    expected failure still covers are left out (that entry is reported stale instead).
    """
    covered = {(e["version"], e["scenario"], e["check"]) for e in failures}
    ran = {(r["version"], r["scenario"]) for r in runs}
    kept = [e for e in old if (e["version"], e["scenario"]) not in ran]
    new = []
    for r in runs:
        for c in r["checks"]:
            if c["status"] not in PASSING:
                continue
            if ((c["version"], c["scenario"], c["id"]) in covered
                    or (c["version"], c["scenario"], "*") in covered):
                continue
            base = {"version": c["version"], "scenario": c["scenario"], "check": c["id"]}
            new.append(dict(base))
            for var in c.get("variants", []):
                if var["status"] in PASSING and var["name"]:
                    new.append({**base, "name": var["name"]})
    return kept + new


# --------------------------------------------------------------------------------------
# Verdict


def _problem(kind: str, detail: str, check: str | None = None) -> dict:
    return {"kind": kind, "check": check, "detail": detail, "baselined": False,
            "baseline_reason": None}


def evaluate(runs: list[dict], baseline: dict) -> list[str]:
    """Annotate runs with their problems and return the gate's failure reasons.

    Each run needs: version, transport, scenario, allow_client_error, runner_error,
    timed_out, client_exit_code, checks (collapsed). Adds run["problems"] and
    check["baselined"]. Baseline entries and expected passes for pairs that were not run
    are ignored (a partial run says so in the report).
    """
    fails = {(e["version"], e["scenario"], e["check"]): e
             for e in baseline["expected_failures"]}
    used: set[tuple] = set()
    reasons: list[str] = []
    by_pair = {(r["version"], r["scenario"]): r for r in runs}

    for run in runs:
        v, s = run["version"], run["scenario"]
        problems: list[dict] = []
        for check in run["checks"]:
            check["baselined"] = False
        if run.get("runner_error"):
            problems.append(_problem("runner-error", run["runner_error"]))
        else:
            if not run["checks"]:
                problems.append(_problem("zero-checks", "the scenario produced no checks"))
            elif all(ch["status"] in ("SKIPPED", "INFO") for ch in run["checks"]):
                # e.g. http-standard-headers with a client that sends nothing: all SKIPPED.
                problems.append(_problem("no-success", "every check is SKIPPED or INFO; "
                                         "the scenario produced no evidence"))
            if run.get("timed_out"):
                problems.append(_problem("timeout", "the client timed out"))
            code = run.get("client_exit_code")
            # A client stopped because it timed out is reported as a timeout only.
            if (code not in (None, 0) and not run.get("allow_client_error")
                    and not run.get("timed_out")):
                sig = run.get("client_signal")
                how = f"signal {sig}" if sig else f"code {code}"
                problems.append(_problem("client-exit", f"the client exited with {how}"))
            for check in run["checks"]:
                if check["status"] in FAILING:
                    text = f"{check['status']} {check['id']}"
                    if check.get("summary"):
                        text += f": {check['summary']}"
                    problems.append(_problem("check", text, check["id"]))
            if not problems and run.get("exit_code") not in (None, 0):
                # The suite saw a failure that its checks.json does not explain.
                problems.append(_problem("suite-exit", f"the suite exited {run['exit_code']} "
                                         "although no check failed"))
        whole = fails.get((v, s, "*"))
        for p in problems:
            entry = None
            if p["kind"] in SCENARIO_PROBLEMS and whole:
                entry = whole
            elif p["kind"] == "check":
                entry = fails.get((v, s, p["check"]))
            if entry:
                p["baselined"] = True
                p["baseline_reason"] = entry["reason"]
                used.add((entry["version"], entry["scenario"], entry["check"]))
                if p["check"]:
                    for check in run["checks"]:
                        if check["id"] == p["check"]:
                            check["baselined"] = True
        run["problems"] = problems
        for p in problems:
            if not p["baselined"]:
                reasons.append(f"{v} {s}: {p['kind']}: {p['detail']}")

    # Stale expected failures: listed, run, and no longer failing.
    for key, entry in fails.items():
        v, s, c = key
        run = by_pair.get((v, s))
        if run is None or run.get("runner_error") or key in used:
            continue
        if c == "*":
            reasons.append(f"{v} {s}: stale baseline entry '*' (the whole scenario now passes; "
                           "remove it from baseline.json)")
        else:
            status = next((ch["status"] for ch in run["checks"] if ch["id"] == c), "absent")
            reasons.append(f"{v} {s}: stale baseline entry {c} (now {status}; remove it from "
                           "baseline.json)")

    # Expected passes that regressed or disappeared.
    for entry in baseline["expected_passing"]:
        v, s, c = entry["version"], entry["scenario"], entry["check"]
        name = entry.get("name")
        run = by_pair.get((v, s))
        if run is None:
            continue
        check = next((ch for ch in run["checks"] if ch["id"] == c), None)
        status = None if check is None else check["status"]
        label = c
        if name is not None and check is not None:
            variants = check.get("variants") or [{"name": check["name"],
                                                  "status": check["status"]}]
            status = next((var["status"] for var in variants if var["name"] == name), None)
            label = f"{c} ({name})"
        elif name is not None:
            label = f"{c} ({name})"
        if status not in PASSING:
            detail = (f"expected passing check {label} is "
                      f"{'missing' if status is None else status}")
            run["problems"].append(_problem("missing-expected-pass", detail, c))
            reasons.append(f"{v} {s}: {detail}")
    return reasons


def compute_matrix(runs: list[dict], scopes: dict[str, str]) -> dict:
    """version -> matrix key -> cell. Runs must be annotated by evaluate().

    `scopes` maps scenario id -> scope; core scenarios count under "http", auth
    scenarios under "http-oauth".
    passed = SUCCESS + INFO, unsupported = SKIPPED, baselined = FAILURE/WARNING covered by
    the baseline, failed = the other FAILURE/WARNING, total = all collapsed checks.
    """
    cells: dict[str, dict[str, dict]] = {}
    for run in runs:
        key = MATRIX_KEY.get(scopes.get(run["scenario"], "core"), "http-oauth")
        cell = cells.setdefault(run["version"], {}).setdefault(key, {
            "status": None, "passed": 0, "total": 0, "unsupported": 0, "failed": 0,
            "baselined": 0, "scenarios": 0, "_blocked": False, "_fail": False})
        cell["scenarios"] += 1
        for check in run["checks"]:
            cell["total"] += 1
            if check["status"] in PASSING:
                cell["passed"] += 1
            elif check["status"] == "SKIPPED":
                cell["unsupported"] += 1
            elif check.get("baselined"):
                cell["baselined"] += 1
            else:
                cell["failed"] += 1
        for p in run.get("problems", []):
            if p["kind"] == "runner-error":
                cell["_blocked"] = True
            elif not p["baselined"]:
                cell["_fail"] = True
    for per_version in cells.values():
        for cell in per_version.values():
            if cell.pop("_blocked") or cell["total"] == 0:
                status = "blocked"
                cell.pop("_fail")
            elif cell.pop("_fail"):
                status = "fail"
            elif cell["passed"] == 0 and cell["unsupported"] == cell["total"]:
                status = "unsupported"
            else:
                status = "pass"
            cell["status"] = status
    return cells


def build_report(*, catalog: dict, runs: list[dict], reasons: list[str], selection: dict,
                 extra: dict | None = None) -> dict:
    scopes = {sid: m["scope"] for sid, m in catalog["scenarios"].items()}
    order = {v: i for i, v in enumerate(catalog["versions"] + [EXTENSION])}
    scen_order = {sid: i for i, sid in enumerate(catalog["scenarios"])}
    runs = sorted(runs, key=lambda r: (order.get(r["version"], 99),
                                       scen_order.get(r["scenario"], 999)))
    matrix = compute_matrix([r for r in runs if r["version"] != EXTENSION], scopes)
    # One cell per gated extension scenario, counted like a matrix cell of its own.
    extensions = {}
    for r in runs:
        if r["version"] == EXTENSION:
            extensions[r["scenario"]] = compute_matrix([r], scopes)[EXTENSION]["http-oauth"]
    report = {
        "format": REPORT_FORMAT,
        "suite": {"package": catalog["suite"]["package"],
                  "version": catalog["suite"]["version"]},
        "selection": selection,
        "runs": runs,
        "matrix": {v: matrix[v] for v in sorted(matrix, key=lambda v: order.get(v, 99))},
        "extensions": {sid: extensions[sid] for sid in catalog["scenarios"] if sid in extensions},
        "gate": {"verdict": "fail" if reasons else "pass", "reasons": reasons},
    }
    if extra:
        report.update(extra)
    return report


# --------------------------------------------------------------------------------------
# Execution


def suite_paths() -> tuple[Path, Path, Path]:
    """(node, suite entry script, suite package.json) inside this directory."""
    node = HERE / "node_modules" / ".bin" / "node"
    pkg_dir = HERE / "node_modules" / "@modelcontextprotocol" / "conformance"
    pkg_json = pkg_dir / "package.json"
    if not node.exists() or not pkg_json.exists():
        raise ConfigError(f"the suite is not installed: run `npm ci` in {HERE}")
    try:
        pkg = json.loads(pkg_json.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{pkg_json}: {exc}") from exc
    bin_field = pkg.get("bin")
    rel = bin_field.get("conformance") if isinstance(bin_field, dict) else bin_field
    if not isinstance(rel, str):
        raise ConfigError(f"{pkg_json}: no 'conformance' bin entry")
    return node, (pkg_dir / rel).resolve(), pkg_json


def tool_output(argv: list[str], timeout_s: float, env: dict) -> tuple[int, str, str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env,
                          stdin=subprocess.DEVNULL, check=False)
    return proc.returncode, proc.stdout, proc.stderr


def suite_env() -> dict:
    env = dict(os.environ)
    env["NO_COLOR"] = "1"
    env["FORCE_COLOR"] = "0"
    return env


def preflight(catalog: dict, env: dict) -> tuple[Path, Path, dict, list[str]]:
    """Check the installed suite and runtime; return node, entry, facts, listing drift."""
    node, entry, pkg_json = suite_paths()
    pkg = json.loads(pkg_json.read_text(encoding="utf-8"))
    want = catalog["suite"]["version"]
    if pkg.get("version") != want:
        raise ConfigError(f"installed {SUITE_PACKAGE} is {pkg.get('version')}, scenarios.json "
                          f"pins {want}: run `npm ci` in {HERE}")
    try:
        rc, out, err = tool_output([str(node), "--version"], 60, env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"cannot run {node}: {exc}") from exc
    node_version = out.strip()
    if rc != 0 or not node_version.startswith("v22."):
        raise ConfigError(f"{node} must be Node 22 (got {node_version or err.strip()!r}); "
                          f"run `npm ci` in {HERE} without --ignore-scripts")
    try:
        rc, out, err = tool_output([str(node), str(entry), "--version"], 120, env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"cannot start the suite: {exc}") from exc
    if rc != 0 or out.strip() != want:
        raise ConfigError(f"suite --version printed {out.strip()!r} (exit {rc}): "
                          f"{one_line(err, 500)}")
    try:
        rc, out, err = tool_output([str(node), str(entry), "list", "--client"], 120, env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"`list --client` failed: {exc}") from exc
    drift = compare_listing(parse_listing(out), catalog) if rc == 0 else [
        f"suite listing: `list --client` exited {rc}: {one_line(err)}"]
    return node, entry, {"node": node_version, "suite_entry": str(entry)}, drift


def shim_command(client: str, client_args: list[str], status_file: Path,
                 deadline_ms: int) -> str:
    """The --command string. The suite splits it on spaces, re-joins it and runs it
    through `sh -c`, so shell quoting survives; it appends the URL as the last word."""
    parts = [sys.executable, str(HERE / "client_shim.py"), "--status", str(status_file),
             "--deadline-ms", str(deadline_ms), "--", client, *client_args]
    return " ".join(shlex.quote(p) for p in parts)


def pair_dir_name(version: str, scenario: str) -> str:
    return f"{version}__{re.sub(r'[^A-Za-z0-9._-]', '_', scenario)}"


def kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 3), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_pair(*, node: Path, entry: Path, version: str, meta: dict, client: str,
             client_args: list[str], timeout_ms: int, work: Path, env: dict) -> dict:
    scenario = meta["id"]
    pdir = work / pair_dir_name(version, scenario)
    out_dir = pdir / "out"
    out_dir.mkdir(parents=True, exist_ok=False)
    status_file = pdir / "client-status.json"
    stdout_file, stderr_file = pdir / "suite.stdout", pdir / "suite.stderr"
    command = shim_command(client, client_args, status_file, timeout_ms + 2000)
    argv = [str(node), str(entry), "client", "--command", command, "--scenario", scenario]
    if version != EXTENSION:
        argv += ["--spec-version", version]
    argv += ["-o", str(out_dir), "--timeout", str(timeout_ms)]
    run = {
        "version": version,
        "transport": meta["transport"],
        "scenario": scenario,
        "scope": meta["scope"],
        "allow_client_error": meta["allow_client_error"],
        "exit_code": None,
        "timed_out": False,
        "client_exit_code": None,
        "client_signal": None,
        "runner_error": None,
        "duration_ms": None,
        "raw_check_count": 0,
        "checks": [],
    }
    watchdog_s = timeout_ms / 1000 + 60
    started = time.monotonic()
    with open(stdout_file, "wb") as so, open(stderr_file, "wb") as se:
        try:
            proc = subprocess.Popen(argv, stdout=so, stderr=se, stdin=subprocess.DEVNULL,
                                    cwd=pdir, env=env, start_new_session=True)
        except OSError as exc:
            run["runner_error"] = f"cannot start the suite: {exc}"
            return run
        try:
            run["exit_code"] = proc.wait(timeout=watchdog_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            run["exit_code"] = proc.returncode
            run["runner_error"] = (f"the suite process did not finish within the runner "
                                   f"watchdog ({watchdog_s:.0f} s) and was killed")
        else:
            # Processes left in the suite's own group (never the client's) are ended.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    run["duration_ms"] = int((time.monotonic() - started) * 1000)
    suite_out = read_bounded(stdout_file)
    suite_err = read_bounded(stderr_file, 4 * OUTPUT_LIMIT)
    run["output"] = {"suite_stdout": bounded(suite_out), "suite_stderr": bounded(suite_err)}

    status = None
    try:
        status = json.loads(status_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        status = None
    m = CLIENT_EXIT_RE.search(suite_err)
    suite_client_code = int(m.group(1)) if m else None
    suite_timed_out = bool(CLIENT_TIMEOUT_RE.search(suite_err))
    if isinstance(status, dict):
        run["client_exit_code"] = status.get("exit_code")
        run["client_signal"] = status.get("signal")
        run["client"] = {k: status.get(k) for k in
                         ("wall_ms", "stop_reason", "spawn_error", "leftover_processes")}
        # The shim only stops a client when the suite's timeout fired (the shell that
        # started it was killed), on a forwarded signal, or at its own deadline.
        stopped = bool(status.get("stop_reason"))
    else:
        run["client_exit_code"] = suite_client_code
        stopped = False
    run["timed_out"] = suite_timed_out or stopped

    if run["runner_error"]:
        return run
    files = find_checks_files(out_dir)
    if not files:
        if NOT_APPLICABLE_RE.search(suite_out):
            run["runner_error"] = ("the suite skipped the scenario as not applicable at this "
                                   "version (scenarios.json disagrees with the suite)")
        else:
            run["runner_error"] = (f"no checks.json under the output directory (suite exit "
                                   f"{run['exit_code']}): {one_line(suite_err, 200)}")
        return run
    if len(files) > 1:
        run["runner_error"] = f"{len(files)} checks.json files in one scenario's output"
        return run
    try:
        raw = parse_checks(json.loads(files[0].read_text(encoding="utf-8")))
    except (OSError, ValueError, CheckFileError) as exc:
        run["runner_error"] = f"unreadable checks.json: {one_line(str(exc), 200)}"
        return run
    run["raw_check_count"] = len(raw)
    run["checks"] = collapse_checks(raw, version, meta["transport"], scenario)
    res_dir = files[0].parent
    run["output"]["client_stdout"] = read_bounded(res_dir / "stdout.txt", OUTPUT_LIMIT // 2)
    run["output"]["client_stderr"] = read_bounded(res_dir / "stderr.txt", OUTPUT_LIMIT // 2)
    return run


def run_all(pairs, *, node, entry, client, client_args, timeout_ms, jobs, work, env,
            progress=None) -> list[dict]:
    runs = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_pair, node=node, entry=entry, version=v, meta=m,
                               client=client, client_args=client_args,
                               timeout_ms=timeout_ms, work=work, env=env): (v, m["id"])
                   for v, m in pairs}
        for fut in concurrent.futures.as_completed(futures):
            v, sid = futures[fut]
            try:
                run = fut.result()
            except Exception as exc:  # a bug in the runner must still fail the gate
                meta = next(m for pv, m in pairs if pv == v and m["id"] == sid)
                run = {"version": v, "transport": meta["transport"], "scenario": sid,
                       "scope": meta["scope"], "allow_client_error": meta["allow_client_error"],
                       "exit_code": None, "timed_out": False, "client_exit_code": None,
                       "client_signal": None, "duration_ms": None, "raw_check_count": 0,
                       "checks": [], "runner_error": f"runner exception: {exc!r}"}
            if progress:
                progress(run)
            runs.append(run)
    order = {(v, m["id"]): i for i, (v, m) in enumerate(pairs)}
    return sorted(runs, key=lambda r: order[(r["version"], r["scenario"])])


# --------------------------------------------------------------------------------------
# CLI


def parse_cli(argv):
    p = argparse.ArgumentParser(
        description="Run the pinned official MCP client conformance suite against a client "
                    "and gate on the result.")
    p.add_argument("--client", required=True,
                   help="absolute path of the conformance client executable")
    p.add_argument("--client-arg", action="append", default=[],
                   help="extra argument placed before the URL (repeatable)")
    p.add_argument("--report", required=True, help="where to write the JSON report")
    p.add_argument("--baseline", help="reviewed baseline JSON (expected failures / passes)")
    p.add_argument("--versions", help="comma-separated protocol versions, and/or 'extension' "
                                      "for the gated extension scenarios (default: all)")
    p.add_argument("--scenarios", help="comma-separated scenario ids (default: every core "
                                       "scenario; auth ones with --include-auth)")
    p.add_argument("--include-auth", action="store_true",
                   help="also run the OAuth scenarios (scope 'auth', and the extension "
                        "scenarios marked \"gate\": true)")
    p.add_argument("--jobs", type=int, default=2, help="parallel suite invocations (default 2)")
    p.add_argument("--timeout-ms", type=int, default=30000,
                   help="per-scenario client timeout passed to the suite (default 30000)")
    p.add_argument("--work-dir", help="keep raw per-scenario output here (must not exist)")
    p.add_argument("--write-expected-passing", action="store_true",
                   help="rewrite expected_passing in --baseline from this run (review the diff)")
    p.add_argument("--catalog", default=str(HERE / "scenarios.json"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.jobs < 1 or args.jobs > 16:
        p.error("--jobs must be between 1 and 16")
    if args.timeout_ms < 1000 or args.timeout_ms > 600000:
        p.error("--timeout-ms must be between 1000 and 600000")
    if args.write_expected_passing and not args.baseline:
        p.error("--write-expected-passing needs --baseline")
    return args


def check_client(path: str) -> None:
    if not os.path.isabs(path):
        raise ConfigError(f"--client must be an absolute path, got {path!r}")
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise ConfigError(f"--client {path!r} is not an executable file")


def write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def describe_run(run: dict) -> str:
    counts: dict[str, int] = {}
    for c in run["checks"]:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    text = " ".join(f"{k}={counts[k]}" for k in sorted(counts, key=SEVERITY.get)) or "no checks"
    extra = []
    if run.get("runner_error"):
        extra.append("RUNNER ERROR")
    if run.get("timed_out"):
        extra.append("timed out")
    if run.get("client_exit_code") not in (None, 0):
        extra.append(f"client exit {run['client_exit_code']}")
    secs = (run.get("duration_ms") or 0) / 1000
    tail = f" [{', '.join(extra)}]" if extra else ""
    return f"{run['version']} {run['scenario']}: {text}{tail} ({secs:.1f} s)"


def main(argv=None) -> int:
    args = parse_cli(argv)
    try:
        catalog = load_catalog(Path(args.catalog))
        check_client(args.client)
        versions = split_list(args.versions)
        scenarios = split_list(args.scenarios)
        pairs = select_pairs(catalog, versions, scenarios, args.include_auth)
        baseline = load_baseline(Path(args.baseline), catalog) if args.baseline \
            else empty_baseline()
        env = suite_env()
        node, entry, facts, drift = preflight(catalog, env)
        if args.work_dir:
            work = Path(args.work_dir).resolve()
            if work.exists():
                raise ConfigError(f"--work-dir {work} already exists")
            work.mkdir(parents=True)
            cleanup = False
        else:
            work = Path(tempfile.mkdtemp(prefix="iteron-mcp-conformance-"))
            cleanup = True
    except ConfigError as exc:
        print(f"run.py: error: {exc}", file=sys.stderr)
        return 2

    print(f"{SUITE_PACKAGE}@{catalog['suite']['version']} on node {facts['node']}: "
          f"{len(pairs)} scenario runs, {args.jobs} at a time", file=sys.stderr)
    started = time.monotonic()
    try:
        runs = run_all(pairs, node=node, entry=entry, client=args.client,
                       client_args=args.client_arg, timeout_ms=args.timeout_ms,
                       jobs=args.jobs, work=work, env=env,
                       progress=lambda r: print("  " + describe_run(r), file=sys.stderr))
    finally:
        if cleanup:
            shutil.rmtree(work, ignore_errors=True)
    wall_ms = int((time.monotonic() - started) * 1000)

    notes = []
    if args.write_expected_passing:
        if any(r.get("runner_error") for r in runs):
            notes.append("expected_passing NOT rewritten: some runs had runner errors")
        else:
            old = baseline["expected_passing"]
            new = expected_passing_from_runs(runs, old, baseline["expected_failures"])
            as_keys = lambda es: {(e["version"], e["scenario"], e["check"]) for e in es}
            added, removed = as_keys(new) - as_keys(old), as_keys(old) - as_keys(new)
            baseline = {"expected_failures": baseline["expected_failures"],
                        "expected_passing": new}
            Path(args.baseline).write_text(format_baseline(baseline), encoding="utf-8")
            notes.append(f"expected_passing rewritten in {args.baseline}: "
                         f"+{len(added)} -{len(removed)} (review the diff)")

    reasons = [f"runner error: {d}" for d in drift] + evaluate(runs, baseline)
    all_versions = catalog["versions"]
    selection = {
        "versions": versions or list(all_versions),
        "scenarios": scenarios,
        "include_auth": args.include_auth,
        "partial": bool(scenarios) or (versions is not None
                                      and sorted(versions) != sorted(all_versions + [EXTENSION])),
        "timeout_ms": args.timeout_ms,
        "jobs": args.jobs,
    }
    extra = {
        "generated_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "runtime": {"node": facts["node"], "wall_ms": wall_ms},
        "client": {"path": args.client, "args": args.client_arg},
        "baseline": {"path": args.baseline,
                     "expected_failures": len(baseline["expected_failures"]),
                     "expected_passing": len(baseline["expected_passing"])}
        if args.baseline else None,
        "suite_listing_drift": drift,
    }
    report = build_report(catalog=catalog, runs=runs, reasons=reasons, selection=selection,
                          extra=extra)
    write_json(Path(args.report), report)

    for v, per in report["matrix"].items():
        for key, cell in per.items():
            print(f"{v} {key}: {cell['status']} ({cell['passed']}/{cell['total']}; "
                  f"unsupported={cell['unsupported']} baselined={cell['baselined']} "
                  f"failed={cell['failed']})")
    for sid, cell in report["extensions"].items():
        print(f"{EXTENSION} {sid}: {cell['status']} ({cell['passed']}/{cell['total']}; "
              f"unsupported={cell['unsupported']} baselined={cell['baselined']} "
              f"failed={cell['failed']})")
    for note in notes:
        print(note, file=sys.stderr)
    if selection["partial"]:
        print("note: partial selection; expected passes and baseline entries of pairs that "
              "were not run are not checked", file=sys.stderr)
    print(f"report: {args.report} (wall {wall_ms / 1000:.1f} s)", file=sys.stderr)
    if reasons:
        print(f"GATE FAILED: {len(reasons)} reason(s)", file=sys.stderr)
        for r in reasons:
            print(f"  - {r}", file=sys.stderr)
        return 1
    print("GATE PASSED", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
