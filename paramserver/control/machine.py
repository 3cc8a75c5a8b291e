"""What identifies the machine a process runs on, as members tell the coordinator.

Owns ``this_machine()``: the host name and the kernel's boot id, so that
the coordinator can count the cluster's processes that share a machine's
CPUs (``Membership.host_processes``; threads are sized by it,
``runtime.threads``).  Two containers with host names of their own count
as two machines (each has its own CPU limit, read where threads are
chosen); processes of one container, or of one host started by hand, count
as one.  Never the address a member advertises: one host is reached as
127.0.0.1 and as its outward address alike.
"""

import socket

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def this_machine(boot_id_path: str = _BOOT_ID) -> str:
    """``"<host name>/<boot id>"`` (the boot id left out where the system has none)."""
    try:
        with open(boot_id_path) as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}" if boot_id else socket.gethostname()
