"""Checks that the Helm chart drives the real kvrecalld the way Kubernetes would.

For the default, the GPU and the secure values (TLS, mutual TLS, tokens): the rendered ports,
probes and Services agree with each other; every flag the chart passes is one kvrecalld
declares (`--helpfull`); kvrecalld started with exactly the chart's arguments (listen addresses
moved to free loopback ports, the Secrets' mount points to a folder of certificates made by
openssl) answers the readiness and liveness probes' grpc.health.v1.Health/Check SERVING,
serves /metrics where the pod's annotations say, takes a call over TLS with a token (secure)
and answers the NOTES' `kvrecall health` on the plaintext health port (secure, given KVRECALL),
and on SIGTERM it exits 0 within the pod's termination grace period. With a co-located runner
it answers on the runner's socket: with the secure values there in plaintext
(--plaintext_unix_sockets) with the runner's token, while the gRPC port keeps mutual TLS.

Usage: deploy_server_test.py KVRECALLD [KVRECALL]   (exits 77, CTest's skip, when helm is missing)
"""

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

import shutil
import ssl
import urllib.error
import urllib.request

import grpc
import yaml

from auth_pki import ALICE_TOKEN, make_pki

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CHART = os.path.join(REPO, "deploy", "helm", "kvrecall")
TOOLS = os.environ.get("KVRECALL_TOOLS_DIR", os.path.join(REPO, ".tools"))
HELM = os.path.join(TOOLS, "bin", "helm")  # the pinned one scripts/install_deps.sh installs
KVRECALLD = None  # set from argv
KVRECALL = None  # the CLI, when given: the NOTES' health check with TLS

VARIANTS = {"default": [], "gpu": ["-f", os.path.join(CHART, "values-gpu.yaml")],
            # Each device's budget and a tenant's share of it set (kvrecalld takes both without
            # a device, as this machine runs it).
            "gpu_budgets": ["-f", os.path.join(CHART, "values-gpu.yaml"),
                            "--set", "gpu.memoryBudget.gib=70",
                            "--set", "gpu.memoryBudget.perTenantGib=8"],
            "secure": ["-f", os.path.join(CHART, "values-secure.yaml")],
            # The API published through a LoadBalancer (allowed with TLS and tokens only): the
            # metrics port moves to a ClusterIP Service of its own.
            "published": ["-f", os.path.join(CHART, "values-secure.yaml"),
                          "--set", "service.type=LoadBalancer"]}
SERVING = 1  # grpc.health.v1.HealthCheckResponse.ServingStatus
METRICS_TOKEN = "metrics-token-0123456789abcdef"  # what the metrics Secret holds


def render(extra_args):
    """The chart's objects for these values, keyed by (kind, name)."""
    with tempfile.TemporaryDirectory() as helm_home:
        env = dict(os.environ, HELM_CACHE_HOME=helm_home + "/cache",
                   HELM_CONFIG_HOME=helm_home + "/config", HELM_DATA_HOME=helm_home + "/data")
        out = subprocess.run([HELM, "template", "kvrecall", CHART, *extra_args], env=env,
                             check=True, capture_output=True, text=True).stdout
    return {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out) if o}


def only(objects, kind):
    found = [o for (k, _), o in objects.items() if k == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def flag_value(args, flag):
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"--{flag}=")]
    return value


def health_check(address, service, timeout_s):
    """Health/Check as the kubelet's gRPC probe sends it: the ServingStatus, or a grpc.RpcError.

    The messages are encoded by hand (HealthCheckRequest{string service = 1},
    HealthCheckResponse{ServingStatus status = 1}) because Debian's grpcio ships no
    grpc_health module; a probe needs nothing more.
    """
    encoded = service.encode()
    assert len(encoded) < 128
    request = (b"\x0a" + bytes([len(encoded)]) + encoded) if encoded else b""
    with grpc.insecure_channel(address) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                    request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
        response = check(request, timeout=timeout_s)
    if response == b"":
        return 0  # proto3 default: UNKNOWN
    if len(response) != 2 or response[0] != 0x08:
        raise AssertionError(f"unexpected HealthCheckResponse bytes {response!r}")
    return response[1]


def list_sessions(address, credentials=None, metadata=None):
    """ListSessions at `address` (plaintext unless `credentials`): the call's status code."""
    channel = (grpc.secure_channel(address, credentials) if credentials is not None
               else grpc.insecure_channel(address))
    with channel:
        call = channel.unary_unary("/kvrecall.v1.KvRecall/ListSessions",
                                   request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        try:
            call(b"", timeout=10, metadata=metadata)
            return grpc.StatusCode.OK
        except grpc.RpcError as error:
            return error.code()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def helpfull_flags():
    """Every flag kvrecalld declares, from absl's --helpfull listing ("    --name (...)")."""
    result = subprocess.run([KVRECALLD, "--helpfull"], capture_output=True, text=True, timeout=30)
    return set(re.findall(r"^\s+--([A-Za-z0-9_]+) \(", result.stdout + result.stderr, re.M))


class ChartDrivesKvrecalld(unittest.TestCase):
    maxDiff = None

    @classmethod
    def setUpClass(cls):
        cls.declared_flags = helpfull_flags()
        # A sanity floor: a parse that finds nothing would make the flag check vacuous.
        assert {"address", "max_message_mb", "host_memory_budget_gb"} <= cls.declared_flags, (
            f"--helpfull parse found only {sorted(cls.declared_flags)}")

    def chart(self, variant):
        objects = render(VARIANTS[variant])
        statefulset = only(objects, "StatefulSet")
        pod = statefulset["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        return objects, statefulset, pod, container

    def test_ports_probes_and_services_agree(self):
        for variant in VARIANTS:
            with self.subTest(variant=variant):
                objects, statefulset, pod, container = self.chart(variant)
                args = container["args"]
                listen_port = int(flag_value(args, "address").rsplit(":", 1)[1])
                metrics_port = int(flag_value(args, "metrics_address").rsplit(":", 1)[1])
                ports = {p["name"]: p["containerPort"] for p in container["ports"]}
                want = {"grpc": listen_port, "metrics": metrics_port}
                tls = any(a.startswith("--tls_cert=") for a in args)
                if tls:
                    want["health"] = int(flag_value(args, "health_address").rsplit(":", 1)[1])
                self.assertEqual(ports, want)
                # The kubelet's gRPC probes cannot speak TLS: with it they call the health port.
                for probe in ("readinessProbe", "livenessProbe"):
                    self.assertEqual(container[probe]["grpc"]["port"],
                                     want["health"] if tls else listen_port, probe)
                annotations = pod["metadata"]["annotations"]
                self.assertEqual((annotations["prometheus.io/scrape"], annotations["prometheus.io/port"],
                                  annotations["prometheus.io/path"]),
                                 ("true", str(metrics_port), "/metrics"))
                services = [o for (k, _), o in objects.items() if k == "Service"]
                headless = [s for s in services if s["spec"].get("clusterIP") == "None"]
                self.assertEqual([s["metadata"]["name"] for s in headless],
                                 [statefulset["spec"]["serviceName"]])
                # The API's Service has the release's full name, as the StatefulSet has.
                (api,) = [s for s in services
                          if s["metadata"]["name"] == statefulset["metadata"]["name"]]
                published = api["spec"].get("type", "ClusterIP") != "ClusterIP"
                self.assertEqual(published, variant == "published")
                # The metrics port (plain HTTP; secured, a bearer token) is on one ClusterIP Service
                # only: the API's while it is ClusterIP, else a "-metrics" Service of its own.
                # A ServiceMonitor selecting every Service thus scrapes each pod once, and a
                # NodePort or LoadBalancer never publishes metrics.
                self.assertEqual(len(services), 3 if published else 2)
                with_metrics = []
                for service in services:
                    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
                    if service in headless or (service is api and published):
                        names = {"grpc"}
                    elif service is api:
                        names = {"grpc", "metrics"}
                    else:
                        self.assertEqual(service["metadata"]["name"], api["metadata"]["name"] + "-metrics")
                        names = {"metrics"}
                    self.assertEqual(set(service_ports), names, service["metadata"]["name"])
                    if "grpc" in service_ports:
                        self.assertEqual(service_ports["grpc"]["targetPort"], "grpc")
                        self.assertEqual(service_ports["grpc"]["appProtocol"], "grpc")
                    if "metrics" in service_ports:
                        self.assertEqual(service.get("spec", {}).get("type", "ClusterIP"), "ClusterIP")
                        self.assertEqual(service_ports["metrics"]["targetPort"], "metrics")
                        self.assertEqual(service_ports["metrics"]["port"], metrics_port)
                        with_metrics.append(service)
                    self.assertEqual(service["spec"]["selector"].items()
                                     - pod["metadata"]["labels"].items(), set())
                self.assertEqual(len(with_metrics), 1)
                monitors = [o for (k, _), o in objects.items() if k == "ServiceMonitor"]
                self.assertEqual(len(monitors), 1 if variant in ("secure", "published") else 0)
                for monitor in monitors:
                    (endpoint,) = monitor["spec"]["endpoints"]
                    self.assertEqual((endpoint["port"], endpoint["path"]), ("metrics", "/metrics"))
                    # HTTPS where kvrecalld serves it, checked against the TLS Secret's CA.
                    https = any(a.startswith("--metrics_tls_cert=") for a in args)
                    self.assertEqual(endpoint["scheme"], "https" if https else "http")
                    self.assertEqual(annotations.get("prometheus.io/scheme", "http"),
                                     endpoint["scheme"])
                    if https:
                        self.assertEqual(flag_value(args, "metrics_tls_cert").rsplit("/", 1)[0],
                                         flag_value(args, "tls_cert").rsplit("/", 1)[0])
                        ca = endpoint["tlsConfig"]["ca"]["secret"]
                        (tls_volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "tls"]
                        self.assertEqual((ca["name"], ca["key"]),
                                         (tls_volume["secret"]["secretName"], "ca.crt"))
                    self.assertEqual(monitor["spec"]["selector"]["matchLabels"].items()
                                     - with_metrics[0]["metadata"]["labels"].items(), set())
                self.assertEqual(statefulset["spec"]["selector"]["matchLabels"].items()
                                 - pod["metadata"]["labels"].items(), set())
                pdb = only(objects, "PodDisruptionBudget")
                self.assertEqual(pdb["spec"]["selector"], statefulset["spec"]["selector"])
                account = only(objects, "ServiceAccount")
                self.assertEqual(pod["spec"]["serviceAccountName"], account["metadata"]["name"])

    def test_every_flag_the_chart_passes_exists(self):
        for variant in VARIANTS:
            with self.subTest(variant=variant):
                _, _, _, container = self.chart(variant)
                for arg in container["args"]:
                    match = re.fullmatch(r"--([A-Za-z0-9_]+)=.*", arg)
                    self.assertIsNotNone(match, f"chart arg {arg!r} is not --flag=value")
                    self.assertIn(match.group(1), self.declared_flags,
                                  f"kvrecalld has no flag --{match.group(1)}")

    def test_kvrecalld_serves_probes_and_stops_on_sigterm(self):
        for variant in VARIANTS:
            with self.subTest(variant=variant):
                _, _, pod, container = self.chart(variant)
                port, metrics_port, health_port = free_port(), free_port(), free_port()
                secrets = tempfile.TemporaryDirectory(prefix="kvrecall-secrets-")
                self.addCleanup(secrets.cleanup)
                args = self.local_args(container["args"], port, metrics_port, health_port,
                                       secrets.name)
                # What the downward API gives OMP_NUM_THREADS: requests.cpu rounded up.
                cpus = str(-(-int(float(container["resources"]["requests"]["cpu"]))))
                env = dict(os.environ, OMP_NUM_THREADS=cpus)
                server = subprocess.Popen([KVRECALLD, *args], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True)
                try:
                    tls = any(a.startswith("--tls_cert=") for a in args)
                    probe_address = f"127.0.0.1:{health_port if tls else port}"
                    self.assert_probes_pass(server, probe_address, container)
                    annotations = pod["metadata"]["annotations"]
                    scheme = annotations.get("prometheus.io/scheme", "http")
                    url = (f"{scheme}://127.0.0.1:{metrics_port}"
                           f"{annotations['prometheus.io/path']}")
                    headers = {}
                    # HTTPS: the certificate of the TLS Secret, checked against its ca.crt.
                    context = (ssl.create_default_context(
                        cafile=os.path.join(secrets.name, "tls", "ca.crt"))
                        if scheme == "https" else None)
                    if any(a.startswith("--metrics_token_file=") for a in args):
                        # Secured: none without the token, which the ServiceMonitor sends.
                        with self.assertRaises(urllib.error.HTTPError) as refused:
                            urllib.request.urlopen(url, timeout=10, context=context)
                        self.assertEqual(refused.exception.code, 401)
                        headers = {"Authorization": f"Bearer {METRICS_TOKEN}"}
                    with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                                timeout=10, context=context) as r:
                        self.assertIn("\nkvrecall_build_info{", r.read().decode())
                    if tls:
                        self.assert_tls_and_token_required(f"127.0.0.1:{port}", secrets.name)
                    if tls and KVRECALL is not None:
                        # The NOTES' check of the plaintext health port (no reflection there).
                        check = subprocess.run(
                            [KVRECALL, "health", f"--server=127.0.0.1:{health_port}"],
                            capture_output=True, text=True, timeout=30,
                            env=dict(os.environ, KVRECALL_TOKEN_FILE=""))
                        self.assertEqual((check.returncode, check.stdout), (0, "SERVING\n"),
                                         check.stderr)
                    grace = pod["spec"]["terminationGracePeriodSeconds"]
                    server.send_signal(signal.SIGTERM)
                    output, _ = server.communicate(timeout=grace)
                    self.assertEqual(server.returncode, 0, output)
                    self.assertIn("kvrecalld: stopped", output)
                finally:
                    if server.poll() is None:
                        server.kill()
                        server.communicate()

    def test_colocated_runner_reaches_kvrecalld_over_the_socket(self):
        # colocatedRunner: the runner's KVRECALL_ADDRESS is a Unix socket that kvrecalld,
        # started with the chart's arguments, answers on (the socket directory is the emptyDir's
        # mount point; here a temporary directory stands in for it).
        with tempfile.TemporaryDirectory(prefix="kvrecall-sock-") as socket_dir:
            objects = render(["--set", "colocatedRunner.enabled=true", "--set",
                              "colocatedRunner.image=runner:1", "--set",
                              f"colocatedRunner.socketDir={socket_dir}"])
            pod = only(objects, "StatefulSet")["spec"]["template"]
            containers = {c["name"]: c for c in pod["spec"]["containers"]}
            self.assertEqual(set(containers), {"kvrecalld", "runner"})
            (volume,) = pod["spec"]["volumes"]
            for c in containers.values():
                self.assertIn({"name": volume["name"], "mountPath": socket_dir}, c["volumeMounts"])
            runner_env = {e["name"]: e["value"] for e in containers["runner"]["env"]}
            socket_address = runner_env["KVRECALL_ADDRESS"]
            port, metrics_port = free_port(), free_port()
            # Loopback ports: the chart's metrics port (9090) may be taken on a shared machine.
            metrics = f"--metrics_address=127.0.0.1:{metrics_port}"
            args = [re.sub(r"^--metrics_address=.*", metrics,
                           re.sub(r"^--address=[^,]*", f"--address=127.0.0.1:{port}", a))
                    for a in containers["kvrecalld"]["args"]]
            self.assertIn(f"--address=127.0.0.1:{port},{socket_address}", args)
            server = subprocess.Popen([KVRECALLD, *args], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
            try:
                self.assert_probes_pass(server, f"127.0.0.1:{port}", containers["kvrecalld"])
                self.assertEqual(health_check(socket_address, "kvrecall.v1.KvRecall", 5), SERVING)
                server.send_signal(signal.SIGTERM)
                output, _ = server.communicate(timeout=pod["spec"]["terminationGracePeriodSeconds"])
                self.assertEqual(server.returncode, 0, output)
                self.assertIn(f"kvrecalld also listening on {socket_address}", output)
            finally:
                if server.poll() is None:
                    server.kill()
                    server.communicate()

    def test_colocated_runner_with_tls_and_tokens_uses_the_plaintext_socket(self):
        # Secure values with a co-located runner: kvrecalld keeps mutual TLS and tokens on its
        # port, serves the runner's socket in plaintext (--plaintext_unix_sockets), and checks
        # the token the runner reads from its own Secret (KVRECALL_TOKEN_FILE) there too.
        with tempfile.TemporaryDirectory(prefix="kvrecall-sock-") as socket_dir, \
                tempfile.TemporaryDirectory(prefix="kvrecall-secrets-") as secrets_dir:
            objects = render(VARIANTS["secure"] + [
                "--set", "colocatedRunner.enabled=true", "--set", "colocatedRunner.image=runner:1",
                "--set", f"colocatedRunner.socketDir={socket_dir}",
                "--set", "colocatedRunner.tokenSecretName=kvrecall-tokens",
                "--set", "colocatedRunner.tokenSecretKey=runner"])
            pod = only(objects, "StatefulSet")["spec"]["template"]
            containers = {c["name"]: c for c in pod["spec"]["containers"]}
            self.assertEqual(set(containers), {"kvrecalld", "runner"})
            runner = containers["runner"]
            runner_env = {e["name"]: e["value"] for e in runner["env"]}
            socket_address = runner_env["KVRECALL_ADDRESS"]
            self.assertEqual(runner_env["KVRECALL_TOKEN_FILE"], "/etc/kvrecall/runner/runner")
            # The runner mounts the socket directory and its token, not the server's Secrets.
            self.assertEqual(sorted(m["mountPath"] for m in runner["volumeMounts"]),
                             sorted([socket_dir, "/etc/kvrecall/runner"]))
            (token_volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "runner-token"]
            self.assertEqual(token_volume["secret"]["items"], [{"key": "runner", "path": "runner"}])
            chart_args = containers["kvrecalld"]["args"]
            self.assertIn("--plaintext_unix_sockets=true", chart_args)
            self.assertTrue(flag_value(chart_args, "address").endswith("," + socket_address))
            for arg in chart_args:
                self.assertIn(re.fullmatch(r"--([A-Za-z0-9_]+)=.*", arg).group(1),
                              self.declared_flags)
            port, metrics_port, health_port = free_port(), free_port(), free_port()
            args = [f"--address=127.0.0.1:{port},{socket_address}" if a.startswith("--address=")
                    else a
                    for a in self.local_args(chart_args, port, metrics_port, health_port,
                                             secrets_dir)]
            # What the runner's Secret would hold: alice's token.
            token_file = runner_env["KVRECALL_TOKEN_FILE"].replace("/etc/kvrecall/",
                                                                   f"{secrets_dir}/")
            os.makedirs(os.path.dirname(token_file))
            shutil.copy(os.path.join(secrets_dir, "pki", "alice.token"), token_file)
            with open(token_file) as f:
                token = f.readline().strip()
            server = subprocess.Popen([KVRECALLD, *args], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
            try:
                self.assert_probes_pass(server, f"127.0.0.1:{health_port}",
                                        containers["kvrecalld"])
                self.assertEqual(health_check(socket_address, "kvrecall.v1.KvRecall", 5), SERVING)
                local_with_token = grpc.composite_channel_credentials(
                    grpc.local_channel_credentials(grpc.LocalConnectionType.UDS),
                    grpc.access_token_call_credentials(token))
                bearer = [("authorization", f"Bearer {token}")]
                for credentials, metadata, code in (
                        (local_with_token, None, grpc.StatusCode.OK),
                        (None, bearer, grpc.StatusCode.OK),
                        (None, None, grpc.StatusCode.UNAUTHENTICATED)):
                    self.assertEqual(list_sessions(socket_address, credentials, metadata), code)
                # The gRPC port: no plaintext, mutual TLS with a token as before.
                self.assertEqual(list_sessions(f"127.0.0.1:{port}", None, bearer),
                                 grpc.StatusCode.UNAVAILABLE)
                self.assert_tls_and_token_required(f"127.0.0.1:{port}", secrets_dir)
                server.send_signal(signal.SIGTERM)
                output, _ = server.communicate(timeout=pod["spec"]["terminationGracePeriodSeconds"])
                self.assertEqual(server.returncode, 0, output)
                self.assertIn(f"kvrecalld also listening on {socket_address}", output)
            finally:
                if server.poll() is None:
                    server.kill()
                    server.communicate()

    @staticmethod
    def local_args(args, port, metrics_port, health_port, secrets_dir):
        """The chart's args with loopback ports and the Secrets' mounts under `secrets_dir`,
        which then holds what the Secrets would: certificates made by openssl (auth_pki.py)
        under tls/ (tls.crt, tls.key, ca.crt), the token file under auth/ and the metrics token
        (METRICS_TOKEN) under metrics/."""
        moved = {"address": f"127.0.0.1:{port}", "metrics_address": f"127.0.0.1:{metrics_port}",
                 "health_address": f"127.0.0.1:{health_port}"}
        out = []
        for a in args:
            flag = a[2:].split("=", 1)[0]
            if flag in moved:
                a = f"--{flag}={moved[flag]}"
            out.append(a.replace("=/etc/kvrecall/", f"={secrets_dir}/"))
        if any(a.startswith("--tls_cert=") for a in out):
            pki_dir = os.path.join(secrets_dir, "pki")
            os.makedirs(pki_dir)
            pki = make_pki(pki_dir)
            for name, source in (("tls/tls.crt", "server.pem"), ("tls/tls.key", "server.key"),
                                 ("tls/ca.crt", "ca.pem"), ("auth/tokens", "tokens")):
                os.makedirs(os.path.dirname(os.path.join(secrets_dir, name)), exist_ok=True)
                shutil.copy(pki[source], os.path.join(secrets_dir, name))
        for a in out:
            if a.startswith("--metrics_token_file="):  # the Secret's key holds the token alone
                path = a.split("=", 1)[1]
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    f.write(METRICS_TOKEN + "\n")
        return out

    def assert_tls_and_token_required(self, address, secrets_dir):
        """ListSessions over mutual TLS: OK with a tenant's token, UNAUTHENTICATED without."""
        pki = os.path.join(secrets_dir, "pki")

        def read(name):
            with open(os.path.join(pki, name), "rb") as f:
                return f.read()

        credentials = grpc.ssl_channel_credentials(read("ca.pem"), read("client.key"),
                                                   read("client.pem"))
        with_token = grpc.composite_channel_credentials(
            credentials, grpc.access_token_call_credentials(ALICE_TOKEN))
        for creds, code in ((with_token, grpc.StatusCode.OK),
                            (credentials, grpc.StatusCode.UNAUTHENTICATED)):
            with grpc.secure_channel(address, creds) as channel:
                call = channel.unary_unary("/kvrecall.v1.KvRecall/ListSessions",
                                           request_serializer=lambda b: b,
                                           response_deserializer=lambda b: b)
                try:
                    call(b"", timeout=10)
                    got = grpc.StatusCode.OK
                except grpc.RpcError as error:
                    got = error.code()
                self.assertEqual(got, code)

    def assert_probes_pass(self, server, address, container):
        probes = {name: container[name]["grpc"].get("service", "")
                  for name in ("readinessProbe", "livenessProbe")}
        deadline = time.monotonic() + 30
        while True:
            if server.poll() is not None:
                self.fail(f"kvrecalld exited {server.returncode}: {server.stdout.read()}")
            try:
                health_check(address, probes["livenessProbe"], timeout_s=1)
                break
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        for name, service in probes.items():
            timeout = container[name].get("timeoutSeconds", 1)
            self.assertEqual(health_check(address, service, timeout_s=timeout), SERVING,
                             f"{name} (service {service!r})")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: deploy_server_test.py KVRECALLD [KVRECALL]")
    KVRECALL = sys.argv.pop(2) if len(sys.argv) == 3 else None
    KVRECALLD = sys.argv.pop(1)
    if not os.access(HELM, os.X_OK):
        print(f"SKIP: {HELM} not found (scripts/install_deps.sh installs it)")
        sys.exit(77)
    unittest.main(verbosity=2)
