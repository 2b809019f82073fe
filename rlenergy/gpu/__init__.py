"""rl-energy-operator."""
