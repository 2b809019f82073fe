"""RLEnergyPolicy API, group rlenergy.io, version v1alpha1."""
