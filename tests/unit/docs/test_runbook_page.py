"""docs/install.md's runbook as ``tests/e2e/test_runbook.py`` extracts and runs it, read here
without a cluster.

We test these aspects:
* the install section has steps 1 to 6 in order, then the uninstall section's commands; each
  command is a ``kubectl`` or ``helm`` command run from the checkout's root (paths it names
  exist), and the only ``helm install`` the runbook runs is the release's plain one (the
  kube-prometheus-stack variant is an alternative, not a second install);
* step 3 is ``kubectl rlenergy smoke`` followed by its output, whose lines (``ok`` report, lock,
  saving, ``PASS``) are the ones ``rlenergy_kubectl.smoke.render`` prints for a passing result;
  docs/kubectl-plugin.md shows the same lines;
* every ``kubectl rlenergy`` command any page gives is accepted by the plugin's own parser;
* the extraction itself: continuation lines joined, comments dropped, first alternative only.
"""

from __future__ import annotations

import re

import pytest
from docs_support import PAGES, ROOT, commands
from rlenergy_kubectl import cli, smoke

from tests.e2e.runbook_support import block_commands, runbook, shape

INSTALL = (ROOT / "docs" / "install.md").read_text()


def _passing_output() -> str:
    policy = smoke.policy("rlenergy-smoke")
    policy["status"] = {
        "phases": [{"name": "generation", "state": "locked", "clockMHz": 1155}],
        "totals": {"steps": 16, "savingPercent": 9.8, "savedJoules": 1877.0},
    }
    report = {
        "metadata": {"name": "rlenergy-smoke.gpu-node-1"},
        "spec": {
            "policyName": smoke.POLICY,
            "nodeName": "gpu-node-1",
            "gpus": [{"uuid": "GPU-1", "condition": "ok"}],
            "lastStep": 15,
        },
    }
    return smoke.render(smoke.evaluate(policy, [report]), namespace=smoke.NAMESPACE, elapsed_s=52)


def test_steps_in_order_then_uninstall() -> None:
    steps = runbook(INSTALL)
    assert [s.name for s in steps] == ["1", "2", "3", "4", "5", "6", "uninstall"]
    for step in steps:
        assert step.commands, step
        for cmd in step.commands:
            assert cmd.split()[0] in ("kubectl", "helm"), cmd
            for word in cmd.split():
                if re.match(r"^(\./)?(crds|helm)/", word):
                    assert (ROOT / word).exists(), (cmd, word)
    installs = [c for s in steps for c in s.commands if c.startswith("helm install")]
    assert installs == ["helm install rl-energy ./helm/rl-energy -n rl-energy-system"]


def test_smoke_step_shows_what_the_plugin_prints() -> None:
    step = runbook(INSTALL)[2]
    assert step.commands == ("kubectl rlenergy smoke",)
    expected = step.expected["kubectl rlenergy smoke"]
    assert shape(expected) == shape(_passing_output())
    assert [w[:2] for w in shape(expected)[1:]] == [
        ["ok", "report"], ["ok", "lock"], ["ok", "saving"], ["PASS"],
    ]  # fmt: skip
    plugin_page = (ROOT / "docs" / "kubectl-plugin.md").read_text()
    assert expected in plugin_page


def _plugin_commands() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        text = page.read_text() if page.is_file() else ""
        for c in commands(text):
            if c.startswith("kubectl rlenergy "):
                found.append((page.name, c))
    return found


@pytest.mark.parametrize(("page", "cmd"), _plugin_commands())
def test_plugin_commands_in_the_docs_parse(page: str, cmd: str) -> None:
    args = cli._parser().parse_args(cmd.split()[2:])
    assert args.command in ("status", "smoke"), (page, cmd)


def test_block_commands() -> None:
    block = "# a comment\nkubectl a \\\n  b   # trailing\nhelm c\n# or, else:\nhelm d\n"
    assert block_commands(block) == ["kubectl a b", "helm c"]
