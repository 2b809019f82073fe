"""NVML access: ``lib`` is the thin pynvml seam, ``backend`` the ``Gpu`` protocol on top of it."""
