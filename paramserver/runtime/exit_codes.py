"""The exit codes of every command and process of a cluster: one scheme.

Owns the numbers only; each command says which outcome it met in one line.

* ``EXIT_OK`` (0): done (the job finished, the command was carried out, a
  server or shard host shut down cleanly).
* ``EXIT_FAILED`` (1): failed while running: the job, the cluster (lost, or
  unreachable), storage, or a command the cluster could not carry out or
  answer in time.  Trying again may succeed.
* ``EXIT_REFUSED`` (2): refused for what the caller gave, before doing
  anything: bad flags or job config (argparse's usage errors exit 2 too), a
  missing or wrong token, a credential short of what the call needs, a job
  that cannot run here.  Trying again the same way fails the same way.
* ``EXIT_NO_CHECKPOINT`` (3): a shard process found no checkpoint to restore
  from that verifies (its supervisor does not restart it).
* ``EXIT_DISK_FULL`` (4): a shard process could not write its row store (its
  disk is full, or failing): it ends without dropping a row, and its
  supervisor does not restart it (the disk would fill again); its tables are
  as of the newest checkpoint.
"""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_REFUSED = 2
EXIT_NO_CHECKPOINT = 3
EXIT_DISK_FULL = 4
