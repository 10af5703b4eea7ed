"""Tests for run.py and check_document.py (python3 -m unittest test_runner.py).

Pure parts are tested on synthetic checks.json fixtures (fixtures/checks/); the process
plumbing (client shim, output discovery, exit codes, timeouts) is tested against
fixtures/fake_suite.py, so no Node or network is needed.
"""

import io
import json
import os
import sys
import tempfile
import time
import unittest
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import check_document  # noqa: E402
import run  # noqa: E402

FIXTURES = HERE / "fixtures"
CHECKS = FIXTURES / "checks"
CATALOG = run.load_catalog(HERE / "scenarios.json")
V6, V11, V26 = "2025-06-18", "2025-11-25", "2026-07-28"
EXT = run.EXTENSION
GATED = ["auth/client-credentials-jwt", "auth/client-credentials-basic",
         "auth/enterprise-managed-authorization", "auth/dpop", "auth/dpop-nonce",
         "auth/wif-jwt-bearer"]


def fixture_checks(name):
    return run.parse_checks(json.loads((CHECKS / name).read_text(encoding="utf-8")))


def make_run(version, scenario, fixture=None, **overrides):
    meta = CATALOG["scenarios"][scenario]
    raw = fixture_checks(fixture) if fixture else []
    result = {
        "version": version, "transport": "http", "scenario": scenario,
        "scope": meta["scope"], "allow_client_error": meta["allow_client_error"],
        "exit_code": 0, "timed_out": False, "client_exit_code": 0, "client_signal": None,
        "runner_error": None, "duration_ms": 10, "raw_check_count": len(raw),
        "checks": run.collapse_checks(raw, version, "http", scenario),
    }
    result.update(overrides)
    return result


def baseline(fails=(), passes=()):
    return run.validate_baseline({"expected_failures": list(fails),
                                  "expected_passing": list(passes)}, CATALOG)


def quiet(fn, *args, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = fn(*args, **kwargs)
    return code, out.getvalue(), err.getvalue()


class CollapseTests(unittest.TestCase):
    def test_most_severe_first_and_first_seen_order(self):
        checks = run.collapse_checks(fixture_checks("duplicates.json"), V26, "http",
                                     "http-standard-headers")
        self.assertEqual([c["id"] for c in checks],
                         ["sep-2243-client-includes-standard-headers", "request-log",
                          "per-param"])
        by_id = {c["id"]: c for c in checks}
        self.assertEqual(by_id["per-param"]["status"], "FAILURE")  # FAILURE beats WARNING
        self.assertEqual(by_id["per-param"]["name"], "Param_c")
        self.assertEqual(by_id["per-param"]["occurrences"], 3)
        self.assertEqual(by_id["per-param"]["statuses"],
                         {"FAILURE": 1, "WARNING": 1, "SUCCESS": 1})
        self.assertTrue(by_id["per-param"]["summary"].startswith("(1 of 3 FAILURE) c was"))
        # SUCCESS and SKIPPED under one id read as SUCCESS; INFO-only stays INFO.
        self.assertEqual(by_id["sep-2243-client-includes-standard-headers"]["status"],
                         "SUCCESS")
        self.assertIsNone(by_id["sep-2243-client-includes-standard-headers"]["summary"])
        self.assertEqual(by_id["request-log"]["status"], "INFO")

    def test_warning_beats_success(self):
        raw = [{"id": "x", "name": "a", "status": "SUCCESS"},
               {"id": "x", "name": "a", "status": "WARNING", "errorMessage": "slow"},
               {"id": "x", "name": "a", "status": "SKIPPED"}]
        (check,) = run.collapse_checks(run.parse_checks(raw), V11, "http", "sse-retry")
        self.assertEqual(check["status"], "WARNING")
        self.assertNotIn("variants", check)  # one distinct name

    def test_variants_keep_names(self):
        checks = run.collapse_checks(fixture_checks("duplicates.json"), V26, "http",
                                     "http-standard-headers")
        variants = checks[0]["variants"]
        self.assertEqual(variants, [
            {"name": "ClientMcpMethodHeader_tools_call", "status": "SUCCESS"},
            {"name": "ClientMcpMethodHeader_initialize", "status": "SKIPPED"},
            {"name": "ClientMcpMethodHeader_tools_list", "status": "SUCCESS"}])

    def test_every_check_carries_its_coordinates(self):
        for c in run.collapse_checks(fixture_checks("tools_call-fail.json"), V6, "http",
                                     "tools_call"):
            self.assertEqual((c["version"], c["transport"], c["scenario"]),
                             (V6, "http", "tools_call"))
            self.assertTrue({"id", "name", "status", "summary"} <= set(c))

    def test_summary_is_bounded_single_line(self):
        checks = run.collapse_checks(fixture_checks("tools_call-fail.json"), V6, "http",
                                     "tools_call")
        warn = checks[1]
        self.assertEqual(warn["status"], "WARNING")
        self.assertLessEqual(len(warn["summary"]), run.SUMMARY_LIMIT)
        self.assertNotIn("\n", warn["summary"])
        self.assertNotIn("\t", warn["summary"])
        self.assertNotIn("\x1b", warn["summary"])
        self.assertTrue(warn["summary"].startswith("line one line two with a tab"))
        self.assertTrue(warn["summary"].endswith("\u2026"))

    def test_summary_falls_back_to_description_and_details(self):
        fail = run.collapse_checks(fixture_checks("tools_call-fail.json"), V6, "http",
                                   "tools_call")[0]
        self.assertEqual(fail["summary"], "Validates that the add_numbers tool works "
                         'correctly | details: {"message": "Tool was not called by client"}')

    def test_malformed_files_are_rejected(self):
        for name in ("not-an-array.json", "bad-status.json"):
            with self.assertRaises(run.CheckFileError, msg=name):
                fixture_checks(name)
        with self.assertRaises(run.CheckFileError):
            run.parse_checks([{"name": "no id", "status": "SUCCESS"}])
        with self.assertRaises(run.CheckFileError):
            run.parse_checks(["not an object"])


def CATALOG_SCENARIOS(version):
    data = json.loads((HERE / "scenarios.json").read_text(encoding="utf-8"))
    items = data["scenarios"] if isinstance(data, dict) and "scenarios" in data else data
    out = set()
    for s in items:
        if version in s.get("versions", []) or (version == EXT and s.get("gate")):
            out.add(s["id"] if "id" in s else s["name"])
    return out


class BaselineTests(unittest.TestCase):
    def entry(self, **kw):
        e = {"version": V11, "scenario": "sse-retry", "check": "*", "reason": "because"}
        e.update(kw)
        return e

    def test_committed_baseline(self):
        b = run.load_baseline(HERE / "baseline.json", CATALOG)
        (entry,) = [e for e in b["expected_failures"] if e["scenario"] == "sse-retry"]
        self.assertEqual((entry["version"], entry["scenario"], entry["check"]),
                         (V11, "sse-retry", "*"))
        self.assertIn("2025-03-26", entry["reason"])
        # The only others: whole gated extension scenarios that are not built yet, saying so.
        for e in b["expected_failures"]:
            if e is not entry:
                self.assertEqual((e["version"], e["check"]), (EXT, "*"), e)
                self.assertIn(e["scenario"], GATED, e)
                self.assertIn("not built yet", e["reason"], e)
        # Every reviewed passing check names a scenario of the catalog, at its version.
        self.assertGreater(len(b["expected_passing"]), 50)
        for e in b["expected_passing"]:
            self.assertIn(e["scenario"], {s for s in CATALOG_SCENARIOS(e["version"])}, e)
        # The committed file is in the canonical form --write-expected-passing writes.
        self.assertEqual((HERE / "baseline.json").read_text(encoding="utf-8"),
                         run.format_baseline(b))

    def test_reason_is_required(self):
        for bad in ({"reason": ""}, {"reason": "   "}, {"reason": None}):
            with self.assertRaises(run.ConfigError):
                baseline([self.entry(**bad)])
        e = self.entry()
        del e["reason"]
        with self.assertRaises(run.ConfigError):
            baseline([e])

    def test_entries_must_name_a_real_pair(self):
        with self.assertRaises(run.ConfigError):
            baseline([self.entry(scenario="no-such-scenario")])
        with self.assertRaises(run.ConfigError):
            baseline([self.entry(version=V26)])  # sse-retry does not run at 2026-07-28
        with self.assertRaises(run.ConfigError):
            baseline([self.entry(version="2025-03-26")])

    def test_structure_errors(self):
        with self.assertRaises(run.ConfigError):
            baseline([self.entry(), self.entry()])
        with self.assertRaises(run.ConfigError):
            baseline([self.entry(extra=1)])
        with self.assertRaises(run.ConfigError):
            baseline([self.entry(), self.entry(check="client-sse-retry-timing")])
        with self.assertRaises(run.ConfigError):
            baseline(passes=[{"version": V6, "scenario": "tools_call", "check": "*"}])
        with self.assertRaises(run.ConfigError):
            baseline([self.entry(scenario="tools_call", check="tool-add-numbers")],
                     [{"version": V11, "scenario": "tools_call", "check": "tool-add-numbers"}])
        with self.assertRaises(run.ConfigError):
            run.validate_baseline({"expected_failures": []}, CATALOG)
        with self.assertRaises(run.ConfigError):
            baseline(passes=[{"version": V6, "scenario": "tools_call", "check": "a",
                              "name": ""}])

    def test_format_round_trip(self):
        b = baseline([self.entry()],
                     [{"version": V26, "scenario": "tools_call", "check": "b"},
                      {"version": V6, "scenario": "tools_call", "check": "a", "name": "N"}])
        text = run.format_baseline(b)
        again = run.validate_baseline(json.loads(text), CATALOG)
        self.assertEqual(run.format_baseline(again), text)
        self.assertEqual(again["expected_passing"][0]["version"], V6)  # sorted


class VerdictTests(unittest.TestCase):
    def test_clean_run_passes(self):
        runs = [make_run(V6, "tools_call", "tools_call-pass.json")]
        self.assertEqual(run.evaluate(runs, baseline()), [])
        self.assertEqual(runs[0]["problems"], [])

    def test_failure_and_warning_fail_the_gate(self):
        runs = [make_run(V6, "tools_call", "tools_call-fail.json")]
        reasons = run.evaluate(runs, baseline())
        self.assertEqual(len(reasons), 2)
        self.assertIn("FAILURE tool-add-numbers", reasons[0])
        self.assertIn("WARNING wire-schema-valid", reasons[1])

    def test_zero_checks_fail(self):
        runs = [make_run(V6, "initialize", "empty.json")]
        (reason,) = run.evaluate(runs, baseline())
        self.assertIn("zero-checks", reason)

    def test_all_skipped_is_no_evidence(self):
        runs = [make_run(V26, "http-standard-headers", "all-skipped.json")]
        (reason,) = run.evaluate(runs, baseline())
        self.assertIn("no-success", reason)

    def test_client_exit_and_timeout(self):
        crashed = make_run(V6, "tools_call", "tools_call-pass.json", client_exit_code=139,
                           client_signal=11)
        (reason,) = run.evaluate([crashed], baseline())
        self.assertIn("client-exit: the client exited with signal 11", reason)
        late = make_run(V6, "tools_call", "tools_call-pass.json", timed_out=True,
                        client_exit_code=143, client_signal=15)
        (reason,) = run.evaluate([late], baseline())
        self.assertIn("timeout", reason)

    def test_allow_client_error_scenarios(self):
        allowed = make_run(V26, "http-invalid-tool-headers", "tools_call-pass.json",
                           client_exit_code=1)
        self.assertTrue(allowed["allow_client_error"])
        self.assertEqual(run.evaluate([allowed], baseline()), [])
        timed = make_run(V26, "http-invalid-tool-headers", "tools_call-pass.json",
                         timed_out=True)
        self.assertEqual(len(run.evaluate([timed], baseline())), 1)

    def test_unexplained_suite_exit(self):
        odd = make_run(V6, "tools_call", "tools_call-pass.json", exit_code=1)
        (reason,) = run.evaluate([odd], baseline())
        self.assertIn("suite-exit", reason)
        explained = make_run(V6, "tools_call", "tools_call-fail.json", exit_code=1)
        self.assertNotIn("suite-exit", " ".join(run.evaluate([explained], baseline())))

    def test_runner_error_is_never_baselined(self):
        broken = make_run(V11, "sse-retry", runner_error="no checks.json")
        b = baseline([{"version": V11, "scenario": "sse-retry", "check": "*",
                       "reason": "server negotiates 2025-03-26"}])
        (reason,) = run.evaluate([broken], b)
        self.assertIn("runner-error", reason)  # and no stale-entry reason on top

    def test_whole_scenario_baseline(self):
        b = baseline([{"version": V11, "scenario": "sse-retry", "check": "*",
                       "reason": "server negotiates 2025-03-26"}])
        failing = make_run(V11, "sse-retry", "tools_call-fail.json", client_exit_code=1)
        self.assertEqual(run.evaluate([failing], b), [])
        self.assertTrue(all(p["baselined"] for p in failing["problems"]))
        self.assertTrue(all(c["baselined"] for c in failing["checks"]))
        empty = make_run(V11, "sse-retry", "empty.json")
        self.assertEqual(run.evaluate([empty], b), [])

    def test_stale_whole_scenario_entry(self):
        b = baseline([{"version": V11, "scenario": "sse-retry", "check": "*",
                       "reason": "server negotiates 2025-03-26"}])
        passing = make_run(V11, "sse-retry", "tools_call-pass.json")
        (reason,) = run.evaluate([passing], b)
        self.assertIn("stale baseline entry '*'", reason)

    def test_per_check_baseline_and_stale_entries(self):
        b = baseline([{"version": V6, "scenario": "tools_call", "check": "tool-add-numbers",
                       "reason": "tracked in issue 9"}])
        failing = make_run(V6, "tools_call", "tools_call-fail.json")
        (reason,) = run.evaluate([failing], b)  # the WARNING is not covered
        self.assertIn("WARNING wire-schema-valid", reason)
        passing = make_run(V6, "tools_call", "tools_call-pass.json")
        (reason,) = run.evaluate([passing], b)
        self.assertIn("stale baseline entry tool-add-numbers (now SUCCESS", reason)
        b2 = baseline([{"version": V6, "scenario": "tools_call", "check": "gone",
                        "reason": "tracked"}])
        (reason,) = run.evaluate([make_run(V6, "tools_call", "tools_call-pass.json")], b2)
        self.assertIn("stale baseline entry gone (now absent", reason)

    def test_entries_for_pairs_not_run_are_ignored(self):
        b = baseline([{"version": V11, "scenario": "sse-retry", "check": "*",
                       "reason": "server negotiates 2025-03-26"}],
                     [{"version": V26, "scenario": "tools_call", "check": "tool-add-numbers"}])
        self.assertEqual(run.evaluate([make_run(V6, "tools_call", "tools_call-pass.json")], b),
                         [])

    def test_missing_expected_pass(self):
        b = baseline(passes=[
            {"version": V6, "scenario": "tools_call", "check": "tool-add-numbers"},
            {"version": V6, "scenario": "tools_call", "check": "wire-schema-valid"},
            {"version": V6, "scenario": "tools_call", "check": "vanished"}])
        reasons = run.evaluate([make_run(V6, "tools_call", "tools_call-pass.json")], b)
        self.assertEqual(reasons, ["2025-06-18 tools_call: expected passing check vanished "
                                   "is missing"])
        reasons = run.evaluate([make_run(V6, "tools_call", "tools_call-fail.json")], b)
        self.assertIn("2025-06-18 tools_call: expected passing check tool-add-numbers is "
                      "FAILURE", reasons)
        self.assertIn("2025-06-18 tools_call: expected passing check wire-schema-valid is "
                      "WARNING", reasons)

    def test_missing_expected_variant(self):
        name = "ClientMcpMethodHeader_initialize"
        b = baseline(passes=[{"version": V26, "scenario": "http-standard-headers",
                              "check": "sep-2243-client-includes-standard-headers",
                              "name": name}])
        reasons = run.evaluate([make_run(V26, "http-standard-headers", "duplicates.json")], b)
        self.assertIn("2026-07-28 http-standard-headers: expected passing check "
                      f"sep-2243-client-includes-standard-headers ({name}) is SKIPPED", reasons)
        self.assertEqual(len(reasons), 2)  # plus the FAILURE of per-param

    def test_write_expected_passing(self):
        runs = [make_run(V26, "http-standard-headers", "duplicates.json"),
                make_run(V6, "tools_call", "tools_call-pass.json")]
        old = [{"version": V11, "scenario": "tools_call", "check": "kept"},
               {"version": V6, "scenario": "tools_call", "check": "dropped"}]
        new = run.expected_passing_from_runs(runs, old)
        keys = {(e["scenario"], e["check"], e.get("name")) for e in new}
        self.assertIn(("tools_call", "kept", None), keys)
        self.assertNotIn(("tools_call", "dropped", None), keys)
        self.assertIn(("http-standard-headers", "sep-2243-client-includes-standard-headers",
                       None), keys)
        self.assertIn(("http-standard-headers", "sep-2243-client-includes-standard-headers",
                       "ClientMcpMethodHeader_tools_list"), keys)
        self.assertNotIn(("http-standard-headers",
                          "sep-2243-client-includes-standard-headers",
                          "ClientMcpMethodHeader_initialize"), keys)  # SKIPPED variant
        self.assertIn(("http-standard-headers", "request-log", None), keys)  # INFO
        self.assertNotIn(("http-standard-headers", "per-param", None), keys)  # FAILURE
        b = baseline(passes=new)
        self.assertEqual(run.evaluate([make_run(V6, "tools_call", "tools_call-pass.json")], b),
                         [])
        # A check still listed as an expected failure is not also written as passing.
        fails = [{"version": V6, "scenario": "tools_call", "check": "tool-add-numbers",
                  "reason": "tracked"}]
        new = run.expected_passing_from_runs(runs, [], fails)
        self.assertNotIn("tool-add-numbers", {e["check"] for e in new})
        baseline(fails, new)  # loads without a contradiction


class MatrixAndReportTests(unittest.TestCase):
    def report(self, runs, b=None):
        reasons = run.evaluate(runs, b or baseline())
        return run.build_report(catalog=CATALOG, runs=runs, reasons=reasons,
                                selection={"partial": False})

    def test_matrix_counts_and_statuses(self):
        b = baseline([{"version": V11, "scenario": "sse-retry", "check": "*",
                       "reason": "server negotiates 2025-03-26"}])
        runs = [make_run(V6, "tools_call", "tools_call-pass.json"),
                make_run(V6, "initialize", "tools_call-pass.json"),
                make_run(V11, "tools_call", "tools_call-pass.json"),
                make_run(V11, "sse-retry", "tools_call-fail.json"),
                make_run(V26, "http-standard-headers", "duplicates.json"),
                make_run(V26, "tools_call", runner_error="boom")]
        m = self.report(runs, b)["matrix"]
        self.assertEqual(m[V6]["http"], {"status": "pass", "passed": 4, "total": 4,
                                         "unsupported": 0, "failed": 0, "baselined": 0,
                                         "scenarios": 2})
        self.assertEqual(m[V11]["http"]["status"], "pass")
        self.assertEqual((m[V11]["http"]["passed"], m[V11]["http"]["total"],
                          m[V11]["http"]["baselined"]), (2, 4, 2))
        self.assertEqual(m[V26]["http"]["status"], "blocked")  # a runner error

    def test_fail_unsupported_and_auth_key(self):
        runs = [make_run(V26, "http-standard-headers", "duplicates.json"),
                make_run(V26, "auth/iss-supported", "tools_call-pass.json")]
        m = self.report(runs)["matrix"][V26]
        self.assertEqual(m["http"]["status"], "fail")
        self.assertEqual((m["http"]["passed"], m["http"]["total"], m["http"]["failed"]),
                         (2, 3, 1))
        self.assertEqual(m["http-oauth"]["status"], "pass")
        runs = [make_run(V26, "http-standard-headers", "all-skipped.json")]
        b = baseline([{"version": V26, "scenario": "http-standard-headers", "check": "*",
                       "reason": "not implemented yet"}])
        cell = self.report(runs, b)["matrix"][V26]["http"]
        self.assertEqual((cell["status"], cell["unsupported"], cell["total"]),
                         ("unsupported", 1, 1))
        cell = self.report([make_run(V6, "initialize", "empty.json")])["matrix"][V6]["http"]
        self.assertEqual(cell["status"], "blocked")  # no checks, no evidence

    def test_report_shape(self):
        runs = [make_run(V26, "tools_call", "tools_call-pass.json"),
                make_run(V6, "tools_call", "tools_call-fail.json"),
                make_run(V6, "initialize", "tools_call-pass.json")]
        report = json.loads(json.dumps(self.report(runs)))
        self.assertEqual(report["suite"], {"package": "@modelcontextprotocol/conformance",
                                           "version": "0.2.0-alpha.12"})
        self.assertEqual([(r["version"], r["scenario"]) for r in report["runs"]],
                         [(V6, "initialize"), (V6, "tools_call"), (V26, "tools_call")])
        for r in report["runs"]:
            self.assertTrue({"version", "transport", "scenario", "exit_code", "timed_out",
                             "checks"} <= set(r))
        self.assertEqual(report["gate"]["verdict"], "fail")
        self.assertEqual(len(report["gate"]["reasons"]), 2)
        self.assertEqual(set(report["matrix"]), {V6, V26})
        self.assertEqual(set(report["matrix"][V6]["http"]),
                         {"status", "passed", "total", "unsupported", "failed", "baselined",
                          "scenarios"})


class SelectionTests(unittest.TestCase):
    def names(self, pairs, version):
        return [m["id"] for v, m in pairs if v == version]

    def test_default_selection(self):
        pairs = run.select_pairs(CATALOG, None, None, False)
        self.assertEqual(self.names(pairs, V6), ["initialize", "tools_call"])
        self.assertEqual(self.names(pairs, V11), [
            "initialize", "tools_call", "elicitation-sep1034-client-defaults", "sse-retry",
            "json-schema-2020-12-preservation"])
        self.assertEqual(self.names(pairs, V26), [
            "tools_call", "request-metadata", "sep-2322-client-request-state",
            "http-standard-headers", "http-custom-headers", "http-invalid-tool-headers",
            "json-schema-ref-no-deref", "json-schema-2020-12-preservation"])

    def test_auth_selection(self):
        pairs = run.select_pairs(CATALOG, [V6], None, True)
        self.assertEqual(self.names(pairs, V6), [
            "initialize", "tools_call", "auth/token-endpoint-auth-basic",
            "auth/token-endpoint-auth-post", "auth/token-endpoint-auth-none"])
        self.assertEqual(len(run.select_pairs(CATALOG, None, None, True)),
                         15 + 3 + 14 + 25 + len(GATED))

    def test_gated_extensions_run_with_auth_once_each(self):
        pairs = run.select_pairs(CATALOG, None, None, True)
        self.assertEqual(self.names(pairs, EXT), GATED)
        self.assertEqual(run.select_pairs(CATALOG, None, None, False),
                         [p for p in pairs if p[1]["scope"] == "core"])
        only = run.select_pairs(CATALOG, [EXT], None, True)
        self.assertEqual([(v, m["id"]) for v, m in only], [(EXT, s) for s in GATED])
        one = run.select_pairs(CATALOG, None, ["auth/dpop"], False)
        self.assertEqual([(v, m["id"]) for v, m in one], [(EXT, "auth/dpop")])
        # Extension scenarios the gate does not run stay refused by name.
        with self.assertRaises(run.ConfigError):
            run.select_pairs(CATALOG, None, ["sep-2640-client-no-prefetch"], False)
        self.assertTrue(run.applicable(CATALOG, EXT, "auth/dpop"))
        self.assertFalse(run.applicable(CATALOG, EXT, "tools_call"))
        self.assertFalse(run.applicable(CATALOG, EXT, "sep-2640-client-no-prefetch"))

    def test_gate_flag_is_validated(self):
        doc = json.loads((HERE / "scenarios.json").read_text(encoding="utf-8"))
        bad = json.loads(json.dumps(doc))
        next(r for r in bad["scenarios"] if r["id"] == "tools_call")["gate"] = True
        with self.assertRaises(run.ConfigError):
            run.validate_catalog(bad)
        bad = json.loads(json.dumps(doc))
        next(r for r in bad["scenarios"] if r["id"] == "auth/dpop")["gate"] = "yes"
        with self.assertRaises(run.ConfigError):
            run.validate_catalog(bad)
        bad = json.loads(json.dumps(doc))
        next(r for r in bad["scenarios"] if r["id"] == "auth/dpop")["gated"] = True
        with self.assertRaises(run.ConfigError):
            run.validate_catalog(bad)

    def test_bad_selections(self):
        for versions, scenarios in (([V6], ["sse-retry"]), (["2025-03-26"], None),
                                    (None, ["nope"]), (None, ["sep-2640-client-verify-size"]),
                                    ([V6], ["auth/dpop"])):
            with self.assertRaises(run.ConfigError):
                run.select_pairs(CATALOG, versions, scenarios, False)
        with self.assertRaises(run.ConfigError):
            run.split_list("a,a")
        self.assertEqual(run.split_list(" a, b ,"), ["a", "b"])

    def test_listing_matches_catalog(self):
        text = (FIXTURES / "list-client-alpha12.txt").read_text(encoding="utf-8")
        listing = run.parse_listing(text)
        self.assertEqual(len(listing), 48)
        self.assertEqual(run.compare_listing(listing, CATALOG), [])
        changed = dict(listing)
        del changed["sse-retry"]
        changed["brand-new"] = [V26]
        changed["tools_call"] = [V11, V26]
        problems = run.compare_listing(changed, CATALOG)
        self.assertEqual(len(problems), 3)
        self.assertEqual(run.compare_listing({}, CATALOG),
                         ["suite listing: `list --client` printed no scenarios"])


class FakeSuiteTests(unittest.TestCase):
    """run_pair end to end against fixtures/fake_suite.py and the real client shim."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.work = Path(self.tmp.name)
        script = self.work / "hang.sh"
        script.write_text("#!/bin/sh\nsleep 30\n")
        script.chmod(0o755)
        self.hang = str(script)

    def tearDown(self):
        self.tmp.cleanup()

    def pair(self, client, fixture="tools_call-pass.json", mode="normal", timeout_ms=20000,
             scenario="tools_call", version=V6):
        env = dict(os.environ, FAKE_SUITE_CHECKS=str(CHECKS / fixture), FAKE_SUITE_MODE=mode)
        return run.run_pair(node=Path(sys.executable), entry=FIXTURES / "fake_suite.py",
                            version=version, meta=CATALOG["scenarios"][scenario],
                            client=client, client_args=[], timeout_ms=timeout_ms,
                            work=self.work, env=env)

    def test_passing_client(self):
        r = self.pair("/bin/true")
        self.assertIsNone(r["runner_error"])
        self.assertEqual((r["exit_code"], r["client_exit_code"], r["timed_out"]), (0, 0, False))
        self.assertEqual([c["status"] for c in r["checks"]], ["SUCCESS", "SUCCESS"])
        self.assertEqual(run.evaluate([r], baseline()), [])

    def test_crashing_client(self):
        r = self.pair("/bin/false")
        self.assertEqual(r["client_exit_code"], 1)
        self.assertIn("client-exit", run.evaluate([r], baseline())[0])

    def test_missing_client_binary(self):
        r = self.pair(str(self.work / "absent"))
        self.assertEqual(r["client_exit_code"], 127)
        self.assertIn("FileNotFoundError", r["client"]["spawn_error"])

    def test_hanging_client_is_bounded(self):
        started = time.monotonic()
        r = self.pair(self.hang, timeout_ms=1000)
        self.assertLess(time.monotonic() - started, 10)
        self.assertTrue(r["timed_out"])
        self.assertIn("timeout", run.evaluate([r], baseline())[0])

    def test_extension_pairs_run_without_a_spec_version(self):
        r = self.pair("/bin/true", scenario="auth/dpop", version=EXT)
        self.assertIsNone(r["runner_error"])
        self.assertIn("spec-version: none", r["output"]["suite_stdout"])
        r = self.pair("/bin/true")
        self.assertIn(f"spec-version: {V6}", r["output"]["suite_stdout"])

    def test_runner_errors(self):
        r = self.pair("/bin/true", mode="no-output")
        self.assertIn("no checks.json", r["runner_error"])
        self.assertIn("simulated suite crash", r["runner_error"])
        r = self.pair("/bin/true", mode="not-applicable", scenario="initialize", version=V11)
        self.assertIn("not applicable", r["runner_error"])
        r = self.pair("/bin/true", mode="two-files", scenario="sse-retry", version=V11)
        self.assertIn("2 checks.json", r["runner_error"])
        r = self.pair("/bin/true", fixture="bad-status.json", scenario="initialize")
        self.assertIn("unreadable checks.json", r["runner_error"])


class CheckDocumentTests(unittest.TestCase):
    DOC = ("# Title\n\nIntro text.\n\n<!-- matrix:start -->\n| stale |\n<!-- matrix:end -->\n"
           "\nTrailing text.\n\n<!-- extensions:start -->\n<!-- extensions:end -->\n")

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self.tmp.name)
        self.doc = self.dir / "doc.md"
        self.doc.write_text(self.DOC, encoding="utf-8")

    def tearDown(self):
        self.tmp.cleanup()

    def write_report(self, report, name="report.json"):
        path = self.dir / name
        path.write_text(json.dumps(report), encoding="utf-8")
        return str(path)

    def sample_report(self):
        runs = [make_run(V6, "tools_call", "tools_call-pass.json"),
                make_run(V6, "initialize", "tools_call-pass.json"),
                make_run(V11, "tools_call", "tools_call-fail.json"),
                make_run(V26, "http-standard-headers", "all-skipped.json"),
                make_run(V26, "tools_call", "tools_call-pass.json")]
        report = run.build_report(catalog=CATALOG, runs=runs,
                                  reasons=run.evaluate(runs, baseline()),
                                  selection={"partial": False})
        report["stdio"] = {V6: {"status": "pass", "passed": 4, "total": 4}}
        return report

    def test_write_then_agree(self):
        report = self.write_report(self.sample_report())
        code, out, _ = quiet(check_document.main, [report, str(self.doc), "--write"])
        self.assertEqual(code, 0)
        text = self.doc.read_text(encoding="utf-8")
        self.assertTrue(text.startswith("# Title\n\nIntro text.\n\n<!-- matrix:start -->\n"))
        self.assertIn("<!-- matrix:end -->\n\nTrailing text.\n\n<!-- extensions:start -->\n",
                      text)
        self.assertTrue(text.endswith("<!-- extensions:end -->\n"))
        self.assertIn("| `auth/dpop` | blocked (no report) |", text)
        self.assertIn("| 2025-06-18 | pass (4/4) | pass (4/4) |", text)
        self.assertIn("| 2025-11-25 | blocked (no report) | fail (0/2) |", text)
        self.assertIn("| 2026-07-28 | blocked (no report) | fail (2/3; unsupported=1) |", text)
        code, out, _ = quiet(check_document.main, [report, str(self.doc)])
        self.assertEqual(code, 0, out)
        code, out, _ = quiet(check_document.main, [report, str(self.doc), "--write"])
        self.assertIn("already matches", out)

    def test_disagreement_is_named(self):
        report = self.write_report(self.sample_report())
        quiet(check_document.main, [report, str(self.doc), "--write"])
        text = self.doc.read_text(encoding="utf-8").replace(
            "| 2025-11-25 | blocked (no report) | fail (0/2) |",
            "| 2025-11-25 | blocked (no report) | pass (2/2) |")
        self.doc.write_text(text, encoding="utf-8")
        code, _, err = quiet(check_document.main, [report, str(self.doc)])
        self.assertEqual(code, 1)
        self.assertIn("2025-11-25 / HTTP (non-auth): document says 'pass (2/2)', report says "
                      "'fail (0/2)'", err)

    def test_missing_row_and_layout_drift(self):
        report = self.write_report(self.sample_report())
        quiet(check_document.main, [report, str(self.doc), "--write"])
        original = self.doc.read_text(encoding="utf-8")
        without = "\n".join(l for l in original.splitlines() if not l.startswith("| 2026"))
        self.doc.write_text(without + "\n", encoding="utf-8")
        code, _, err = quiet(check_document.main, [report, str(self.doc)])
        self.assertEqual(code, 1)
        self.assertIn("no row for 2026-07-28", err)
        self.doc.write_text(original.replace("| pass (4/4) |", "|  pass (4/4)   |", 1),
                            encoding="utf-8")
        code, _, err = quiet(check_document.main, [report, str(self.doc)])
        self.assertEqual(code, 1)
        self.assertIn("not in its generated form", err)

    def test_empty_report_is_blocked_everywhere(self):
        code, _, _ = quiet(check_document.main, [str(FIXTURES / "report-empty.json"),
                                                 str(self.doc), "--write"])
        self.assertEqual(code, 0)
        text = self.doc.read_text(encoding="utf-8")
        for v in (V6, V11, V26):
            self.assertIn(f"| {v} | blocked (no report) | blocked (no report) |", text)
        # 3 versions x 3 columns, and every gated extension.
        self.assertEqual(text.count("blocked (no report)"), 9 + len(GATED))

    def test_invalid_inputs(self):
        partial = self.sample_report()
        partial["selection"]["partial"] = True
        path = self.write_report(partial)
        code, _, err = quiet(check_document.main, [path, str(self.doc)])
        self.assertEqual(code, 2)
        self.assertIn("partial", err)
        code, _, _ = quiet(check_document.main, [path, str(self.doc), "--allow-partial",
                                                 "--write"])
        self.assertEqual(code, 0)
        bad = self.sample_report()
        bad["stdio"][V6]["passed"] = 5
        code, _, err = quiet(check_document.main, [self.write_report(bad), str(self.doc)])
        self.assertEqual(code, 2)
        unknown = self.sample_report()
        unknown["matrix"]["2025-03-26"] = unknown["matrix"][V6]
        code, _, err = quiet(check_document.main, [self.write_report(unknown), str(self.doc)])
        self.assertEqual(code, 2)
        self.doc.write_text("# no markers\n", encoding="utf-8")
        code, _, err = quiet(check_document.main, [str(FIXTURES / "report-empty.json"),
                                                   str(self.doc)])
        self.assertEqual(code, 2)
        self.assertIn("matrix:start", err)

    def test_extension_rows_are_checked_against_the_report(self):
        runs = [make_run(V6, "tools_call", "tools_call-pass.json"),
                make_run(EXT, "auth/dpop", "tools_call-pass.json"),
                make_run(EXT, "auth/dpop-nonce", "tools_call-fail.json")]
        report = run.build_report(catalog=CATALOG, runs=runs,
                                  reasons=run.evaluate(runs, baseline()),
                                  selection={"partial": False})
        # Extension runs count in their own cells, never in the version matrix.
        self.assertEqual(set(report["matrix"]), {V6})
        self.assertEqual(list(report["extensions"]), ["auth/dpop", "auth/dpop-nonce"])
        self.assertEqual(report["extensions"]["auth/dpop"]["status"], "pass")
        self.assertEqual(report["extensions"]["auth/dpop-nonce"]["status"], "fail")
        path = self.write_report(report)
        code, _, _ = quiet(check_document.main, [path, str(self.doc), "--write"])
        self.assertEqual(code, 0)
        text = self.doc.read_text(encoding="utf-8")
        self.assertIn("| `auth/dpop` | pass (2/2) |", text)
        self.assertIn("| `auth/dpop-nonce` | fail (0/2) |", text)
        self.assertIn("| `auth/wif-jwt-bearer` | blocked (no report) |", text)
        code, _, _ = quiet(check_document.main, [path, str(self.doc)])
        self.assertEqual(code, 0)
        self.doc.write_text(text.replace("| `auth/dpop-nonce` | fail (0/2) |",
                                         "| `auth/dpop-nonce` | pass (2/2) |"), encoding="utf-8")
        code, _, err = quiet(check_document.main, [path, str(self.doc)])
        self.assertEqual(code, 1)
        self.assertIn("auth/dpop-nonce / HTTP OAuth: document says 'pass (2/2)', report says "
                      "'fail (0/2)'", err)
        self.doc.write_text(text.replace("| `auth/dpop` | pass (2/2) |\n", ""), encoding="utf-8")
        code, _, err = quiet(check_document.main, [path, str(self.doc)])
        self.assertEqual(code, 1)
        self.assertIn("no row for extension auth/dpop", err)
        self.doc.write_text(text.replace("<!-- extensions:end -->",
                                         "| `sep-2640-client-no-prefetch` | pass (1/1) |\n"
                                         "<!-- extensions:end -->"), encoding="utf-8")
        code, _, err = quiet(check_document.main, [path, str(self.doc)])
        self.assertEqual(code, 1)
        self.assertIn("not gated in scenarios.json", err)
        bad = json.loads(json.dumps(report))
        bad["extensions"]["sep-2640-client-no-prefetch"] = bad["extensions"]["auth/dpop"]
        code, _, err = quiet(check_document.main, [self.write_report(bad), str(self.doc)])
        self.assertEqual(code, 2)
        # A baseline entry may name the pseudo-version.
        b = baseline([{"version": EXT, "scenario": "auth/dpop-nonce", "check": "*",
                       "reason": "not built yet"}])
        self.assertEqual(run.evaluate([runs[2]], b), [])

    def test_blocked_cell_rendering(self):
        self.assertEqual(check_document.render_cell(None), "blocked (no report)")
        self.assertEqual(check_document.render_cell(
            {"status": "blocked", "passed": 1, "total": 3}), "blocked")
        self.assertEqual(check_document.render_cell(
            {"status": "pass", "passed": 52, "total": 56, "unsupported": 4, "baselined": 0}),
            "pass (52/56; unsupported=4)")
        self.assertEqual(check_document.render_cell(
            {"status": "pass", "passed": 10, "total": 12, "unsupported": 0, "baselined": 2}),
            "pass (10/12; baselined=2)")


if __name__ == "__main__":
    unittest.main()
