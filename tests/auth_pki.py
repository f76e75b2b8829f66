"""Certificates for the Python TLS tests, made by openssl: a CA, a server certificate for
127.0.0.1 / localhost, a client certificate signed by the CA, a second CA nobody trusts with a
client certificate of its own, and a token file of two tenants (alice, bob)."""
import os
import subprocess

ALICE_TOKEN = "alice-token-0123456789"
BOB_TOKEN = "bob-token-0123456789ab"


def make_pki(directory):
    """Writes everything into `directory`; returns {name: path}."""
    def path(name):
        return os.path.join(directory, name)

    with open(path("server.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    with open(path("client.ext"), "w") as f:
        f.write("extendedKeyUsage=clientAuth\n")
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        ["req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
         "-subj", "/CN=kvrecall test CA"],
        ["req", "-x509", *key, "-keyout", "wrong-ca.key", "-out", "wrong-ca.pem", "-days", "2",
         "-subj", "/CN=another CA"],
        ["req", *key, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=kvrecalld"],
        ["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
         "-CAcreateserial", "-days", "2", "-extfile", "server.ext", "-out", "server.pem"],
        ["req", *key, "-keyout", "client.key", "-out", "client.csr", "-subj", "/CN=runner"],
        ["x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
         "-CAcreateserial", "-days", "2", "-extfile", "client.ext", "-out", "client.pem"],
    ]
    for step in steps:
        subprocess.run(["openssl", *step], cwd=directory, check=True, capture_output=True)
    with open(path("tokens"), "w") as f:
        f.write(f"{ALICE_TOKEN} alice\n{BOB_TOKEN} bob\n")
    for tenant, token in (("alice", ALICE_TOKEN), ("bob", BOB_TOKEN)):
        with open(path(f"{tenant}.token"), "w") as f:
            f.write(token + "\n")
    names = ["ca.pem", "wrong-ca.pem", "server.pem", "server.key", "client.pem", "client.key",
             "tokens", "alice.token", "bob.token"]
    return {n: path(n) for n in names}
