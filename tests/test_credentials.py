"""Roles scoped by credential, end to end: a coordinator with a token and no shard token file starts its own
shards (they carry the secret it made for this run), and a ``ps-server --join`` host with a shard token of
its own is refused at once (exit 2), each side's log saying why in one line.

The rules themselves are tested in process: the service's Join check in ``test_control_service.py``, the
credential as call metadata on a real port and the bounded-rate log of refusals in ``test_control_grpc.py``,
the flags in ``test_cli.py``.
"""

import re
import time

import pytest

from commands import errors, start_server, terminate_within

TOKEN = "cluster-token-1"
SHARD_TOKEN = "shard-token-2"


@pytest.mark.timeout(90)
def test_a_join_host_with_a_shard_token_of_its_own_is_refused_at_once(commands, tmp_path):
    token, own_shard_token = tmp_path / "token", tmp_path / "shard-token"
    token.write_text(TOKEN + "\n")
    own_shard_token.write_text(SHARD_TOKEN + "\n")
    # The coordinator's own shard joins with the secret made for this run.
    server, address = start_server(commands, "--shards", "1", "--token-file", str(token), "--heartbeat-timeout", "2")
    began = time.monotonic()
    joining = commands.run("ps-server", "--join", address, "--shards", "1", "--token-file", str(token),
                           "--shard-token-file", str(own_shard_token), timeout=60)
    took = time.monotonic() - began
    assert joining.returncode == 2, joining.stderr[-3000:]
    assert re.search(r"shard_127_0_0_1_0 could not join: .*PERMISSION_DENIED: .*admits only the shards it started "
                     r"itself", joining.stderr), joining.stderr[-3000:]
    assert "Traceback" not in joining.stderr
    assert took < 45, f"the refused host took {took:.1f} s to exit"
    print(f"refused join host exited {joining.returncode} after {took:.1f} s")
    terminate_within(server, 15)
    log = errors(server)
    assert "shard token made for this run" in log
    assert re.search(r"refused Join from \S+: PERMISSION_DENIED: shard shard_127_0_0_1_0: this coordinator admits "
                     r"only", log), log[-3000:]
