"""``kubectl rlenergy``: a kubectl plugin that shows what the rl-energy operator achieved.

Installed as the console script ``kubectl-rlenergy`` (kubectl runs any ``kubectl-<name>`` on
``PATH`` as ``kubectl <name>``). ``cli`` parses arguments, ``kube`` reads the API (the only
module using the Kubernetes client), ``view`` formats (pure). Independent of the operator and
the agent: it imports neither (import-linter).
"""
