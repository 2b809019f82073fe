"""An agent's serving certificate through the real CertificateSigningRequest API.

The operator runs as a subprocess (its CA in a Secret of its namespace). The agent side is the
agent's own code (``tlsserve.ServingCertKeeper`` with its key-making child and
``kube.CertificateRequester``), calling the API server as the agents' service account with a
token bound to a pod on a KWOK node: impersonated here (user, group and the
``authentication.kubernetes.io/node-name`` extra the API server adds for a pod-bound token),
with the RBAC the chart grants the agent (CSR create and get). Checked: the operator approves
and signs a request for the node's own address (KWOK nodes: InternalIP 127.0.0.1), the
certificate verifies against the CA in the operator's Secret in a real TLS handshake for that
address, and a request for another address is denied with the reason.
"""

from __future__ import annotations

import base64
import json
import socket
import ssl
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_support import get_json
from rlenergy_agent import kube as agent_kube
from rlenergy_agent import tlsserve
from rlenergy_dev.devcluster import DevCluster
from test_pod_injection import Operator

AGENT_SA = "rlenergy-node-agent"


@pytest.fixture
def operator_ns(dev_cluster: DevCluster, crds: None, tmp_path: Path) -> Iterator[str]:
    op_ns = f"rlenergy-op-{uuid.uuid4().hex[:6]}"
    dev_cluster.kubectl("create", "namespace", op_ns)
    role = f"rlenergy-agent-csr-{op_ns}"
    rules = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": role},
        "rules": [
            {
                "apiGroups": ["certificates.k8s.io"],
                "resources": ["certificatesigningrequests"],
                "verbs": ["create", "get"],
            }
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": role},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": AGENT_SA, "namespace": op_ns}],
    }
    for doc in (rules, binding):
        dev_cluster.kubectl("apply", "-f", "-", input=json.dumps(doc))
    op = Operator(dev_cluster, op_ns, "", tmp_path / "operator.log")
    try:
        op.start()
        yield op_ns
    finally:
        op.stop()
        dev_cluster.kubectl("delete", "clusterrolebinding,clusterrole", role, check=False)
        dev_cluster.kubectl("delete", "namespace", op_ns, "--wait=false", check=False)
        log = op.log.read_text(errors="replace") if op.log.exists() else ""
        assert "Traceback (most recent call last)" not in log, log[-4000:]


def _as_agent(cluster: DevCluster, op_ns: str, node: str) -> Any:
    """The agent's ApiClient calling the API server as the agent of ``node`` (impersonation)."""
    from rlenergy_agent import kubeapi

    headers = {
        "Impersonate-User": f"system:serviceaccount:{op_ns}:{AGENT_SA}",
        "Impersonate-Group": "system:serviceaccounts",
        "Impersonate-Extra-authentication.kubernetes.io%2fnode-name": node,
    }
    return kubeapi.ApiClient(kubeapi.from_kubeconfig(cluster.kubeconfig), headers=headers)


def _handshake(cert: Path, key: Path, ca_pem: bytes, address: str) -> dict[str, Any]:
    """A TLS handshake over a socket pair: server with ``cert``, client trusting ``ca_pem``."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cadata=ca_pem.decode())
    a, b = socket.socketpair()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            with server_ctx.wrap_socket(a, server_side=True) as s:
                s.recv(1)
        except (ssl.SSLError, OSError) as exc:
            errors.append(exc)

    t = threading.Thread(target=serve)
    t.start()
    with client_ctx.wrap_socket(b, server_hostname=address) as c:
        peer = c.getpeercert()
        c.sendall(b"x")
    t.join(timeout=10)
    assert not errors, errors
    return dict(peer)


def test_the_operator_signs_the_agents_request_for_its_own_node(
    dev_cluster: DevCluster, operator_ns: str, tmp_path: Path
) -> None:
    node = dev_cluster.nodes[0]
    addresses = get_json(dev_cluster, "node", node)["status"]["addresses"]
    ip = next(a["address"] for a in addresses if a["type"] == "InternalIP")
    requester = agent_kube.CertificateRequester(_as_agent(dev_cluster, operator_ns, node))
    keeper = tlsserve.ServingCertKeeper(node, [ip], tmp_path / "tls", requester.request)
    assert keeper.ensure() is True
    assert keeper.due() is None
    secret = get_json(dev_cluster, "secret", "rlenergy-ca", "-n", operator_ns)
    ca_pem = base64.b64decode(secret["data"]["tls.crt"])
    peer = _handshake(keeper.cert_file, keeper.key_file, ca_pem, ip)
    assert ("IP Address", ip) in peer["subjectAltName"]

    # another address than the node's: denied, with the operator's reason
    other = tlsserve.ServingCertKeeper(node, ["10.9.9.9"], tmp_path / "other", requester.request)
    with pytest.raises(RuntimeError, match="denied.*10.9.9.9"):
        other.ensure()
    assert not other.cert_file.exists()
