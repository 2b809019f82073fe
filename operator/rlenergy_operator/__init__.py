"""rl-energy operator: kopf handlers for RLEnergyPolicy (``kopf run -m rlenergy_operator``).

Importing the package registers the handlers; nothing else lives here.
"""

from rlenergy_operator import handlers as handlers
from rlenergy_operator import webhook as webhook
