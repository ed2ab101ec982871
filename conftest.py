"""Repository-wide pytest set-up.

On CPU, jax must see 8 virtual devices so mesh tests run here. The flag is
set at import time, before anything imports jax; pytest-xdist workers import
this file too, so they get the same devices.
"""
import os

_FLAG = '--xla_force_host_platform_device_count=8'
if _FLAG not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + _FLAG).strip()
