"""What every Ray test needs before it imports ray: token authentication (Ray 2.60's default),
with a token of the test session's own rather than the user's ~/.ray one, shared by this
process, the instances it starts and the runs' workers. Set here, once for the folder, so no
test module depends on another having been imported first."""

from __future__ import annotations

import os

os.environ["RAY_AUTH_MODE"] = "token"
os.environ.setdefault("RAY_AUTH_TOKEN", os.urandom(32).hex())
os.environ["RAY_COLOR_PREFIX"] = "0"  # plain log lines, as the tests read them
