"""Where this node's shared-memory files live: /dev/shm, or $PDSERVE_SHM_DIR where that is set (a
larger tmpfs where a container's /dev/shm is small: docker gives 64 MiB). The KV pools
(kvtransfer.pool_files) live under it and a worker's default KV budget (runtime.config) is sized
from its free space, so every worker of one node must see the same directory. Stateless."""
from __future__ import annotations

import os

SHM_DIR = "/dev/shm"  # the shared-memory filesystem, unless $PDSERVE_SHM_DIR names another
SHM_DIR_ENV = "PDSERVE_SHM_DIR"


def shm_dir() -> str:
    """$PDSERVE_SHM_DIR if set, else /dev/shm."""
    return os.environ.get(SHM_DIR_ENV) or SHM_DIR
