"""kvrecalld's /metrics with the real tools: `promtool check metrics` on a scrape of a running
kvrecalld, and a real `prometheus` (Debian's package) scraping it on loopback, whose query API
then reports the layer-steps that were sent. Run by CTest (client/python/CMakeLists.txt) with
KVRECALLD and PYTHONPATH set."""
import json
import math
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import unittest
import urllib.parse
import urllib.error
import urllib.request

import grpc
import numpy as np

import kvrecall
from kvrecall.client import make_geometry, make_policy
from auth_pki import make_pki
from kvrecalld_process import Kvrecalld, binary as kvrecalld_binary

GEOMETRY = dict(layers=2, q_heads=4, kv_heads=2, head_dim=16)
PROMPT_TOKENS = 64
DECODE_TOKENS = 5


def scrape(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.headers.get("Content-Type", ""), r.read().decode()


def scrape_until(url, wanted, timeout_s=10):
    """The samples of a scrape in which every series of `wanted` has its value: a Decode or
    Prefill stream is counted when gRPC says it is done, which may be a moment after its client
    has its status. The last scrape's samples when the time runs out (the test then fails on
    them, naming the series)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = samples(scrape(url)[1])
        if all(m.get(k) == v for k, v in wanted.items()) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def samples(text):
    """{'name{labels}': value} of the text format, labels as exported."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def run_workload(address):
    """Two sessions (exact_topk, retopk) prefilled and decoded DECODE_TOKENS tokens per layer,
    one bad CreateSession; returns the layer-steps sent."""
    rng = np.random.default_rng(5)
    g = make_geometry(**GEOMETRY)
    layers, hq, hkv, d = (GEOMETRY[k] for k in ("layers", "q_heads", "kv_heads", "head_dim"))
    steps = 0
    with kvrecall.Client(address, wait_ready_s=30) as c:
        try:
            c.create_session(make_geometry(1, 3, 2, 16))  # kv_heads must divide q_heads
        except kvrecall.KvRecallError as e:
            assert e.code == grpc.StatusCode.INVALID_ARGUMENT, e
        for policy in (make_policy("exact_topk", top_k=16), make_policy("retopk", top_k=16)):
            s = c.create_session(g, policy)
            s.prefill([(rng.standard_normal((PROMPT_TOKENS, hq, d), dtype=np.float32),
                        rng.standard_normal((PROMPT_TOKENS, hkv, d), dtype=np.float32),
                        rng.standard_normal((PROMPT_TOKENS, hkv, d), dtype=np.float32))
                       for _ in range(layers)])
            for _ in range(DECODE_TOKENS):
                for layer in range(layers):
                    s.attend(layer, rng.standard_normal((hq, d), dtype=np.float32),
                             rng.standard_normal((hkv, d), dtype=np.float32),
                             rng.standard_normal((hkv, d), dtype=np.float32))
                    steps += 1
            s.close()
    return steps


class ScrapeTest(unittest.TestCase):
    def test_scrape_passes_promtool_and_counts_what_was_served(self):
        method = 'method="kvrecall.v1.KvRecall/{}"'
        with Kvrecalld() as server:
            steps = run_workload(server.address)
            scrape_until(server.metrics_url, {
                f'kvrecall_rpcs_total{{code="OK",{method.format("Prefill")}}}': 2,
                f'kvrecall_rpcs_total{{code="OK",{method.format("Decode")}}}': 1})
            content_type, text = scrape(server.metrics_url)
        self.assertIn("text/plain", content_type)
        check = subprocess.run(["promtool", "check", "metrics"], input=text, text=True,
                               capture_output=True)
        self.assertEqual(check.returncode, 0, check.stdout + check.stderr)
        self.assertEqual(check.stdout + check.stderr, "", "promtool found problems")

        m = samples(text)
        self.assertEqual(m[f'kvrecall_rpcs_total{{code="OK",{method.format("CreateSession")}}}'], 2)
        self.assertEqual(
            m[f'kvrecall_rpcs_total{{code="INVALID_ARGUMENT",{method.format("CreateSession")}}}'], 1)
        self.assertEqual(m[f'kvrecall_rpcs_total{{code="OK",{method.format("Prefill")}}}'], 2)
        self.assertEqual(m[f'kvrecall_rpcs_total{{code="OK",{method.format("CloseSession")}}}'], 2)
        self.assertEqual(m['kvrecall_decode_request_seconds_count'], steps)
        # The Decode stream records itself (no interceptor on it): its one stream, closed.
        self.assertEqual(m[f'kvrecall_rpcs_total{{code="OK",{method.format("Decode")}}}'], 1)
        self.assertEqual(
            m[f'kvrecall_rpc_duration_seconds_count{{{method.format("Decode")}}}'], 1)
        layer_steps = {k: v for k, v in m.items() if k.startswith("kvrecall_layer_steps_total{")}
        self.assertEqual(layer_steps, {
            'kvrecall_layer_steps_total{placement="cpu",selector="exact_topk"}': steps / 2,
            'kvrecall_layer_steps_total{placement="cpu",selector="retopk"}': steps / 2})
        head_steps = {k: v for k, v in m.items() if k.startswith("kvrecall_head_steps_total{")}
        self.assertEqual(sum(head_steps.values()), steps * GEOMETRY["q_heads"])
        self.assertEqual(
            m['kvrecall_head_steps_total{path="exact",placement="cpu",selector="exact_topk"}'],
            steps / 2 * GEOMETRY["q_heads"])
        # exact_topk scores every token of the growing context on every head-step.
        cpu_topk = 'placement="cpu",selector="exact_topk"'
        self.assertEqual(m[f"kvrecall_head_step_candidates_count{{{cpu_topk}}}"],
                         steps / 2 * GEOMETRY["q_heads"])
        tokens_scored = sum(PROMPT_TOKENS + t + 1 for t in range(DECODE_TOKENS))
        self.assertEqual(m[f"kvrecall_head_step_candidates_sum{{{cpu_topk}}}"],
                         tokens_scored * GEOMETRY["layers"] * GEOMETRY["q_heads"])
        for selector in ("exact_topk", "retopk"):
            labels = f'placement="cpu",selector="{selector}"'
            self.assertEqual(m[f"kvrecall_prefill_seconds_count{{{labels}}}"], 1)
            self.assertEqual(m[f"kvrecall_index_build_seconds_count{{{labels}}}"],
                             GEOMETRY["layers"])
            self.assertEqual(m[f"kvrecall_layer_step_seconds_count{{{labels}}}"], steps / 2)
        self.assertEqual(m["kvrecall_sessions_open"], 0)
        self.assertEqual(m["kvrecall_host_memory_budget_bytes"], math.inf)

    def test_the_readme_names_every_family_exported_and_no_other(self):
        # The README's metrics table is the operator's reference: every kvrecall_ family a
        # scrape shows after a workload is in it, and it names none that is not exported. (A
        # budget per tenant makes the per-tenant memory series; a tenant's series are made by a
        # scrape that sees it holding a session.)
        with Kvrecalld("--host_memory_budget_per_tenant_gb=1") as server:
            run_workload(server.address)
            with kvrecall.Client(server.address, wait_ready_s=30) as c:
                c.create_session(make_geometry(**GEOMETRY), make_policy("full"))
                _, text = scrape(server.metrics_url)
        exported = set(re.findall(r"^# TYPE (kvrecall_\w+) ", text, re.M))
        readme_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")
        with open(readme_path) as f:
            section = f.read().split("**Metrics.**", 1)[1].split("\n\n**", 1)[0]
        documented = set(re.findall(r"`(kvrecall_\w+)", section))
        self.assertEqual(exported - documented, set(), "exported, not in the README's table")
        # (A refusal's series is made at the first refusal by its limit: none in this workload;
        # the devices' (and the tenants' shares of them) at the first scrape of a server with
        # GPUs: none here; the TLS files' by a server with TLS: not this one.)
        self.assertEqual(documented - exported,
                         {"kvrecall_requests_refused_total", "kvrecall_gpu_device_memory_bytes",
                          "kvrecall_gpu_device_memory_budget_bytes",
                          "kvrecall_tenant_gpu_device_memory_bytes",
                          "kvrecall_tenant_gpu_device_memory_budget_bytes",
                          "kvrecall_tls_files_usable",
                          "kvrecall_tls_certificate_expiration_timestamp_seconds"},
                         "in the README's table, not exported")
        # The alerting rules (deploy/helm/kvrecall/files/kvrecall.rules.yaml, whose promtool
        # tests use series of their own) read only families the README documents.
        rules_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "deploy",
                                  "helm", "kvrecall", "files", "kvrecall.rules.yaml")
        with open(rules_path) as f:
            read = {re.sub(r"_bucket$", "", name)
                    for name in re.findall(r"\b(kvrecall_\w+)", f.read())}
        self.assertTrue(read)
        self.assertEqual(read - documented, set(), "read by the alerting rules, not documented")

    def test_other_paths_are_not_found_and_the_endpoint_keeps_serving(self):
        # A probe of any other path once crashed kvrecalld (civetweb's file handler overflowed
        # its worker's stack); it must answer 404 and leave /metrics and the server up.
        with Kvrecalld() as server:
            base = server.metrics_url.rsplit("/", 1)[0]
            for path in ("/", "/nope", "/metrics/../etc/passwd", "/favicon.ico"):
                with self.assertRaises(urllib.error.HTTPError) as caught:
                    urllib.request.urlopen(base + path, timeout=10)
                self.assertEqual(caught.exception.code, 404, path)
            content_type, text = scrape(server.metrics_url)
            self.assertIn("kvrecall_build_info", text)
            with kvrecall.Client(server.address, wait_ready_s=30) as c:
                self.assertEqual(c.list_sessions(), [])

    def test_gauges_follow_open_sessions_and_the_budget(self):
        with Kvrecalld("--host_memory_budget_gb=1") as server:
            with kvrecall.Client(server.address, wait_ready_s=30) as c:
                g = make_geometry(**GEOMETRY)
                s = c.create_session(g, make_policy("full"))
                hq, hkv, d = GEOMETRY["q_heads"], GEOMETRY["kv_heads"], GEOMETRY["head_dim"]
                s.prefill([(np.ones((10, hq, d), np.float32), np.ones((10, hkv, d), np.float32),
                            np.ones((10, hkv, d), np.float32))] * GEOMETRY["layers"])
                m = samples(scrape(server.metrics_url)[1])
                info = s.info()
                s.close()
        self.assertEqual(m["kvrecall_sessions_open"], 1)
        self.assertEqual(m["kvrecall_tokens_held"], 10)
        self.assertEqual(m["kvrecall_host_memory_budget_bytes"], 1 << 30)
        self.assertGreaterEqual(m["kvrecall_host_memory_bytes"], info.host_bytes)
        self.assertGreater(info.host_bytes, 0)
        # Without tokens every caller is the one tenant "" (Prometheus reads an empty label as
        # none); without budgets per tenant its memory is not reported apart.
        self.assertEqual(m['kvrecall_tenant_sessions_open{tenant=""}'], 1)
        self.assertNotIn('kvrecall_tenant_host_memory_bytes{tenant=""}', m)

    def test_a_tenants_gauges_follow_its_sessions_and_its_budget(self):
        with Kvrecalld("--host_memory_budget_gb=1", "--host_memory_budget_per_tenant_gb=0.5") \
                as server:
            with kvrecall.Client(server.address, wait_ready_s=30) as c:
                s = c.create_session(make_geometry(**GEOMETRY), make_policy("full"),
                                     max_tokens=1000)
                held = samples(scrape(server.metrics_url)[1])
                s.close()
                after = samples(scrape(server.metrics_url)[1])
        self.assertEqual(held['kvrecall_tenant_sessions_open{tenant=""}'], 1)
        # The one tenant holds all that is held: its session's KV set aside for 1000 tokens.
        self.assertEqual(held['kvrecall_tenant_host_memory_bytes{tenant=""}'],
                         held["kvrecall_host_memory_bytes"])
        self.assertGreaterEqual(held['kvrecall_tenant_host_memory_bytes{tenant=""}'],
                                2 * 1000 * GEOMETRY["layers"] * GEOMETRY["kv_heads"] *
                                GEOMETRY["head_dim"] * 4)
        self.assertEqual(held['kvrecall_tenant_host_memory_budget_bytes{tenant=""}'], 1 << 29)
        # No GPU here: its budgets sum to 0 as the server's do.
        self.assertEqual(held['kvrecall_tenant_gpu_memory_budget_bytes{tenant=""}'],
                         held["kvrecall_gpu_memory_budget_bytes"])
        # Holding nothing, the tenant has no series.
        self.assertEqual([series for series in after if "tenant=" in series], [])

    def test_a_request_the_budget_refuses_is_counted_by_its_limit(self):
        # 64 KiB of host memory: one layer of 1000 prompt tokens (q, k, v in f32) does not fit.
        with Kvrecalld(f"--host_memory_budget_gb={64 / (1 << 20)}") as server:
            with kvrecall.Client(server.address, wait_ready_s=30) as c:
                hq, hkv, d = GEOMETRY["q_heads"], GEOMETRY["kv_heads"], GEOMETRY["head_dim"]
                s = c.create_session(make_geometry(1, hq, hkv, d), make_policy("full"))
                with self.assertRaises(kvrecall.KvRecallError) as refused:
                    s.prefill([(np.ones((1000, hq, d), np.float32),
                                np.ones((1000, hkv, d), np.float32),
                                np.ones((1000, hkv, d), np.float32))])
                m = scrape_until(server.metrics_url, {
                    'kvrecall_rpcs_total{code="RESOURCE_EXHAUSTED",'
                    'method="kvrecall.v1.KvRecall/Prefill"}': 1})
        self.assertEqual(refused.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertIn("host_memory_budget_gb", refused.exception.message)
        self.assertEqual(m['kvrecall_requests_refused_total{limit="host_memory_budget"}'], 1)
        self.assertEqual(
            m['kvrecall_rpcs_total{code="RESOURCE_EXHAUSTED",method="kvrecall.v1.KvRecall/Prefill"}'],
            1)


def wait_until(condition, timeout):
    """True once condition() is (polled every half second, OSError counting as not yet: a
    server not listening yet), False after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@unittest.skipIf(shutil.which("prometheus") is None,
                 "prometheus is not installed (scripts/install_deps.sh installs Debian's)")
class PrometheusServerTest(unittest.TestCase):
    """A real prometheus scraping a real kvrecalld every second, with the chart's alerting rules
    loaded: what it stores, what the rules and the dashboard's queries make of it."""

    REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    RULES = os.path.join(REPO, "deploy", "helm", "kvrecall", "files", "kvrecall.rules.yaml")
    DASHBOARD = os.path.join(REPO, "deploy", "helm", "kvrecall", "files", "kvrecall-dashboard.json")

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="kvrecall-prometheus-")
        cls.server = Kvrecalld()
        target = urllib.parse.urlparse(cls.server.metrics_url).netloc
        config = os.path.join(cls.tmp.name, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                    "  evaluation_interval: 1s\n"
                    f"rule_files: ['{cls.RULES}']\n"
                    "scrape_configs:\n  - job_name: kvrecalld\n"
                    f"    static_configs:\n      - targets: ['{target}']\n")
        cls.check_config = subprocess.run(["promtool", "check", "config", config],
                                          capture_output=True, text=True)
        port = free_port()
        cls.log = open(os.path.join(cls.tmp.name, "prometheus.log"), "w+")
        cls.prometheus = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={cls.tmp.name}/data",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=cls.log, stderr=subprocess.STDOUT)
        cls.api = f"http://127.0.0.1:{port}"
        cls.steps = None

    @classmethod
    def tearDownClass(cls):
        cls.prometheus.terminate()
        cls.prometheus.wait(30)
        cls.log.close()
        cls.server.stop()
        cls.tmp.cleanup()

    def query(self, expr):
        url = f"{self.api}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.load(r)
        self.assertEqual(body["status"], "success", body)
        return body["data"]["result"]

    def served_and_scraped(self):
        """Runs the workload once per class and waits until prometheus has every layer-step of
        it; the layer-steps sent."""
        cls = type(self)
        self.assertEqual(cls.check_config.returncode, 0,
                         cls.check_config.stdout + cls.check_config.stderr)
        if cls.steps is None:
            self.wait_for(lambda: urllib.request.urlopen(f"{self.api}/-/ready", timeout=2).status
                          == 200, "prometheus ready")
            # A scrape before the workload, so that rates over it have two samples.
            self.wait_for(lambda: self.query('up{job="kvrecalld"} == 1'), "a first scrape")
            cls.steps = run_workload(cls.server.address)

        def counted():
            result = self.query("sum(kvrecall_layer_steps_total)")
            return result and float(result[0]["value"][1]) == cls.steps

        self.wait_for(counted, f"sum(kvrecall_layer_steps_total) == {cls.steps}")
        # And two samples of each series the sessions made (rates need two).
        self.wait_for(lambda: self.query("min(count_over_time(kvrecall_layer_steps_total[1m])) "
                                         ">= 2"), "two samples of every layer-step series")
        return cls.steps

    def test_prometheus_scrapes_kvrecalld_and_counts_the_layer_steps_sent(self):
        steps = self.served_and_scraped()
        up = self.query('up{job="kvrecalld"}')
        self.assertEqual(up[0]["value"][1], "1")
        by_selector = {r["metric"]["selector"]: float(r["value"][1])
                       for r in self.query("kvrecall_layer_steps_total")}
        self.assertEqual(by_selector, {"exact_topk": steps / 2, "retopk": steps / 2})
        created = self.query('kvrecall_rpcs_total{method="kvrecall.v1.KvRecall/CreateSession",'
                             'code="OK"}')
        self.assertEqual(float(created[0]["value"][1]), 2)

    def test_the_alerting_rules_evaluate_on_the_real_series_and_stay_quiet(self):
        # promtool's unit tests (tests/prometheus_rules_test.yaml) use series of their own;
        # here every rule runs on what kvrecalld exports, without an error, and a healthy
        # server under a small workload fires none of them.
        self.served_and_scraped()

        def evaluated():
            with urllib.request.urlopen(f"{self.api}/api/v1/rules", timeout=5) as r:
                groups = json.load(r)["data"]["groups"]
            rules = [rule for group in groups for rule in group["rules"]]
            return rules if rules and all(rule.get("lastEvaluation", "").startswith("2")
                                          and not rule["lastEvaluation"].startswith("0001")
                                          for rule in rules) else None

        self.wait_for(evaluated, "every rule evaluated")
        rules = evaluated()
        self.assertEqual(len(rules), 13)
        for rule in rules:
            self.assertEqual((rule["health"], rule.get("lastError", "")), ("ok", ""), rule["name"])
            self.assertEqual(rule["state"], "inactive", rule["name"])

    def test_every_dashboard_query_runs_and_the_core_panels_show_the_workload(self):
        self.served_and_scraped()
        with open(self.DASHBOARD) as f:
            dashboard = json.load(f)
        shown = {}
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                # What Grafana sends with every instance selected.
                expr = (target["expr"].replace("$__rate_interval", "1m")
                        .replace("$instance", ".+"))
                shown.setdefault(panel["title"], []).append(bool(self.query(expr)))
        # A workload of two sessions decoding on the CPU, no budget (the budgets' lines are
        # empty), no budget per tenant, no refusal.
        for title in ("Decode request latency", "Layer-step compute p99 by policy",
                      "Layer-steps served", "Head-steps by path", "Sessions and tokens",
                      "Calls by method and code"):
            self.assertTrue(shown[title] and all(shown[title]), title)
        self.assertEqual(shown["Host memory"], [True, False])  # held; no budget
        self.assertEqual(len(shown), len(dashboard["panels"]))

    def wait_for(self, condition, what, timeout=60):
        if not wait_until(condition, timeout):
            self.log.seek(0)
            self.fail(f"timed out waiting for {what}; prometheus said: {self.log.read()[-3000:]}")


class PrometheusJobs:
    """A real prometheus scraping the jobs of a test every second (`start_prometheus`), its
    targets' health read from its API; stopped by the test's cleanup."""

    def start_prometheus(self, tmp, jobs):
        """`jobs`: the scrape_configs entries, as YAML lines indented under the list."""
        config = os.path.join(tmp, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                    "scrape_configs:\n" + jobs)
        checked = subprocess.run(["promtool", "check", "config", config],
                                 capture_output=True, text=True)
        self.assertEqual(checked.returncode, 0, checked.stdout + checked.stderr)
        port = free_port()
        self.prometheus_log = open(os.path.join(tmp, "prometheus.log"), "w+")
        self.addCleanup(self.prometheus_log.close)
        self.prometheus = subprocess.Popen(
            ["prometheus", f"--config.file={config}",
             f"--storage.tsdb.path={tmp}/data", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=self.prometheus_log, stderr=subprocess.STDOUT)
        self.addCleanup(self.prometheus.wait, 30)
        self.addCleanup(self.prometheus.terminate)
        self.prometheus_api = f"http://127.0.0.1:{port}"

    def targets(self):
        with urllib.request.urlopen(f"{self.prometheus_api}/api/v1/targets", timeout=5) as r:
            active = json.load(r)["data"]["activeTargets"]
        return {t["labels"]["job"]: t for t in active}

    def health(self, job):
        return self.targets().get(job, {}).get("health")

    def wait_for(self, condition, what, timeout=60):
        if wait_until(condition, timeout):
            return
        self.prometheus_log.seek(0)
        self.fail(f"timed out waiting for {what}; targets: "
                  f"{self.targets() if self.prometheus.poll() is None else None}; "
                  f"prometheus said: {self.prometheus_log.read()[-3000:]}")


@unittest.skipIf(shutil.which("prometheus") is None,
                 "prometheus is not installed (scripts/install_deps.sh installs Debian's)")
class PrometheusWithTokenTest(PrometheusJobs, unittest.TestCase):
    """kvrecalld --metrics_token_file scraped by a real prometheus: a job that sends the token
    (authorization.credentials_file, as the chart's ServiceMonitor does) is up, one that sends
    none is refused with 401; after SIGHUP a rotated token holds for the next scrape."""

    def test_only_a_scrape_with_the_token_reads_the_metrics_and_sighup_rotates_it(self):
        tmp = tempfile.mkdtemp(prefix="kvrecall-prometheus-token-")
        self.addCleanup(shutil.rmtree, tmp, True)
        server_tokens = os.path.join(tmp, "server-tokens")
        scraper_token = os.path.join(tmp, "scraper-token")
        for path, text in ((server_tokens, "# the scrapers\nfirst-token-0123456789\n"),
                           (scraper_token, "first-token-0123456789\n")):
            with open(path, "w") as f:
                f.write(text)
        server = Kvrecalld(f"--metrics_token_file={server_tokens}")
        self.addCleanup(server.stop)
        target = urllib.parse.urlparse(server.metrics_url).netloc
        with self.assertRaises(urllib.error.HTTPError) as refused:
            scrape(server.metrics_url)
        self.assertEqual(refused.exception.code, 401)
        self.assertIn("Bearer", refused.exception.headers.get("WWW-Authenticate", ""))
        request = urllib.request.Request(
            server.metrics_url, headers={"Authorization": "Bearer first-token-0123456789"})
        with urllib.request.urlopen(request, timeout=10) as r:
            self.assertIn("# TYPE kvrecall_sessions_open gauge", r.read().decode())

        self.start_prometheus(tmp, "  - job_name: with_token\n"
                              f"    authorization:\n      credentials_file: {scraper_token}\n"
                              f"    static_configs:\n      - targets: ['{target}']\n"
                              "  - job_name: without_token\n"
                              f"    static_configs:\n      - targets: ['{target}']\n")
        self.wait_for(lambda: self.health("with_token") == "up"
                      and self.health("without_token") == "down", "one job up, one down")
        self.assertIn("401", self.targets()["without_token"]["lastError"])

        # The server's token rotated, the scraper's not yet: refused after SIGHUP.
        with open(server_tokens, "w") as f:
            f.write("second-token-0123456789\n")
        server.process.send_signal(signal.SIGHUP)
        self.wait_for(lambda: "reloaded 1 metrics tokens from" in server.log(),
                      "the server's reload")
        self.wait_for(lambda: self.health("with_token") == "down", "the old token refused")
        self.assertIn("401", self.targets()["with_token"]["lastError"])
        # prometheus reads credentials_file at every scrape.
        with open(scraper_token, "w") as f:
            f.write("second-token-0123456789\n")
        self.wait_for(lambda: self.health("with_token") == "up", "the new token accepted")

        # A file the server cannot use keeps the tokens in force.
        with open(server_tokens, "w") as f:
            f.write("short\n")
        server.process.send_signal(signal.SIGHUP)
        self.wait_for(lambda: "the metrics tokens in force stay" in server.log(),
                      "the refused reload")
        self.assertIn("token is 5 characters, at least 16 are required", server.log())
        request = urllib.request.Request(
            server.metrics_url, headers={"Authorization": "Bearer second-token-0123456789"})
        with urllib.request.urlopen(request, timeout=10) as r:
            self.assertEqual(r.status, 200)


@unittest.skipIf(shutil.which("prometheus") is None,
                 "prometheus is not installed (scripts/install_deps.sh installs Debian's)")
class PrometheusOverTlsTest(PrometheusJobs, unittest.TestCase):
    """kvrecalld --metrics_tls_cert/--metrics_tls_key (with a token, and with mutual TLS)
    scraped by a real prometheus: a job that trusts the CA (tls_config.ca_file) and sends the
    token is up; one over plain http, one trusting another CA, and, with a client CA, one without
    a client certificate are down."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="kvrecall-prometheus-tls-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.pki = make_pki(self.tmp)
        self.token = os.path.join(self.tmp, "scraper-token")
        with open(self.token, "w") as f:
            f.write("scraper-token-0123456789\n")

    def job(self, name, target, scheme="https", ca="ca.pem", cert=None):
        tls = ""
        if scheme == "https":
            tls = f"    tls_config:\n      ca_file: {self.pki[ca]}\n"
            if cert:
                tls += (f"      cert_file: {self.pki[cert + '.pem']}\n"
                        f"      key_file: {self.pki[cert + '.key']}\n")
        return (f"  - job_name: {name}\n    scheme: {scheme}\n" + tls +
                f"    authorization:\n      credentials_file: {self.token}\n"
                f"    static_configs:\n      - targets: ['{target}']\n")

    def test_prometheus_scrapes_https_with_the_ca_and_nothing_else_reads_it(self):
        server = Kvrecalld(f"--metrics_tls_cert={self.pki['server.pem']}",
                           f"--metrics_tls_key={self.pki['server.key']}",
                           f"--metrics_token_file={self.token}")
        self.addCleanup(server.stop)
        self.assertTrue(server.metrics_url.startswith("https://127.0.0.1:"), server.metrics_url)
        target = urllib.parse.urlparse(server.metrics_url).netloc
        # Python's own TLS client: the CA trusted, the token sent.
        context = ssl.create_default_context(cafile=self.pki["ca.pem"])
        request = urllib.request.Request(
            server.metrics_url, headers={"Authorization": "Bearer scraper-token-0123456789"})
        with urllib.request.urlopen(request, timeout=10, context=context) as r:
            self.assertIn("# TYPE kvrecall_sessions_open gauge", r.read().decode())
        with self.assertRaises(urllib.error.URLError) as untrusted:
            urllib.request.urlopen(server.metrics_url, timeout=10)  # the system's CAs
        self.assertIn("CERTIFICATE_VERIFY_FAILED", str(untrusted.exception))

        self.start_prometheus(self.tmp, self.job("https", target) +
                              self.job("plain_http", target, scheme="http") +
                              self.job("other_ca", target, ca="wrong-ca.pem"))
        self.wait_for(lambda: self.health("https") == "up" and self.health("plain_http") == "down"
                      and self.health("other_ca") == "down", "the https job alone up")
        self.assertIn("certificate", self.targets()["other_ca"]["lastError"])
        self.assertIn("400", self.targets()["plain_http"]["lastError"])
        # The dashboard's TLS panel over this series: the metrics port's chain, valid two days
        # (make_pki's -days 2).
        with open(PrometheusServerTest.DASHBOARD) as f:
            panel = next(p for p in json.load(f)["panels"]
                         if p["title"] == "TLS certificate chain: days left")
        expr = panel["targets"][0]["expr"].replace("$instance", ".+")
        url = f"{self.prometheus_api}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr})
        with urllib.request.urlopen(url, timeout=5) as r:
            result = json.load(r)["data"]["result"]
        self.assertEqual([(s["metric"]["port"], s["metric"]["job"]) for s in result],
                         [("metrics", "https")])
        self.assertTrue(1.9 < float(result[0]["value"][1]) <= 2.0, result)

    def test_with_a_client_ca_a_scraper_needs_its_certificate(self):
        server = Kvrecalld(f"--metrics_tls_cert={self.pki['server.pem']}",
                           f"--metrics_tls_key={self.pki['server.key']}",
                           f"--metrics_tls_client_ca={self.pki['ca.pem']}",
                           f"--metrics_token_file={self.token}")
        self.addCleanup(server.stop)
        target = urllib.parse.urlparse(server.metrics_url).netloc
        self.start_prometheus(self.tmp, self.job("with_cert", target, cert="client") +
                              self.job("without_cert", target))
        self.wait_for(lambda: self.health("with_cert") == "up"
                      and self.health("without_cert") == "down", "the job with a certificate up")

    def test_bad_tls_flags_stop_kvrecalld_naming_the_flag(self):
        for flags, message in (
                ([f"--metrics_tls_cert={self.pki['server.pem']}"],
                 "--metrics_tls_cert and --metrics_tls_key go together"),
                ([f"--metrics_tls_cert={self.pki['server.pem']}",
                  f"--metrics_tls_key={self.pki['client.key']}"],
                 "is not the key of --metrics_tls_cert's certificate")):
            with self.subTest(flags=flags):
                run = subprocess.run([kvrecalld_binary(), "--address=127.0.0.1:0",
                                      "--metrics_address=127.0.0.1:0", *flags],
                                     capture_output=True, text=True, timeout=60)
                self.assertEqual(run.returncode, 2, run.stdout + run.stderr)
                self.assertIn(message, run.stderr)


if __name__ == "__main__":
    unittest.main()
