"""Least privilege, checked by the real API server (``make test-privilege``; in ``make test``).

The chart is installed with helm (the operator as a local process where it must run); every
allow/deny below is the API server's answer, through one of three real paths:

* **a pod-bound token**: a pod of the agent's ServiceAccount on KWOK node A, a TokenRequest
  bound to that pod (the API server puts ``authentication.kubernetes.io/node-name: A`` in the
  token's user info, shown by a TokenReview), and the agent's own ``ReportWriter`` writing
  reports with it. The chart's ValidatingAdmissionPolicy lets it write node A's report and
  refuses node B's (create, a patch moving a report to another node, a patch of B's report,
  a label naming B), every write with a token bound to no pod, and a report created under a
  name other than its policy's report of node A (B's report name squatted, an old unhashed
  name, a free name) or labelled for another policy; reads stay allowed;
* **a trainer's pod-bound token** through the SDK's ``PodAnnotator``: a ServiceAccount bound
  to the chart's ``trainer-annotations`` ClusterRole patches its own pod's ``rlenergy.io/*``
  annotations; the chart's second policy refuses it another pod of its namespace, any other
  annotation, label or spec change of its own pod, and any patch with a token bound to no
  pod; an admin is not limited;
* **the socket-read-only policy**: a pod outside the release namespace that mounts the agent's
  socket folder (``agent.socketDir``, under any spelling, a path inside it, the ``/run``
  alias) writable in any container (init and ephemeral ones too) is refused with the fix
  (``readOnly: true``); read-only mounts, other folders and the agent's own namespace pass;
* **SubjectAccessReviews** for each ServiceAccount the chart creates, for a tenant user and
  for a trainer ServiceAccount bound to ``trainer-annotations`` (``RBAC_MATRIX``,
  ``NAMESPACED_MATRIX``): which verbs on which resources, cluster-wide and
  namespaced install;
* **the operator run with its ServiceAccount's token** (not the admin's): a tenant who may
  create policies but not scale a StatefulSet names that StatefulSet in a policy; the
  operator does not resize it (``ScaleNotAllowed``, Degraded with the ``kubectl annotate``
  command), the tenant cannot set the opt-in, the workload's owner can, and then the
  StatefulSet is resized; the namespaced install's operator serves its namespace with Roles
  only (Ready, a delete whose finalizer is lifted) and never touches another namespace.
"""

from __future__ import annotations

import base64
import json
import re
import ssl
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from e2e_support import get_json, wait_until
from kubernetes.client.exceptions import ApiException
from rlenergy_agent import kube as agent_kube
from rlenergy_agent.kubeapi import ApiException as AgentApiException
from rlenergy_dev import fullstack, standin
from rlenergy_dev.devcluster import K8S_VERSION, DevCluster

from rlenergy import errors
from rlenergy.api import naming
from rlenergy.api import node as api_node
from rlenergy.sdk import annotate
from tests import factories

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "rl-energy"
NODE_NAME_KEY = "authentication.kubernetes.io/node-name"
TENANT = "alice@team.example"
TRAINER_SA = "trainer"
"""The trainers' ServiceAccount in team a, bound to the chart's trainer-annotations role."""
KUBE = K8S_VERSION.lstrip("v")


@dataclass
class Install:
    """One helm release of the chart."""

    release: str
    namespace: str

    @property
    def operator_sa(self) -> str:
        return f"{self.release}-rl-energy"

    @property
    def agent_sa(self) -> str:
        return f"{self.release}-rl-energy-agent"


def _ns(cluster: DevCluster, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    wait_until(
        lambda: cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0,
        timeout=60,
        what=f"serviceaccount/default in {name}",
    )
    return name


def _install(cluster: DevCluster, release: str, *values: str) -> Install:
    ns = _ns(cluster, release)
    cluster.helm(
        "install", release, str(CHART), "-n", ns, "--set", "operator.replicas=0", *values,
        "--wait", "--timeout", "90s",
    )  # fmt: skip
    return Install(release, ns)


@pytest.fixture(scope="module")
def teams(dev_cluster: DevCluster, crds: None) -> dict[str, str]:
    """Two tenant namespaces; ``a`` is served by both installs' cluster-wide one only."""
    return {"a": _ns(dev_cluster, "team-a"), "b": _ns(dev_cluster, "team-b")}


def _wait_enforced(
    cluster: DevCluster, inst: Install, namespace: str, tmp_path: Path, timeout: float = 60
) -> None:
    """Wait until the API server enforces the release's ValidatingAdmissionPolicy.

    ``helm install --wait`` returns once the policy object is stored; each API server loads
    policies from its informer and recompiles them once a second
    (k8s.io/apiserver pkg/admission/plugin/policy/generic/policy_source.go,
    ``policyRefreshIntervalDefault``), so a write right after the install can still pass
    unchecked. The probe is a dry-run create (admission runs, nothing is stored) with the
    agent's token bound to no pod, which the policy refuses once it is loaded.
    """
    agent_api = _api(cluster, _token(cluster, inst, inst.agent_sa), tmp_path)
    writer = agent_kube.ReportWriter(agent_api, namespace, "probe", cluster.nodes[0])
    body = writer.body(_report(cluster.nodes[0]))
    # The agent's CustomObjects makes only the calls the agent makes (no dry run): the probe
    # sends the dry run through the same client, connection and token.
    path = (
        f"/apis/{agent_kube.GROUP}/{agent_kube.VERSION}/namespaces/{namespace}/"
        f"{agent_kube.REPORT_PLURAL}"
    )

    def refused() -> bool:
        try:
            agent_kube.call_json(
                agent_api.api_client, "POST", path, query=[("dryRun", "All")], body=body
            )
        except AgentApiException as exc:
            return exc.status == 403
        return False

    wait_until(refused, timeout=timeout, what=f"{inst.release}'s admission policy in force")


@pytest.fixture(scope="module")
def install(
    dev_cluster: DevCluster, teams: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Install]:
    """The chart with its defaults: cluster-wide, node-scoped report writes (in force)."""
    inst = _install(dev_cluster, "priv")
    _wait_enforced(dev_cluster, inst, teams["a"], tmp_path_factory.mktemp("priv"))
    yield inst
    dev_cluster.helm("uninstall", inst.release, "-n", inst.namespace, "--wait", check=False)


@pytest.fixture(scope="module")
def namespaced(dev_cluster: DevCluster, teams: dict[str, str]) -> Iterator[Install]:
    """The chart limited to team b (``rbac.watchNamespaces``)."""
    inst = _install(dev_cluster, "privns", "--set", f"rbac.watchNamespaces={{{teams['b']}}}")
    yield inst
    dev_cluster.helm("uninstall", inst.release, "-n", inst.namespace, "--wait", check=False)


# ----- tokens --------------------------------------------------------------------------------
def _agent_pod(cluster: DevCluster, inst: Install, node: str) -> str:
    """A pod of the agent's ServiceAccount on ``node`` (KWOK runs it), as the DaemonSet has."""
    name = f"agent-{node}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": inst.namespace},
        "spec": {
            "serviceAccountName": inst.agent_sa,
            "nodeName": node,
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "agent", "image": "registry.invalid/agent:1"}],
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    return name


def _token(cluster: DevCluster, inst: Install, sa: str, pod: str | None = None) -> str:
    """A TokenRequest for ``sa``; bound to ``pod`` (its node goes into the user info)."""
    bound = ["--bound-object-kind=Pod", f"--bound-object-name={pod}"] if pod else []
    res = cluster.kubectl("create", "token", sa, "-n", inst.namespace, "--duration=1h", *bound)
    return res.stdout.strip()


def _review(cluster: DevCluster, token: str) -> dict[str, Any]:
    body = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenReview",
        "spec": {"token": token},
    }
    res = cluster.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(body))
    status: dict[str, Any] = json.loads(res.stdout)["status"]
    return status


def _token_kubeconfig(cluster: DevCluster, token: str, path: Path) -> Path:
    """The admin kubeconfig's server and CA with ``token`` as the only credential."""
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    ctx = admin["contexts"][0]["context"]
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": admin["clusters"],
        "users": [{"name": "token", "user": {"token": token}}],
        "contexts": [{"name": "token", "context": {"cluster": ctx["cluster"], "user": "token"}}],
        "current-context": "token",
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def _api(cluster: DevCluster, token: str, tmp_path: Path) -> Any:
    cfg = _token_kubeconfig(cluster, token, tmp_path / f"kc-{uuid.uuid4().hex[:6]}")
    return agent_kube.load_api(str(cfg))


def _report(node: str, policy: str = "p") -> api_node.NodeReport:
    return factories.node_report(
        node, policy=policy, gpus=[api_node.GpuStatus(uuid=f"GPU-{node}-00")]
    )


def _refused(exc: pytest.ExceptionInfo[AgentApiException], text: str) -> None:
    assert exc.value.status == 403, exc.value
    assert text in str(exc.value.body), exc.value.body


# ----- node-scoped report writes -------------------------------------------------------------
def test_a_pod_bound_agent_token_names_its_node(dev_cluster: DevCluster, install: Install):
    node = dev_cluster.nodes[0]
    token = _token(dev_cluster, install, install.agent_sa, _agent_pod(dev_cluster, install, node))
    st = _review(dev_cluster, token)
    assert st["authenticated"], st
    assert st["user"]["username"] == f"system:serviceaccount:{install.namespace}:{install.agent_sa}"
    assert st["user"]["extra"][NODE_NAME_KEY] == [node], st["user"]


def test_the_agent_writes_its_own_node_report_and_no_other(
    dev_cluster: DevCluster, install: Install, teams: dict[str, str], tmp_path: Path
):
    node_a, node_b = dev_cluster.nodes[0], dev_cluster.nodes[1]
    ns = teams["a"]
    token = _token(dev_cluster, install, install.agent_sa, _agent_pod(dev_cluster, install, node_a))
    api = _api(dev_cluster, token, tmp_path)
    own = agent_kube.ReportWriter(api, ns, "p", node_a, max_retries=1)
    own.write(_report(node_a))  # create
    own.write(_report(node_a))  # patch
    assert get_json(dev_cluster, "rlenr", own.name, "-n", ns)["spec"]["nodeName"] == node_a
    # node B's report, written by node A's agent: refused at create
    other = agent_kube.ReportWriter(api, ns, "p", node_b, max_retries=1)
    with pytest.raises(AgentApiException) as exc:
        other.write(_report(node_b))
    _refused(exc, f"the node agent on node {node_a} may write only its own node report")
    # a report named for node A that says node B: refused (the name proves nothing)
    with pytest.raises(AgentApiException) as exc:
        api.patch_namespaced_custom_object(
            agent_kube.GROUP, agent_kube.VERSION, ns, agent_kube.REPORT_PLURAL, own.name,
            {"spec": {"nodeName": node_b}},
        )  # fmt: skip
    _refused(exc, "may write only its own node report")
    # node B's report as its own agent wrote it (admin here): A may read it, not patch it
    dev_cluster.kubectl(
        "apply", "-n", ns, "-f", "-",
        input=json.dumps(agent_kube.ReportWriter(None, ns, "p", node_b).body(_report(node_b))),
    )  # fmt: skip
    got = api.get_namespaced_custom_object(
        agent_kube.GROUP, agent_kube.VERSION, ns, agent_kube.REPORT_PLURAL, other.name
    )
    assert got["spec"]["nodeName"] == node_b
    with pytest.raises(AgentApiException) as exc:
        api.patch_namespaced_custom_object(
            agent_kube.GROUP, agent_kube.VERSION, ns, agent_kube.REPORT_PLURAL, other.name,
            {"spec": {"nodeName": node_a}},
        )  # fmt: skip
    _refused(exc, f"may not change the report of node {node_b}")
    with pytest.raises(AgentApiException) as exc:
        body = own.body(_report(node_a))
        body["metadata"]["name"] = "p-spoof"
        body["metadata"]["labels"]["rlenergy.io/node"] = node_b
        api.create_namespaced_custom_object(
            agent_kube.GROUP, agent_kube.VERSION, ns, agent_kube.REPORT_PLURAL, body
        )
    _refused(exc, f"may not label a report rlenergy.io/node={node_b}")
    assert get_json(dev_cluster, "rlenr", other.name, "-n", ns)["spec"]["nodeName"] == node_b


def test_a_token_bound_to_no_pod_writes_no_report(
    dev_cluster: DevCluster, install: Install, teams: dict[str, str], tmp_path: Path
):
    token = _token(dev_cluster, install, install.agent_sa)
    assert NODE_NAME_KEY not in (_review(dev_cluster, token)["user"].get("extra") or {})
    api = _api(dev_cluster, token, tmp_path)
    writer = agent_kube.ReportWriter(api, teams["a"], "q", dev_cluster.nodes[0], max_retries=1)
    with pytest.raises(AgentApiException) as exc:
        writer.write(_report(dev_cluster.nodes[0]))
    _refused(exc, "the node agent's token names no node")


def _create(api: Any, ns: str, body: dict[str, Any]) -> None:
    api.create_namespaced_custom_object(
        agent_kube.GROUP, agent_kube.VERSION, ns, agent_kube.REPORT_PLURAL, body
    )


def test_an_agent_creates_reports_only_under_its_own_report_names(
    dev_cluster: DevCluster, install: Install, teams: dict[str, str], tmp_path: Path
):
    node_a, node_b = dev_cluster.nodes[0], dev_cluster.nodes[1]
    ns = teams["a"]
    token = _token(dev_cluster, install, install.agent_sa, _agent_pod(dev_cluster, install, node_a))
    api = _api(dev_cluster, token, tmp_path)
    own = agent_kube.ReportWriter(api, ns, "sq", node_a, max_retries=1)
    # node B's report name, taken first by node A's agent with a spec and labels of node A
    for name in (
        naming.report_name("sq", node_b),  # the squat: B's agent could never write its report
        naming.legacy_report_name("sq", node_a),  # the unhashed name of before
        f"sq-{node_a}-free",
    ):
        body = own.body(_report(node_a, "sq"))
        body["metadata"]["name"] = name
        with pytest.raises(AgentApiException) as exc:
            _create(api, ns, body)
        # the API server's JSON escapes the "<hash>" that follows
        _refused(exc, f"may create only its own report of policy sq, named sq-{node_a}-")
    # labelled for another policy than its spec names
    body = own.body(_report(node_a, "sq"))
    body["metadata"]["labels"]["rlenergy.io/policy"] = "other"
    with pytest.raises(AgentApiException) as exc:
        _create(api, ns, body)
    _refused(exc, "the report of policy sq may not be labelled rlenergy.io/policy=other")
    # A's own name is taken; B's agent writes B's report under its name, nobody squats it
    own.write(_report(node_a, "sq"))
    token_b = _token(
        dev_cluster, install, install.agent_sa, _agent_pod(dev_cluster, install, node_b)
    )
    theirs = agent_kube.ReportWriter(_api(dev_cluster, token_b, tmp_path), ns, "sq", node_b)
    theirs.write(_report(node_b, "sq"))
    stored = get_json(dev_cluster, "rlenr", naming.report_name("sq", node_b), "-n", ns)
    assert stored["spec"]["nodeName"] == node_b
    assert get_json(dev_cluster, "rlenr", own.name, "-n", ns)["spec"]["nodeName"] == node_a


# ----- trainer annotations: its own pod, rlenergy.io/* only ---------------------------------
def _ca_file(cluster: DevCluster, path: Path) -> str:
    kc = yaml.safe_load(cluster.kubeconfig.read_text())
    path.write_bytes(base64.b64decode(kc["clusters"][0]["cluster"]["certificate-authority-data"]))
    return str(path)


def _tenant_pod(cluster: DevCluster, ns: str, name: str, sa: str) -> str:
    """A pod of ``sa`` on KWOK node 0 (KWOK runs it); its UID."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": "trainer"}},
        "spec": {
            "serviceAccountName": sa,
            "nodeName": cluster.nodes[0],
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "t", "image": "registry.invalid/trainer:1"}],
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    return str(get_json(cluster, "pod", name, "-n", ns)["metadata"]["uid"])


@pytest.fixture(scope="module")
def trainer(dev_cluster: DevCluster, install: Install, teams: dict[str, str]) -> str:
    """Team a's trainer ServiceAccount, bound to the chart's trainer-annotations ClusterRole."""
    ns = teams["a"]
    dev_cluster.kubectl("create", "serviceaccount", TRAINER_SA, "-n", ns)
    dev_cluster.kubectl(
        "create", "rolebinding", "trainers", "-n", ns,
        f"--clusterrole={install.release}-rl-energy-trainer-annotations",
        f"--serviceaccount={ns}:{TRAINER_SA}",
    )  # fmt: skip
    return TRAINER_SA


def _pod_annotator(
    cluster: DevCluster, ns: str, pod: str, token: str, tmp_path: Path
) -> annotate.PodAnnotator:
    path = tmp_path / f"token-{uuid.uuid4().hex[:6]}"
    path.write_text(token)
    return annotate.PodAnnotator(
        cluster.server, ns, pod, token_file=str(path),
        ca_file=_ca_file(cluster, tmp_path / "ca.crt"), strict=True,
    )  # fmt: skip


def _patch_pod(
    cluster: DevCluster, token: str, ns: str, pod: str, meta: dict[str, Any], ca: str
) -> tuple[int, str]:
    """A JSON merge patch of ``pod``'s metadata with ``token``: the status and the message.

    One PATCH and nothing else, as the SDK sends (``kubectl annotate`` and ``kubectl patch``
    GET the pod first, which the trainer-annotations role does not allow).
    """
    req = urllib.request.Request(  # noqa: S310 - the dev cluster's https URL
        f"{cluster.server}/api/v1/namespaces/{ns}/pods/{pod}",
        data=json.dumps({"metadata": meta}).encode(),
        method="PATCH",
        headers={"Authorization": f"Bearer {token}", "Content-Type": annotate.MERGE_PATCH},
    )
    try:
        with urllib.request.urlopen(req, context=ssl.create_default_context(cafile=ca)) as resp:
            return resp.status, ""
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, str(json.loads(exc.read()).get("message", ""))


@pytest.mark.timeout(180)
def test_a_trainer_annotates_only_its_own_pods_rlenergy_keys(
    dev_cluster: DevCluster, install: Install, teams: dict[str, str], trainer: str,
    tmp_path: Path,
):  # fmt: skip
    ns = teams["a"]
    _tenant_pod(dev_cluster, ns, "trainer-0", trainer)
    _tenant_pod(dev_cluster, ns, "other-job", "default")
    token = _token(dev_cluster, Install(install.release, ns), trainer, "trainer-0")
    ca = _ca_file(dev_cluster, tmp_path / "ca.crt")
    own = _pod_annotator(dev_cluster, ns, "trainer-0", token, tmp_path)
    other = _pod_annotator(dev_cluster, ns, "other-job", token, tmp_path)
    try:
        _trainer_checks(dev_cluster, install, ns, trainer, token, ca, own, other)
    finally:
        own.close()
        other.close()


def _trainer_checks(
    dev_cluster: DevCluster, install: Install, ns: str, trainer: str, token: str, ca: str,
    own: annotate.PodAnnotator, other: annotate.PodAnnotator,
) -> None:  # fmt: skip
    """The trainer test's checks; the caller closes the annotators' connections."""

    def refused_other() -> bool:
        try:
            other.phase("generation", step=1)
        except errors.PermanentError as exc:
            return "HTTP 403" in str(exc)
        return False

    # the policy compiles within a second of the install (see _wait_enforced)
    wait_until(refused_other, timeout=60, what="the trainer-annotations policy in force")
    status, msg = _patch_pod(
        dev_cluster, token, ns, "other-job", {"annotations": {"rlenergy.io/phase": "idle"}}, ca
    )
    assert status == 403 and msg.endswith("lets pod trainer-0 patch only itself, not pod other-job")
    assert own.phase("generation", step=1)
    assert own.end_step(1, samples=2, response_tokens=10, prompt_tokens=5, valid_tokens=10)
    notes = get_json(dev_cluster, "pod", "trainer-0", "-n", ns)["metadata"]["annotations"]
    assert notes["rlenergy.io/phase"] == "generation" and notes["rlenergy.io/step"] == "1"
    # its own pod's other annotations, labels and finalizers: refused
    for meta, text in (
        ({"annotations": {"team.example/owner": "b"}}, "changes only rlenergy.io/* annotations"),
        ({"annotations": {"rlenergy.io/phase": None}}, ""),  # its own keys: removed
        ({"labels": {"app": "someone-else"}}, "not its spec, labels, owners or finalizers"),
        ({"labels": {"rlenergy.io/job": "x"}}, "not its spec, labels, owners or finalizers"),
        ({"finalizers": ["team.example/hold"]}, "not its spec, labels, owners or finalizers"),
    ):
        status, msg = _patch_pod(dev_cluster, token, ns, "trainer-0", meta, ca)
        if text:
            assert status == 403 and text in msg, (meta, status, msg)
        else:
            assert status == 200, (meta, status, msg)
    # a token of the same ServiceAccount bound to no pod: refused even on its own pod
    unbound = _token(dev_cluster, Install(install.release, ns), trainer)
    status, msg = _patch_pod(
        dev_cluster, unbound, ns, "trainer-0", {"annotations": {"rlenergy.io/step": "2"}}, ca
    )
    assert status == 403 and "only with a token bound to its own pod" in msg, msg
    # an admin (no holder of the role) is not limited
    dev_cluster.kubectl("annotate", "pod", "other-job", "-n", ns, "team.example/owner=b")
    dev_cluster.kubectl("label", "pod", "trainer-0", "-n", ns, "team.example/reviewed=yes")


# ----- the agent's socket folder: read-only outside the agent's namespace -------------------
SOCKET_DIR = "/var/run/rlenergy"
"""The chart's default ``agent.socketDir``."""


def _socket_pod(name: str, path: str, *, read_only: bool, init: bool = False) -> dict[str, Any]:
    """A trainer pod mounting the hostPath ``path`` at the SDK's socket folder; with ``init``
    an init container mounts it as well, writable, and the main container read-only."""
    mount: dict[str, Any] = {"name": "rlenergy", "mountPath": SOCKET_DIR}
    if read_only or init:
        mount["readOnly"] = True
    spec: dict[str, Any] = {
        "nodeName": "absent-node",  # never runs: every check here is the admission answer
        "containers": [
            {"name": "trainer", "image": "registry.invalid/t:1", "volumeMounts": [mount]}
        ],
        "volumes": [{"name": "rlenergy", "hostPath": {"path": path, "type": "Directory"}}],
    }
    if init:
        spec["initContainers"] = [
            {
                "name": "setup",
                "image": "registry.invalid/t:1",
                "volumeMounts": [{"name": "rlenergy", "mountPath": "/mnt"}],
            }
        ]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def _admission(cluster: DevCluster, ns: str, pod: dict[str, Any]) -> str:
    """A server-side dry-run create of ``pod`` in ``ns``: '' when admitted, else the error."""
    res = cluster.kubectl(
        "create", "--dry-run=server", "-n", ns, "-f", "-", input=json.dumps(pod), check=False
    )
    return "" if res.returncode == 0 else res.stderr


@pytest.mark.timeout(180)
def test_trainer_pods_mount_the_agents_socket_folder_read_only(
    dev_cluster: DevCluster, install: Install, teams: dict[str, str]
):
    ns = teams["a"]
    fix = "set readOnly: true on that volumeMount"
    wait_until(
        lambda: (
            fix in _admission(dev_cluster, ns, _socket_pod("probe", SOCKET_DIR, read_only=False))
        ),
        timeout=60,
        what="the socket-read-only policy in force",
    )
    why = _admission(dev_cluster, ns, _socket_pod("rw", SOCKET_DIR, read_only=False))
    assert (
        "container(s) trainer of pod rw mount the rl-energy agent's socket folder "
        f"{SOCKET_DIR} (hostPath volume rlenergy) writable: {fix}"
    ) in why, why
    # the same folder under other spellings, a path inside it, the /run alias
    for path in ("/var/run//rlenergy/", "/var/run/./rlenergy", "/run/rlenergy",
                 f"{SOCKET_DIR}/agent.sock"):  # fmt: skip
        why = _admission(dev_cluster, ns, _socket_pod("rw", path, read_only=False))
        assert fix in why, (path, why)
    # a writable init container, the main one read-only: refused, naming the init container
    why = _admission(dev_cluster, ns, _socket_pod("init", SOCKET_DIR, read_only=True, init=True))
    assert "container(s) setup of pod init mount" in why, why
    # read-only: admitted; other folders (a sibling sharing the prefix, a parent): admitted
    assert _admission(dev_cluster, ns, _socket_pod("ro", SOCKET_DIR, read_only=True)) == ""
    for path in ("/var/run/rlenergy-engines", "/var/run/other", "/var/run"):
        assert _admission(dev_cluster, ns, _socket_pod("rw", path, read_only=False)) == "", path
    # the agent's own namespace (the DaemonSet mounts the folder writable to bind the socket)
    own = _socket_pod("agent", SOCKET_DIR, read_only=False)
    assert _admission(dev_cluster, install.namespace, own) == ""
    # an ephemeral container added to a running trainer pod: the same rule
    pod = _socket_pod("running", SOCKET_DIR, read_only=True)
    dev_cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(pod))
    core = kubernetes.client.CoreV1Api(
        kubernetes.config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    )
    debug = {"name": "debug", "image": "registry.invalid/d:1", "targetContainerName": "trainer"}
    try:
        for read_only, refused in ((False, True), (True, False)):
            mount = {"name": "rlenergy", "mountPath": "/mnt", "readOnly": read_only}
            body = {"spec": {"ephemeralContainers": [{**debug, "volumeMounts": [mount]}]}}
            try:
                core.patch_namespaced_pod_ephemeralcontainers("running", ns, body, dry_run="All")
            except ApiException as exc:
                assert refused and exc.status == 403, exc
                assert "container(s) debug of pod running mount" in str(exc.body), exc.body
            else:
                assert not refused
    finally:
        core.api_client.close()
        dev_cluster.kubectl("delete", "pod", "running", "-n", ns, "--wait=false", check=False)


# ----- the RBAC matrix -----------------------------------------------------------------------
# (who, verb, group/resource[/subresource], namespace: "a"/"b" team, "rel" release, "" cluster)
RBAC_MATRIX: list[tuple[str, str, str, str, bool]] = [
    ("operator", "watch", "rlenergy.io/rlenergypolicies", "a", True),
    ("operator", "patch", "rlenergy.io/rlenergypolicies/status", "a", True),
    ("operator", "update", "rlenergy.io/rlenergypolicies", "a", False),
    ("operator", "watch", "rlenergy.io/rlenergynodereports", "a", True),
    ("operator", "create", "rlenergy.io/rlenergynodereports", "a", False),
    ("operator", "patch", "rlenergy.io/rlenergynodereports", "a", False),
    ("operator", "get", "apps/statefulsets", "a", True),  # the opt-in annotation
    ("operator", "patch", "apps/statefulsets", "a", False),
    ("operator", "patch", "apps/statefulsets/scale", "a", True),
    ("operator", "get", "leaderworkerset.x-k8s.io/leaderworkersets", "a", True),
    ("operator", "patch", "leaderworkerset.x-k8s.io/leaderworkersets/scale", "a", True),
    ("operator", "patch", "ray.io/rayclusters", "a", True),
    ("operator", "delete", "ray.io/rayclusters", "a", False),
    ("operator", "create", "apps/daemonsets", "rel", True),
    ("operator", "create", "apps/daemonsets", "a", False),
    ("operator", "list", "/nodes", "", True),
    ("operator", "patch", "/nodes", "", False),
    ("operator", "get", "/secrets", "rel", False),
    ("operator", "delete", "/pods", "a", False),
    ("operator", "list", "/pods", "a", True),  # the nodes hosting a policy's pods
    ("operator", "watch", "/pods", "a", False),
    ("operator", "patch", "/pods", "a", False),
    ("operator", "create", "/serviceaccounts/token", "rel", False),
    ("operator", "create", "authentication.k8s.io/tokenreviews", "", False),
    ("operator", "create", "rbac.authorization.k8s.io/clusterrolebindings", "", False),
    ("operator", "delete", "rlenergy.io/rlenergypolicies", "a", False),
    ("operator", "create", "/pods", "a", False),
    ("operator", "get", "/secrets", "a", False),
    ("operator", "get", "ray.io/rayclusters", "a", True),
    ("operator", "update", "ray.io/rayclusters", "a", False),
    ("operator", "create", "ray.io/rayclusters", "a", False),
    ("operator", "list", "ray.io/rayclusters", "a", False),
    ("operator", "watch", "ray.io/rayclusters", "a", False),
    ("agent", "create", "rlenergy.io/rlenergynodereports", "a", True),  # own node: admission
    ("agent", "patch", "rlenergy.io/rlenergynodereports", "a", True),
    ("agent", "get", "rlenergy.io/rlenergynodereports", "a", True),
    ("agent", "delete", "rlenergy.io/rlenergynodereports", "a", False),
    ("agent", "list", "rlenergy.io/rlenergypolicies", "a", True),
    ("agent", "patch", "rlenergy.io/rlenergypolicies", "a", False),
    ("agent", "patch", "rlenergy.io/rlenergypolicies/status", "a", False),
    ("agent", "list", "/pods", "", True),
    ("agent", "watch", "/pods", "", True),  # phaseSource annotation: its node's pods
    ("agent", "patch", "/pods", "a", False),
    ("agent", "get", "/secrets", "a", False),
    ("agent", "patch", "/nodes", "", False),
    ("agent", "patch", "apps/statefulsets/scale", "a", False),
    ("agent", "create", "apps/daemonsets", "rel", False),
    ("agent", "create", "authentication.k8s.io/tokenreviews", "", True),  # trainers' tokens
    ("agent", "create", "authorization.k8s.io/subjectaccessreviews", "", False),
    ("agent", "list", "resource.k8s.io/resourceslices", "", True),  # DRA devices' GPU UUIDs
    ("agent", "watch", "resource.k8s.io/resourceslices", "", False),
    ("agent", "create", "resource.k8s.io/resourceslices", "", False),
    ("agent", "get", "resource.k8s.io/resourceclaims", "a", False),
    ("operator", "list", "resource.k8s.io/resourceslices", "", False),
    ("agent", "create", "/pods", "a", False),
    ("agent", "delete", "/pods", "a", False),
    ("agent", "list", "/secrets", "a", False),
    ("agent", "create", "rlenergy.io/rlenergypolicies", "a", False),
    ("agent", "delete", "rlenergy.io/rlenergypolicies", "a", False),
    ("tenant", "create", "rlenergy.io/rlenergypolicies", "a", True),
    ("tenant", "patch", "rlenergy.io/rlenergypolicies", "a", True),
    ("tenant", "get", "apps/statefulsets", "a", True),
    ("tenant", "patch", "apps/statefulsets/scale", "a", False),
    ("tenant", "update", "apps/statefulsets/scale", "a", False),
    ("tenant", "patch", "apps/statefulsets", "a", False),
    ("tenant", "create", "rlenergy.io/rlenergypolicies", "b", False),
    ("tenant", "patch", "rlenergy.io/rlenergynodereports", "a", False),
    ("tenant", "patch", "/pods", "a", False),
    # trainer-annotations: pods patch (narrowed to its own pod by admission) and the marker
    ("trainer", "patch", "/pods", "a", True),
    ("trainer", "patch", "rlenergy.io/phaseannotations", "a", True),
    ("trainer", "unrestricted", "rlenergy.io/phaseannotations", "a", False),
    ("trainer", "update", "/pods", "a", False),
    ("trainer", "delete", "/pods", "a", False),
    ("trainer", "patch", "/pods/status", "a", False),
    ("trainer", "patch", "/pods", "b", False),
    ("trainer", "get", "/secrets", "a", False),
    ("trainer", "patch", "rlenergy.io/rlenergynodereports", "a", False),
    ("trainer", "patch", "rlenergy.io/rlenergypolicies", "a", False),
]
NAMESPACED_MATRIX: list[tuple[str, str, str, str, bool]] = [
    ("operator", "watch", "rlenergy.io/rlenergypolicies", "b", True),
    ("operator", "patch", "rlenergy.io/rlenergypolicies/status", "b", True),
    ("operator", "watch", "rlenergy.io/rlenergynodereports", "b", True),
    ("operator", "patch", "apps/statefulsets/scale", "b", True),
    ("operator", "patch", "kopf.dev/kopfpeerings", "b", True),
    ("operator", "create", "/events", "b", True),
    ("operator", "create", "apps/daemonsets", "rel", True),
    ("operator", "list", "/nodes", "", True),  # cluster-wide: nodes are cluster-scoped
    ("operator", "list", "/pods", "b", True),  # its namespace's pods only
    ("operator", "list", "/pods", "a", False),
    ("operator", "list", "rlenergy.io/rlenergypolicies", "a", False),
    ("operator", "watch", "rlenergy.io/rlenergypolicies", "", False),
    ("operator", "get", "rlenergy.io/rlenergynodereports", "a", False),
    ("operator", "get", "apps/statefulsets", "a", False),
    ("operator", "patch", "apps/statefulsets/scale", "a", False),
    ("operator", "patch", "ray.io/rayclusters", "a", False),
    ("operator", "create", "/events", "a", False),
    ("operator", "list", "apiextensions.k8s.io/customresourcedefinitions", "", False),
    ("operator", "list", "/namespaces", "", False),
    ("operator", "patch", "kopf.dev/clusterkopfpeerings", "", False),
    ("agent", "create", "rlenergy.io/rlenergynodereports", "b", True),
    ("agent", "get", "rlenergy.io/rlenergypolicies", "b", True),
    ("agent", "list", "/pods", "", True),  # cluster-wide: its node's pods, any namespace
    ("agent", "watch", "/pods", "", True),  # phaseSource annotation, any namespace
    ("agent", "list", "resource.k8s.io/resourceslices", "", True),  # cluster-scoped
    ("agent", "create", "rlenergy.io/rlenergynodereports", "a", False),
    ("agent", "list", "rlenergy.io/rlenergypolicies", "a", False),
    ("agent", "list", "rlenergy.io/rlenergypolicies", "", False),
]


def _subject(inst: Install, teams: dict[str, str], who: str) -> tuple[str, list[str]]:
    if who == "tenant":
        return TENANT, ["system:authenticated"]
    ns, sa = inst.namespace, inst.operator_sa if who == "operator" else inst.agent_sa
    if who == "trainer":
        ns, sa = teams["a"], TRAINER_SA
    return f"system:serviceaccount:{ns}:{sa}", [
        "system:serviceaccounts",
        f"system:serviceaccounts:{ns}",
        "system:authenticated",
    ]


def _allowed(
    cluster: DevCluster, inst: Install, teams: dict[str, str], who: str, verb: str, what: str,
    where: str,
) -> bool:  # fmt: skip
    """The API server's SubjectAccessReview answer."""
    group, _, rest = what.partition("/")
    resource, _, sub = rest.partition("/")
    user, groups = _subject(inst, teams, who)
    ns = {"rel": inst.namespace, "": ""}.get(where, teams.get(where, where))
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": user,
            "groups": groups,
            "resourceAttributes": {
                "group": group,
                "resource": resource,
                "subresource": sub,
                "verb": verb,
                "namespace": ns,
            },
        },
    }
    res = cluster.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(review))
    return bool(json.loads(res.stdout)["status"].get("allowed"))


@pytest.fixture(scope="module")
def tenant(dev_cluster: DevCluster, teams: dict[str, str]) -> str:
    """A user who may write policies and read workloads in team a, and scale nothing."""
    ns = teams["a"]
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "policy-author", "namespace": ns},
        "rules": [
            {
                "apiGroups": ["rlenergy.io"],
                "resources": ["rlenergypolicies"],
                "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
            },
            {"apiGroups": ["apps"], "resources": ["statefulsets"], "verbs": ["get", "list"]},
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "policy-author", "namespace": ns},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "policy-author",
        },
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": TENANT}],
    }
    for doc in (role, binding):
        dev_cluster.kubectl("apply", "-f", "-", input=json.dumps(doc))
    return TENANT


@pytest.mark.parametrize("who,verb,what,where,allowed", RBAC_MATRIX, ids=str)
def test_rbac_matrix(
    dev_cluster: DevCluster, install: Install, teams: dict[str, str], tenant: str, trainer: str,
    who: str, verb: str, what: str, where: str, allowed: bool,
):  # fmt: skip
    got = _allowed(dev_cluster, install, teams, who, verb, what, where)
    assert got is allowed, f"{who} {verb} {what} in {where or 'the cluster'}: {got}"


@pytest.mark.parametrize("who,verb,what,where,allowed", NAMESPACED_MATRIX, ids=str)
def test_rbac_matrix_of_the_namespaced_install(
    dev_cluster: DevCluster, namespaced: Install, teams: dict[str, str],
    who: str, verb: str, what: str, where: str, allowed: bool,
):  # fmt: skip
    got = _allowed(dev_cluster, namespaced, teams, who, verb, what, where)
    assert got is allowed, f"{who} {verb} {what} in {where or 'the cluster'}: {got}"


# ----- no confused deputy ---------------------------------------------------------------------
def _pool(name: str, replicas: int, node: str) -> dict[str, Any]:
    """A StatefulSet whose pods run on ``node`` (KWOK), the node whose report publishes."""
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "serviceName": name,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeName": node,
                    "containers": [{"name": "w", "image": "registry.invalid/w:1"}],
                },
            },
        },
    }


def _scale_policy(name: str, pool: str) -> dict[str, Any]:
    gb = 10**9
    return {
        "apiVersion": "rlenergy.io/v1alpha1",
        "kind": "RLEnergyPolicy",
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": {"app": pool}},
            "controller": {"warmupSteps": 50},
            "rollout": {
                "workerSetRef": {"kind": "StatefulSet", "name": pool},
                "experts": {"count": 16, "bytesPerExpert": gb},
                "workerMemoryBytes": 10 * gb,  # 8 experts per worker: floor 2
                "denseBytes": 2 * gb,
                "minActiveWorkers": 1,
                "releaseAction": "scale",
            },
        },
    }


def _publish(cluster: DevCluster, ns: str, policy: str, step: int, nxt: int) -> None:
    """The dispatcher's publication in node 0's report (as its agent relays it); the policy's
    pods run there (the operator reads only the reports of nodes that host them)."""
    node = cluster.nodes[0]
    report = {
        "apiVersion": "rlenergy.io/v1alpha1",
        "kind": "RLEnergyNodeReport",
        "metadata": {"name": f"{policy}-{node}"},
        "spec": {
            "policyName": policy,
            "nodeName": node,
            "gpus": [{"uuid": "GPU-pool-0", "condition": "ok"}],
            "rollout": {"step": step, "activeWorkers": 4, "nextStepWorkers": nxt},
        },
    }
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(report))


def _condition(cluster: DevCluster, ns: str, policy: str, kind: str) -> dict[str, Any] | None:
    st = get_json(cluster, "rlep", policy, "-n", ns).get("status") or {}
    return next((c for c in st.get("conditions") or [] if c.get("type") == kind), None)


def _operator(
    cluster: DevCluster, inst: Install, tmp_path: Path, policy: str, **env: str
) -> fullstack.FullStack:
    """The operator as a local process with its ServiceAccount's token (the chart's RBAC)."""
    token = _token(cluster, inst, inst.operator_sa)
    kc = _token_kubeconfig(cluster, token, tmp_path / "operator.kubeconfig")
    lib_dir = standin.build_library(ROOT / "build" / "nvml-standin")
    stack = fullstack.FullStack(
        kc, inst.namespace, policy, [], tmp_path / "stack", lib_dir,
        operator_env={
            "RLENERGY_OPERATOR_AGENT_SERVICE_ACCOUNT": inst.agent_sa,
            **{f"RLENERGY_OPERATOR_{k.upper()}": v for k, v in env.items()},
        },
    )  # fmt: skip
    stack.start_operator()
    return stack


def _forbidden(stack: fullstack.FullStack, ns: str) -> list[str]:
    """The operator's log lines that report a refused request about namespace ``ns``."""
    return _refusals(stack.operator_log.read_text(), ns)


LOG_STAMP = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\]")
"""kopf's log line stamp, ``[2026-12-04 04:54:34,403]``: its milliseconds can read 403."""


def _refusals(log: str, ns: str) -> list[str]:
    """Lines of ``log`` about ``ns`` that report a 403 / Forbidden, their time stamps left out
    (a line stamped ``...,403]`` failed this test once, 2026-12-04)."""
    out = []
    for line in log.splitlines():
        body = LOG_STAMP.sub("", line)
        if ns in body and ("403" in body or "forbidden" in body.lower()):
            out.append(line)
    return out


def test_refusals_are_read_from_the_message_not_the_time_stamp() -> None:
    stamped = (
        "[2026-12-04 04:54:34,403] kopf.objects [INFO] [team-b/ns-policy] Timer 'policy_loop' "
        "succeeded."
    )
    refused = (
        "[2026-12-04 04:54:35,100] kopf.objects [ERROR] [team-b/ns-policy] (403) Reason: Forbidden"
    )
    assert _refusals(stamped, "team-b") == []
    assert _refusals(f"{stamped}\n{refused}", "team-b") == [refused]
    assert _refusals(refused.replace("(403) Reason: Forbidden", "is forbidden"), "team-b")
    assert _refusals(refused, "team-c") == []


@pytest.mark.timeout(240)
def test_a_tenant_cannot_get_a_workload_scaled_until_it_opts_in(
    dev_cluster: DevCluster, install: Install, teams: dict[str, str], tenant: str, tmp_path: Path
):
    ns, pool, name = teams["a"], "rollout-pool", "tenant-rollout"
    pods = _pool(pool, 4, dev_cluster.nodes[0])
    dev_cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(pods))
    # the tenant may create the policy, not scale the StatefulSet, nor opt it in
    dev_cluster.kubectl(
        "apply", "-n", ns, f"--as={tenant}", "-f", "-", input=json.dumps(_scale_policy(name, pool))
    )
    denied = dev_cluster.kubectl(
        "scale", "statefulset", pool, "-n", ns, "--replicas=2", f"--as={tenant}", check=False
    )
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr
    denied = dev_cluster.kubectl(
        "annotate", "statefulset", pool, "-n", ns, f"rlenergy.io/allow-scale-by={name}",
        f"--as={tenant}", check=False,
    )  # fmt: skip
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr
    stack = _operator(dev_cluster, install, tmp_path, name)
    try:
        _publish(dev_cluster, ns, name, 0, 2)
        deg = wait_until(
            lambda: (
                (c := _condition(dev_cluster, ns, name, "Degraded"))
                and c.get("reason") == "ScaleNotAllowed"
                and c
            ),
            timeout=90,
            what="Degraded ScaleNotAllowed",
        )
        assert deg["status"] == "True"
        assert (
            f"kubectl annotate statefulset {pool} -n {ns} rlenergy.io/allow-scale-by={name}"
            in deg["message"]
        ), deg
        time.sleep(3)  # several job-loop passes (0.5 s each): still untouched
        assert get_json(dev_cluster, "statefulset", pool, "-n", ns)["spec"]["replicas"] == 4
        scale = get_json(dev_cluster, "rlep", name, "-n", ns)["status"]["rollout"]["scale"]
        assert scale["reason"] == "ScaleNotAllowed" and scale["forStep"] == 1, scale
        # the workload's owner (admin here) opts in: the same publication is applied
        dev_cluster.kubectl(
            "annotate", "statefulset", pool, "-n", ns, f"rlenergy.io/allow-scale-by={name}"
        )
        wait_until(
            lambda: get_json(dev_cluster, "statefulset", pool, "-n", ns)["spec"]["replicas"] == 2,
            timeout=60,
            what="the opted-in StatefulSet resized to 2",
        )
        # the refusal is gone (Degraded may stay for another reason: no agent runs here)
        wait_until(
            lambda: (
                (c := _condition(dev_cluster, ns, name, "Degraded"))
                and c.get("reason") != "ScaleNotAllowed"
            ),
            timeout=60,
            what="Degraded no longer ScaleNotAllowed",
        )
        scale = get_json(dev_cluster, "rlep", name, "-n", ns)["status"]["rollout"]["scale"]
        assert (scale["reason"], scale["target"]) == ("ShrinkBetweenSteps", 2), scale
        assert not _forbidden(stack, ns), stack.operator_log.read_text()[-3000:]
    finally:
        stack.close()
        dev_cluster.kubectl("delete", "rlep", name, "-n", ns, "--wait=false", check=False)


@pytest.mark.timeout(240)
def test_the_namespaced_operator_serves_only_its_namespaces(
    dev_cluster: DevCluster, namespaced: Install, teams: dict[str, str], tmp_path: Path
):
    mine, other = teams["b"], teams["a"]
    policy = _scale_policy("ns-policy", "none")
    del policy["spec"]["rollout"]
    for ns in (mine, other):
        dev_cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(policy))
    stack = _operator(dev_cluster, namespaced, tmp_path, "ns-policy", watch_namespaces=mine)
    try:
        wait_until(
            lambda: (
                (c := _condition(dev_cluster, mine, "ns-policy", "Ready"))
                and c.get("status") == "True"
            ),
            timeout=90,
            what="the served policy Ready",
        )
        assert get_json(dev_cluster, "daemonset", "rlenergy-node-agent", "-n", namespaced.namespace)
        time.sleep(3)
        assert not get_json(dev_cluster, "rlep", "ns-policy", "-n", other).get("status")
        dev_cluster.kubectl("delete", "rlep", "ns-policy", "-n", mine, "--wait=false")
        wait_until(
            lambda: (
                dev_cluster.kubectl("get", "rlep", "ns-policy", "-n", mine, check=False).returncode
                != 0
            ),
            timeout=60,
            what="the finalizer lifted (policies listed per served namespace)",
        )
        assert not _forbidden(stack, mine), stack.operator_log.read_text()[-3000:]
    finally:
        stack.close()
        dev_cluster.kubectl("delete", "rlep", "ns-policy", "-n", other, "--wait=false", check=False)


def test_the_chart_ships_the_policy_only_when_asked(dev_cluster: DevCluster):
    def kinds(*args: str) -> set[tuple[str, str]]:
        res = dev_cluster.helm(
            "template", "rl", str(CHART), "-n", "rl-energy-system", "--kube-version", KUBE, *args
        )
        return {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(res.stdout) if d}

    reports = {
        ("ValidatingAdmissionPolicy", "rl-rl-energy-node-reports"),
        ("ValidatingAdmissionPolicyBinding", "rl-rl-energy-node-reports"),
    }
    trainers = {
        ("ValidatingAdmissionPolicy", "rl-rl-energy-trainer-annotations"),
        ("ValidatingAdmissionPolicyBinding", "rl-rl-energy-trainer-annotations"),
    }
    sockets = {
        ("ValidatingAdmissionPolicy", "rl-rl-energy-socket-read-only"),
        ("ValidatingAdmissionPolicyBinding", "rl-rl-energy-socket-read-only"),
    }
    assert reports | trainers | sockets <= kinds()
    without = kinds("--set", "rbac.nodeScopedReports=false")
    assert not reports & without and trainers | sockets <= without  # these two always ship
    # the socket policy follows agent.socketDir (cleaned) and the release namespace
    res = dev_cluster.helm(
        "template", "rl", str(CHART), "-n", "gpu-ops", "--kube-version", KUBE,
        "--set", "agent.socketDir=/srv/rl-sock/", "-s", "templates/admission.yaml",
    )  # fmt: skip
    (vap,) = [
        d
        for d in yaml.safe_load_all(res.stdout)
        if d
        and d["metadata"]["name"] == "rl-rl-energy-socket-read-only"
        and d["kind"] == "ValidatingAdmissionPolicy"
    ]
    variables = {v["name"]: v["expression"] for v in vap["spec"]["variables"]}
    assert json.loads(variables["socketDirs"]) == ["/srv/rl-sock"]
    assert vap["spec"]["matchConditions"][0]["expression"] == "request.namespace != 'gpu-ops'"
    bad = dev_cluster.helm(
        "template",
        "rl",
        str(CHART),
        "--kube-version",
        KUBE,
        "--set",
        "rbac.watchNamespaces={Team_A}",
        check=False,
    )
    assert bad.returncode != 0 and "/rbac/watchNamespaces/0" in bad.stderr, bad.stderr
