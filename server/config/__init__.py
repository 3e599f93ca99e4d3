"""Settings: every ``serve`` flag and its FLASHTIER_* variable (``options``), the resolved ``ServerSettings``
(``settings``), the checks that stop a bad start-up with one line (``checks``; the memory plan's in
``plan_check``), the KV directory lock and the
start-up log.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["checks", "kv_dir_lock", "options", "plan_check", "settings", "startup_log"]
