"""Checks that the Helm chart drives the real kvrecalld the way Kubernetes would.

For the default and the GPU values: the rendered ports, probes and Services agree with each
other; every flag the chart passes is one kvrecalld declares (`--helpfull`); kvrecalld started
with exactly the chart's arguments (the listen address moved to a free loopback port) answers
the readiness and liveness probes' grpc.health.v1.Health/Check SERVING, and on SIGTERM it
exits 0 within the pod's termination grace period.

Usage: deploy_server_test.py KVRECALLD   (exits 77, CTest's skip, when helm is missing)
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

import grpc
import yaml

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CHART = os.path.join(REPO, "deploy", "helm", "kvrecall")
TOOLS = os.environ.get("KVRECALL_TOOLS_DIR", os.path.join(REPO, ".tools"))
HELM = os.path.join(TOOLS, "bin", "helm")  # the pinned one scripts/install_deps.sh installs
KVRECALLD = None  # set from argv

VARIANTS = {"default": [], "gpu": ["-f", os.path.join(CHART, "values-gpu.yaml")]}
SERVING = 1  # grpc.health.v1.HealthCheckResponse.ServingStatus


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
                address = [a for a in container["args"] if a.startswith("--address=")]
                self.assertEqual(len(address), 1, container["args"])
                listen_port = int(address[0].rsplit(":", 1)[1])
                (port,) = container["ports"]
                self.assertEqual((port["name"], port["containerPort"]), ("grpc", listen_port))
                for probe in ("readinessProbe", "livenessProbe"):
                    self.assertEqual(container[probe]["grpc"]["port"], listen_port, probe)
                services = [o for (k, _), o in objects.items() if k == "Service"]
                self.assertEqual(len(services), 2)
                headless = [s for s in services if s["spec"].get("clusterIP") == "None"]
                self.assertEqual([s["metadata"]["name"] for s in headless],
                                 [statefulset["spec"]["serviceName"]])
                for service in services:
                    (service_port,) = service["spec"]["ports"]
                    self.assertEqual(service_port["targetPort"], "grpc")
                    self.assertEqual(service_port["appProtocol"], "grpc")
                    self.assertEqual(service["spec"]["selector"].items()
                                     - pod["metadata"]["labels"].items(), set())
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
                port = free_port()
                args = [f"--address=127.0.0.1:{port}" if a.startswith("--address=") else a
                        for a in container["args"]]
                # What the downward API gives OMP_NUM_THREADS: requests.cpu rounded up.
                cpus = str(-(-int(float(container["resources"]["requests"]["cpu"]))))
                env = dict(os.environ, OMP_NUM_THREADS=cpus)
                server = subprocess.Popen([KVRECALLD, *args], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True)
                try:
                    self.assert_probes_pass(server, f"127.0.0.1:{port}", container)
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
            port = free_port()
            args = [re.sub(r"^--address=[^,]*", f"--address=127.0.0.1:{port}", a)
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
    if len(sys.argv) != 2:
        sys.exit("usage: deploy_server_test.py KVRECALLD")
    KVRECALLD = sys.argv.pop(1)
    if not os.access(HELM, os.X_OK):
        print(f"SKIP: {HELM} not found (scripts/install_deps.sh installs it)")
        sys.exit(77)
    unittest.main(verbosity=2)
