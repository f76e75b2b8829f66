"""The Python client as a package: `pip install ./client/python` into a fresh virtual
environment (--system-site-packages, where Debian's grpcio, protobuf and numpy live; no package
index is reachable, hence --no-build-isolation --no-index), then, from outside the checkout,
`import kvrecall`, its stubs (generated from proto/ during the build, equal to what protoc makes
of proto/ now), its CLI entry points, and a real session over TLS with a bearer token against
kvrecalld. Run by CTest (client/python/CMakeLists.txt) with KVRECALLD set."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

from auth_pki import ALICE_TOKEN, make_pki
from kvrecalld_process import SOURCE_DIR, Kvrecalld

ENTRY_POINTS = ["kvrecall-ppl", "kvrecall-needles", "kvrecall-evaluate", "kvrecall-hf-demo"]


def run(command, **kwargs):
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


class PackageTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="kvrecall-pip-")
        # The package is built from a copy of the checkout's client/python and proto/ (the same
        # relative layout), so that the build's files do not land in the source tree.
        tree = os.path.join(cls.tmp, "src")
        shutil.copytree(os.path.join(SOURCE_DIR, "proto"), os.path.join(tree, "proto"))
        shutil.copytree(os.path.join(SOURCE_DIR, "client", "python"),
                        os.path.join(tree, "client", "python"),
                        ignore=shutil.ignore_patterns("_gen", "__pycache__", "build", "*.egg-info"))
        cls.venv = os.path.join(cls.tmp, "venv")
        made = run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", cls.venv])
        assert made.returncode == 0, made.stdout + made.stderr
        cls.venv_python = os.path.join(cls.venv, "bin", "python")
        cls.install = run([cls.venv_python, "-m", "pip", "install", "--no-build-isolation",
                           "--no-index", "./client/python"], cwd=tree)
        # Everything below runs from an empty folder, outside the checkout and its copy.
        cls.elsewhere = os.path.join(cls.tmp, "elsewhere")
        os.mkdir(cls.elsewhere)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def run_python(self, code, *args):
        return run([self.venv_python, "-c", textwrap.dedent(code), *args], cwd=self.elsewhere,
                   env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})

    def test_pip_install_succeeds_offline(self):
        self.assertEqual(self.install.returncode, 0, self.install.stdout + self.install.stderr)
        self.assertIn("Successfully installed kvrecall-0.1.0", self.install.stdout)

    def test_import_finds_the_installed_package_and_its_generated_stubs(self):
        r = self.run_python("""
            import json, sys, kvrecall, kvrecall.v1.kvrecall_pb2 as pb
            import kvrecall.v1.kvrecall_pb2_grpc as pb_grpc
            print(json.dumps({"file": kvrecall.__file__, "stubs": pb.__file__,
                              "torch": "torch" in sys.modules,
                              "descriptor": pb.DESCRIPTOR.serialized_pb.hex(),
                              "stub": hasattr(pb_grpc, "KvRecallStub")}))
            """)
        self.assertEqual(r.returncode, 0, r.stderr)
        got = json.loads(r.stdout)
        site = os.path.join(self.venv, "lib")
        self.assertTrue(got["file"].startswith(site), got["file"])
        self.assertTrue(got["stubs"].startswith(site), got["stubs"])
        self.assertTrue(got["stub"])
        self.assertFalse(got["torch"], "import kvrecall must not need the hf extra")
        # The stubs describe proto/ as it is now: protoc's descriptor of the .proto, field for
        # field.
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "set.pb")
            protoc = run(["protoc", f"-I{os.path.join(SOURCE_DIR, 'proto')}",
                          f"--descriptor_set_out={out}", "kvrecall/v1/kvrecall.proto"])
            self.assertEqual(protoc.returncode, 0, protoc.stderr)
            compare = self.run_python("""
                import sys
                from google.protobuf import descriptor_pb2
                s = descriptor_pb2.FileDescriptorSet()
                s.ParseFromString(open(sys.argv[1], "rb").read())
                installed = descriptor_pb2.FileDescriptorProto()
                installed.ParseFromString(bytes.fromhex(sys.argv[2]))
                def drop_json_names(messages):  # generated code leaves out the derived json_name
                    for m in messages:
                        for f in m.field:
                            f.ClearField("json_name")
                        drop_json_names(m.nested_type)
                drop_json_names(s.file[0].message_type)
                print(s.file[0] == installed, installed.name, len(installed.service[0].method))
                """, out, got["descriptor"])
        self.assertEqual(compare.returncode, 0, compare.stderr)
        self.assertTrue(compare.stdout.startswith("True kvrecall/v1/kvrecall.proto"),
                        compare.stdout)

    def test_entry_points_are_installed_and_run(self):
        for name in ENTRY_POINTS:
            path = os.path.join(self.venv, "bin", name)
            self.assertTrue(os.access(path, os.X_OK), f"{name} not installed")
        for name in ["kvrecall-ppl", "kvrecall-needles", "kvrecall-evaluate"]:
            r = run([os.path.join(self.venv, "bin", name), "--help"], cwd=self.elsewhere)
            self.assertEqual(r.returncode, 0, f"{name}: {r.stderr}")
            self.assertIn("usage:", r.stdout)
        r = run([os.path.join(self.venv, "bin", "kvrecall-ppl"), "ppl", "--help"],
                cwd=self.elsewhere)
        self.assertIn("--token-file", r.stdout)
        # Without an argument the tool says what it needs (argparse's exit status 2).
        r = run([os.path.join(self.venv, "bin", "kvrecall-needles")], cwd=self.elsewhere)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--server, --trace and --runs are required", r.stderr)

    def test_hf_is_an_optional_extra(self):
        r = self.run_python("""
            from importlib.metadata import metadata
            m = metadata("kvrecall")
            print(m.get_all("Provides-Extra"))
            print([r for r in m.get_all("Requires-Dist") if "extra" in r])
            """)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("['hf']", r.stdout)
        self.assertIn("torch", r.stdout)
        self.assertIn("transformers", r.stdout)

    def test_installed_client_decodes_over_tls_with_a_token(self):
        with tempfile.TemporaryDirectory(prefix="kvrecall-pki-") as d:
            pki = make_pki(d)
            with Kvrecalld(f"--tls_cert={pki['server.pem']}", f"--tls_key={pki['server.key']}",
                           f"--tls_client_ca={pki['ca.pem']}",
                           f"--auth_token_file={pki['tokens']}") as server:
                r = self.run_python("""
                    import json, sys, numpy as np, grpc, kvrecall
                    from kvrecall.client import Tls, make_geometry, make_policy
                    address, ca, cert, key, token = sys.argv[1:]
                    tls = Tls(ca=ca, cert=cert, key=key)
                    rng = np.random.default_rng(1)
                    q, k, v = (rng.standard_normal((8, h, 16), dtype=np.float32) for h in (2, 1, 1))
                    with kvrecall.Client(address, tls=tls, token=token, wait_ready_s=30) as c:
                        s = c.create_session(make_geometry(1, 2, 1, 16), make_policy("full"))
                        s.prefill([(q, k, v)])
                        qt, kt, vt = (rng.standard_normal((h, 16), dtype=np.float32)
                                      for h in (2, 1, 1))
                        out = s.attend(0, qt, kt, vt).output
                        keys, values = np.concatenate([k, kt[None]]), np.concatenate([v, vt[None]])
                        want = []
                        for h in range(2):
                            w = np.exp(keys[:, 0] @ qt[h] / 4.0)
                            want.append((w / w.sum()) @ values[:, 0])
                        error = float(np.abs(out - np.array(want)).max())
                        s.close()
                    try:
                        kvrecall.Client(address, tls=tls, wait_ready_s=30).list_sessions()
                        code = "OK"
                    except kvrecall.KvRecallError as e:
                        code = e.code.name
                    print(json.dumps({"error": error, "without_token": code}))
                    """, server.address, pki["ca.pem"], pki["client.pem"], pki["client.key"],
                    ALICE_TOKEN)
        self.assertEqual(r.returncode, 0, r.stderr)
        got = json.loads(r.stdout)
        self.assertLess(got["error"], 1e-5)
        self.assertEqual(got["without_token"], "UNAUTHENTICATED")


if __name__ == "__main__":
    unittest.main()
