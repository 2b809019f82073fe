"""``RLEnergyNodeReport``: one per policy and node, written only by that node's agent.

Its spec is ``rlenergy.api.node.NodeReport`` (the operator<->agent wire model); this module
names the resource so the CRD generator, the operator and the agent agree on it. The agent sets
an owner reference to its policy, so deleting the policy garbage-collects its reports.
"""

from __future__ import annotations

from rlenergy.api import naming
from rlenergy.api.v1alpha1 import policy as api_policy

GROUP = api_policy.GROUP
VERSION = api_policy.VERSION
KIND = "RLEnergyNodeReport"
PLURAL = "rlenergynodereports"
SHORT_NAME = "rlenr"
POLICY_LABEL = "rlenergy.io/policy"
"""Label the agent puts on each report: the policy's name (the operator lists by it)."""
NODE_LABEL = "rlenergy.io/node"
"""Label the agent puts on each report: the node's name."""


def report_name(policy_name: str, node_name: str) -> str:
    """Object name of the report of ``policy_name`` on ``node_name`` (``naming.report_name``)."""
    return naming.report_name(policy_name, node_name)
